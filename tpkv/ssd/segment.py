"""L3 segment record I/O: contiguous batched record writes and checked scatter reads of records."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeGuard

import numpy as np

from tpkv.errors import SsdFormatError
from tpkv.ssd import kernels
from tpkv.ssd.backend import (
    IOV_MAX,
    BlockFile,
    BlockViews,
    aligned_empty,
    is_direct_capable,
    row_addresses,
)
from tpkv.ssd.format import (
    ALIGN_BYTES,
    HEADER_CRC_BYTES,
    SegmentIdentity,
    check_record_header,
    check_record_headers,
    check_segment_header,
    crc_many,
    pack_record_header,
    pack_segment_header,
    round_up,
)

log = logging.getLogger(__name__)

STAGE_BYTES = 32 << 20  # most payload bytes staged through the aligned buffer per syscall
_IOVECS_PER_RECORD = 3  # header, payload, padding


def last_positions(stored: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """Record number of the last record holding each wanted index (the newest wins), or -1."""
    if len(stored) == 0:
        return np.full(len(wanted), -1, dtype=np.int64)
    uniq, first_in_reversed = np.unique(stored[::-1], return_index=True)
    last = len(stored) - 1 - first_in_reversed
    k = np.minimum(np.searchsorted(uniq, wanted), len(uniq) - 1)
    return np.where(uniq[k] == wanted, last[k], -1).astype(np.int64)


class SegmentIo:
    """Moves block records between host buffers and an open segment file.

    Record headers are built in a per-thread page-aligned buffer. Payloads go straight from and
    into the caller's buffers (one iovec each) unless O_DIRECT needs an alignment they lack; then
    they pass through that aligned buffer. Consecutive records become one preadv/pwritev.
    """

    def __init__(self, block_bytes: int, write_piece_bytes: int) -> None:
        self.block_bytes = block_bytes
        # With a pause between writes (a spill while its rank reads): the most bytes one pwritev
        # carries, so that a read waits behind at most this much of a spill per writing thread
        # (SsdConfig.write_piece_bytes).
        self.write_piece_bytes = write_piece_bytes
        self.padded_bytes = round_up(block_bytes)
        self.record_bytes = ALIGN_BYTES + self.padded_bytes
        self._zero_pad = np.zeros(self.padded_bytes - block_bytes, dtype=np.uint8)
        self._tls = threading.local()
        self._stats_lock = threading.Lock()
        self.read_syscall_ns = 0  # time inside the record reads' preadv, summed over threads
        # Segment headers written or checked here: (session hash, rank) -> the segment id and
        # the file's device, inode, size and mtime then. A read of the file unchanged since,
        # for that segment id, skips the header: its 4 KiB read queued behind the other jobs'
        # reads on a busy disk (bench/l3_mix.py: 14% of a read job's time beside spills on
        # the CPU machine's disk). Nothing the header would refuse is served without it: the
        # commit record every read checks holds the same fingerprints, and each record header
        # the segment id, session, rank, index and payload CRC.
        self._checked: dict[tuple[bytes, int], tuple[int, ...]] = {}

    def buffer(self, name: str, num_bytes: int) -> np.ndarray:
        """A per-thread page-aligned buffer of num_bytes (grown in MiB steps, never shrunk)."""
        buf: np.ndarray | None = getattr(self._tls, name, None)
        if buf is None or buf.nbytes < num_bytes:
            buf = aligned_empty(round_up(max(num_bytes, 1), 1 << 20))
            setattr(self._tls, name, buf)
        return buf[:num_bytes]

    def _template(self, ident: SegmentIdentity) -> np.ndarray:
        """A record header of `ident` whose index, payload CRC, number and seal the write
        kernel fills in."""
        header = self.buffer("template", ALIGN_BYTES)
        pack_record_header(ident, header, 0, 0, 0)
        return header

    def write_header(self, f: BlockFile, ident: SegmentIdentity) -> None:
        header = self.buffer("header", ALIGN_BYTES)
        pack_segment_header(ident, header)
        f.write_at([header], 0)

    def check_header(self, f: BlockFile, ident: SegmentIdentity, need_bytes: int) -> int:
        """Validate the segment header (once per file and segment id); return the file size
        (at least need_bytes)."""
        key, size_bytes = self._file_key(f, ident)
        if size_bytes < max(need_bytes, ALIGN_BYTES):
            raise SsdFormatError(f"segment is {size_bytes} bytes, {need_bytes} are committed")
        if self._checked.get((ident.session_hash, ident.rank)) == key:
            return size_bytes
        header = self.buffer("header", ALIGN_BYTES)
        got = f.read_at([header], 0)
        if got < ALIGN_BYTES:
            raise SsdFormatError(f"segment header read {got} of {ALIGN_BYTES} bytes")
        check_segment_header(header, ident)
        self._checked[(ident.session_hash, ident.rank)] = key
        return size_bytes

    def remember(self, f: BlockFile, ident: SegmentIdentity) -> None:
        """The segment's header is the one this store wrote for `ident`, and its records are
        written: reads of the file as it is now skip the header."""
        self._checked[(ident.session_hash, ident.rank)] = self._file_key(f, ident)[0]

    def forget(self, session_hash: bytes, rank: int) -> None:
        """The session's segment of `rank` is deleted: its next one is checked again."""
        self._checked.pop((session_hash, rank), None)

    @staticmethod
    def _file_key(f: BlockFile, ident: SegmentIdentity) -> tuple[tuple[int, ...], int]:
        st = os.fstat(f.fd)
        return (ident.segment_id, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns), st.st_size

    def _staged(self, f: BlockFile, bufs: Sequence[np.ndarray],
                order: np.ndarray | None = None) -> list[bool]:
        """Whether O_DIRECT needs each buffer staged (bufs[order[i]] with `order`): none without
        O_DIRECT or into a page-aligned pool's views, and no view a block is taken then."""
        num = len(bufs) if order is None else len(order)
        if not f.direct or (isinstance(bufs, BlockViews) and bufs.page_aligned):
            return [False] * num
        picked = bufs if order is None else [bufs[int(i)] for i in order]
        return [not is_direct_capable(b) for b in picked]

    def _max_records(self, max_bytes: int | None) -> int:
        """Most records one syscall carries: IOV_MAX iovecs, and max_bytes (at least one)."""
        most = max(1, IOV_MAX // _IOVECS_PER_RECORD)
        return most if max_bytes is None else min(most, max(1, max_bytes // self.record_bytes))

    def _chunk_end(self, start: int, staged: Sequence[bool],
                   max_bytes: int | None = None) -> tuple[int, int]:
        """End of the chunk from `start`: at most IOV_MAX iovecs, STAGE_BYTES staged and
        max_bytes of records (at least one record)."""
        max_records = self._max_records(max_bytes)
        end, num_staged = start, 0
        while end < len(staged) and end - start < max_records:
            if staged[end]:
                if num_staged and (num_staged + 1) * self.padded_bytes > STAGE_BYTES:
                    break
                num_staged += 1
            end += 1
        return end, num_staged

    def write_records(self, f: BlockFile, ident: SegmentIdentity, indices: np.ndarray,
                      blocks: Sequence[np.ndarray], first_record_no: int,
                      offset_bytes: int, pause: Callable[[], None] | None = None) -> None:
        """One record per block, contiguous from offset_bytes, numbered from first_record_no.
        With `pause`, in pieces of write_piece_bytes, calling pause() before each."""
        staged = self._staged(f, blocks)
        # an L2 pool's blocks move by address: their addresses, all at once
        addrs = (blocks.addresses(np.arange(len(blocks))) if self._by_address(blocks, staged, f)
                 else None)
        template = self._template(ident)  # (the same for every chunk)
        piece = None if pause is None else self.write_piece_bytes
        # nothing staged (an L2 pool's blocks): every chunk holds the same number of records
        per_chunk = 0 if any(staged) else self._max_records(piece)
        start = 0
        while start < len(blocks):
            end, num_staged = ((min(len(blocks), start + per_chunk), 0) if per_chunk
                               else self._chunk_end(start, staged, piece))
            if pause is not None:
                pause()
            num = end - start
            scratch = self.buffer("scratch", num * ALIGN_BYTES + num_staged * self.padded_bytes)
            headers = scratch[:num * ALIGN_BYTES].reshape(num, ALIGN_BYTES)
            chunk = blocks[start:end]  # (an L2 pool's BlockViews stays one: fill_headers)
            if addrs is None:
                bufs = self._write_buffers(scratch, headers, chunk, staged[start:end])
            # payload CRCs and sealed headers in one compiled call, which takes the GIL back
            # once (kernels); where it does not run, crc_many and the headers here
            if not kernels.fill_headers(headers, template, indices[start:end],
                                        first_record_no + start, chunk):
                crcs = crc_many(chunk)
                for k in range(num):
                    pack_record_header(ident, headers[k], int(indices[start + k]), crcs[k],
                                       first_record_no + start + k)
            at = offset_bytes + start * self.record_bytes
            if addrs is None:
                f.write_at(bufs, at)
            else:
                f.write_records(headers, addrs[start:end], self.block_bytes, self._zero_pad, at)
            start = end

    def _write_buffers(self, scratch: np.ndarray, headers: np.ndarray,
                       chunk: Sequence[np.ndarray], staged: Sequence[bool]) -> list[np.ndarray]:
        """write_at's buffers for the records of `chunk`: each header row, its payload (or its
        copy staged in `scratch` past the headers) and the padding."""
        bufs: list[np.ndarray] = []
        stage_at = len(headers) * ALIGN_BYTES
        for k, block in enumerate(chunk):
            bufs.append(headers[k])
            if staged[k]:
                slot = scratch[stage_at:stage_at + self.padded_bytes]
                stage_at += self.padded_bytes
                slot[:self.block_bytes] = block
                slot[self.block_bytes:] = 0
                bufs.append(slot)
            else:
                bufs.append(block)
                if len(self._zero_pad):
                    bufs.append(self._zero_pad)
        return bufs

    @staticmethod
    def _by_address(bufs: Sequence[np.ndarray], staged: Sequence[bool], f: BlockFile
                    ) -> TypeGuard[BlockViews]:
        """Whether records move between the file and `bufs` with their payloads by address
        (BlockFile.write_records / read_records, one call without the GIL): an L2 pool's views
        (BlockViews, their addresses at once) that need no staging, where the file can."""
        return bool(isinstance(bufs, BlockViews) and not any(staged)
                    and bufs.addresses(np.zeros(0, dtype=np.int64)) is not None
                    and f.by_address())

    def read_records(self, f: BlockFile, ident: SegmentIdentity, stored: np.ndarray,
                     wanted: np.ndarray, out: Sequence[np.ndarray], hits: np.ndarray) -> None:
        """Read wanted[i] into out[i] and set hits[i] for each record that checks out.

        `stored[r]` is the logical index record r must hold (the manifest's list); records past
        the end of the file, or failing any check, are left as misses.
        """
        size_bytes = self.check_header(f, ident, ALIGN_BYTES)
        on_disk = (size_bytes - ALIGN_BYTES) // self.record_bytes
        positions = last_positions(stored, wanted)
        cut = (positions >= on_disk).sum()
        if cut:
            log.warning("L3 rank %d: segment %s holds %d of %d records; %d requested blocks are "
                        "past its end", ident.rank, ident.session_hash.hex()[:16], on_disk,
                        len(stored), cut)
        order = np.flatnonzero((positions >= 0) & (positions < on_disk))
        order = order[np.argsort(positions[order], kind="stable")]
        staged = self._staged(f, out, order)
        start = 0
        while start < len(order):
            end, _ = self._chunk_end(start, staged)
            for k in range(start + 1, end):  # a run is consecutive records on disk
                if positions[order[k]] != positions[order[k - 1]] + 1:
                    end = k
                    break
            self._read_run(f, ident, stored, int(positions[order[start]]), order[start:end],
                           staged[start:end], out, hits)
            start = end

    def _read_run(self, f: BlockFile, ident: SegmentIdentity, stored: np.ndarray, first: int,
                  reqs: np.ndarray, staged: Sequence[bool], out: Sequence[np.ndarray],
                  hits: np.ndarray) -> None:
        num = len(reqs)
        scratch = self.buffer("scratch", num * ALIGN_BYTES + sum(staged) * self.padded_bytes)
        sink = self.buffer("sink", len(self._zero_pad))
        addrs = out.addresses(reqs) if self._by_address(out, staged, f) else None
        payloads: list[np.ndarray] | None = None
        bufs: list[np.ndarray] = []
        if addrs is None:
            bufs, payloads = self._read_buffers(scratch, sink, reqs, staged, out)
        began = time.perf_counter_ns()
        try:
            at = ALIGN_BYTES + first * self.record_bytes
            got = (f.read_at(bufs, at) if addrs is None else
                   f.read_records(scratch[:num * ALIGN_BYTES].reshape(num, ALIGN_BYTES), addrs,
                                  self.block_bytes, sink, at))
        except OSError as exc:
            log.warning("L3 rank %d: segment %s: reading records %d..%d failed, misses: %s",
                        ident.rank, ident.session_hash.hex()[:16], first, first + num - 1, exc)
            return
        took = time.perf_counter_ns() - began
        with self._stats_lock:
            self.read_syscall_ns += took
        num_read = min(num, got // self.record_bytes)
        headers = scratch[:num_read * ALIGN_BYTES].reshape(num_read, ALIGN_BYTES)
        actuals, header_crcs = self._crcs(headers, reqs[:num_read], staged, out,
                                          None if payloads is None else payloads[:num_read],
                                          None if addrs is None else addrs[:num_read])
        # the headers checked all at once; a record that fails is looked at alone for the log
        ok = check_record_headers(headers, ident, stored[first:first + num_read], first,
                                  header_crcs, actuals)
        for k in np.flatnonzero(~ok).tolist():
            record_no = first + k
            try:
                crc = check_record_header(headers[k], ident, int(stored[record_no]), record_no,
                                          int(header_crcs[k]))
                if int(actuals[k]) != crc:
                    raise SsdFormatError(f"record {record_no} payload crc32c "
                                         f"{int(actuals[k]):#010x} != stored {crc:#010x}")
                raise SsdFormatError(f"record {record_no} header fails the batch check")
            except SsdFormatError as exc:
                log.warning("L3 rank %d: segment %s: miss: %s", ident.rank,
                            ident.session_hash.hex()[:16], exc)
        for k in np.flatnonzero(ok).tolist():
            if staged[k]:
                assert payloads is not None  # (a staged record is read through bufs)
                out[int(reqs[k])][:] = payloads[k]
        hits[reqs[:num_read][ok]] = True

    def _read_buffers(self, scratch: np.ndarray, sink: np.ndarray, reqs: np.ndarray,
                      staged: Sequence[bool], out: Sequence[np.ndarray]
                      ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """read_at's buffers for records into out[reqs] (each header row in `scratch`, its
        payload, or a slot staged past the headers, and the padding into `sink`), and where
        each payload lands."""
        bufs: list[np.ndarray] = []
        payloads: list[np.ndarray] = []
        stage_at = len(reqs) * ALIGN_BYTES
        for k, req in enumerate(reqs):
            bufs.append(scratch[k * ALIGN_BYTES:(k + 1) * ALIGN_BYTES])
            if staged[k]:
                slot = scratch[stage_at:stage_at + self.padded_bytes]
                stage_at += self.padded_bytes
                bufs.append(slot)
                payloads.append(slot[:self.block_bytes])
            else:
                bufs.append(out[int(req)])
                payloads.append(out[int(req)])
                if len(sink):
                    bufs.append(sink)
        return bufs, payloads

    def _crcs(self, headers: np.ndarray, reqs: np.ndarray, staged: Sequence[bool],
              out: Sequence[np.ndarray], payloads: list[np.ndarray] | None,
              addrs: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """(payload CRC32Cs, header CRC32Cs) of the records read. Into a pool's views with
        nothing staged, from the payloads' addresses (`addrs` where the read took them, else
        taken at once: no view or address a record under the GIL); else over the buffers, in
        one call (crc_many)."""
        if addrs is None and isinstance(out, BlockViews) and not any(staged):
            addrs = out.addresses(reqs)
        if addrs is not None:
            header_crcs = kernels.crc_at(row_addresses(headers, np.arange(len(headers))),
                                         HEADER_CRC_BYTES)
            if header_crcs is not None:
                payload_crcs = kernels.crc_at(addrs, self.block_bytes)
                assert payload_crcs is not None  # (the kernels ran just now)
                return payload_crcs, header_crcs
        if payloads is None:  # (read by address: each payload is its out view)
            payloads = [out[int(r)] for r in reqs]
        crcs = np.asarray(crc_many(payloads + [h[:HEADER_CRC_BYTES] for h in headers]),
                          dtype=np.uint32)
        return crcs[:len(payloads)], crcs[len(payloads):]
