"""Paged TP decode engine: KV of every session in L1 blocks; schedule, wait, forward, sample."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from tpkv.errors import ArgumentError, BadRequestError, ConfigError, UnknownSessionError
from tpkv.limits import MAX_SESSION_TOKENS, check_count, check_counts
from tpkv.models.graphs import DecodeGraphs
from tpkv.models.llama import Llama
from tpkv.models.paged import (
    AttentionImpl,
    PagedAttention,
    build_meta,
    check_tables,
    paged_attention_ref,
)
from tpkv.models.readback import HostReadback
from tpkv.models.scheduler import LocalScheduler
from tpkv.models.tp import tp_info
from tpkv.models.turns import (
    AdmitFn,
    Finished,
    ReleaseFn,
    ReportFn,
    ScheduleFn,
    Seq,
    StepOutput,
    StepReport,
    WaitFn,
)
from tpkv.ssd.format import validate_session_id

log = logging.getLogger(__name__)
# capture_graphs refuses to capture more graphs than this ahead of serving
MAX_AHEAD_GRAPHS = 1024


class PagedEngine:
    """Greedy decoding of many sessions whose K/V live in one rank's L1 pool tensor
    [slots, layers, 2, block_tokens, heads_per_rank, head_dim].

    Low level: `prefill` / `decode_step` with block tables given by the caller. High level:
    `add_turn` then `step()` until `has_work` is False; block tables then come from `schedule`
    (default: a LocalScheduler over the whole pool), `wait` blocks until the step's blocks are in
    L1 (default: nothing to wait for), `launched` runs once the step's forward is queued on the
    device and before its tokens are read back (the host is free while the device computes),
    `report` receives a StepReport, `release` frees a closed session's blocks. With `admit`, a
    turn added waits outside the batch (`returning`) until the hook lets it queue (its KV is
    back within reach, e.g. read ahead from L3); the batch goes on without it. Under TP every
    rank runs the same calls; the model's hooks do the rest.

    `cuda_graphs` (default: on for one rank on a GPU) replays decode steps, and with
    `paged_attention_sdpa` a one-session turn after cached tokens (up to 512 new tokens), from
    CUDA graphs (tpkv.models.graphs); a session's first prefill always runs eagerly.
    """

    def __init__(self, model: Llama, hbm_tensor: Tensor, *, schedule: ScheduleFn | None = None,
                 wait: WaitFn | None = None, report: ReportFn | None = None,
                 release: ReleaseFn | None = None, launched: Callable[[], None] | None = None,
                 admit: AdmitFn | None = None,
                 attention: AttentionImpl = paged_attention_ref,
                 max_batch: int = 64, max_prefill_tokens: int = 8192,
                 eos_token_id: int | None = None, scheduler_seed: int | None = None,
                 cuda_graphs: bool | None = None) -> None:
        cfg = model.config
        local_kv_heads = model.blocks[0].attn.wk.out_features // cfg.head_dim
        want = (cfg.num_layers, 2, "block_tokens", local_kv_heads, cfg.head_dim)
        shape = tuple(hbm_tensor.shape)
        if len(shape) != 6 or shape[1:3] != want[:2] or shape[4:] != want[3:]:
            raise ConfigError(f"L1 tensor has shape {shape}; this rank's model needs "
                              f"[slots, {', '.join(map(str, want))}]")
        if hbm_tensor.device != model.device:
            raise ConfigError(f"L1 is on {hbm_tensor.device}, the model on {model.device}")
        self.model = model
        self.pool = hbm_tensor
        self.num_slots, self.block_tokens = shape[0], shape[3]
        self.scheduler: LocalScheduler | None = None
        if schedule is None:
            local = self.scheduler = LocalScheduler(self.num_slots, self.block_tokens,
                                                    scheduler_seed)
            schedule = local.schedule
            release = release or (lambda session: local.close(session) if session in local
                                  else 0)  # sessions run by prefill/decode_step hold no slots
        self.schedule: ScheduleFn = schedule
        self.wait: WaitFn = wait or (lambda tables: None)
        self.report: ReportFn = report or (lambda step_report: None)
        self.launched: Callable[[], None] = launched or (lambda: None)
        self.release: ReleaseFn = release or (lambda session: None)
        self.admit = admit
        self.attention = attention
        if cuda_graphs is None:  # default: on a GPU, for one rank (TP collectives run eagerly)
            cuda_graphs = hbm_tensor.device.type == "cuda" and tp_info(model)[1] == 1
        self.graphs = DecodeGraphs(model, hbm_tensor, attention) if cuda_graphs else None
        # tokens and attention mass read back past the copy engines' queues (tier copies)
        self.readback = HostReadback(hbm_tensor.device)
        # time_device = True (GPU): each forward is also timed on the device, from its first
        # copy or kernel (a replay's inputs, once built) to its logits (forward_device_s); the
        # rest of its host time is the host's (building inputs, work once launched, the GIL)
        self.time_device = False
        self.forward_device_s: float | None = None
        self.max_batch, self.max_prefill_tokens = max_batch, max_prefill_tokens
        self.eos_token_id = eos_token_id
        self.seqs: dict[str, Seq] = {}
        self.arrived: list[Seq] = []  # turns added since the last step (with `admit`)
        self.returning: list[Seq] = []  # turns the admit hook keeps outside the batch for now
        self.waiting: deque[Seq] = deque()  # turns whose prompt is not yet prefilled
        self.running: list[Seq] = []  # turns decoding
        self.tick = 0
        self._step: tuple[str, list[Seq]] | None = None  # the step() in progress
        self._admitted = False  # admit_pending() ran for the coming step

    # ---- the step loop ---------------------------------------------------------------------
    def add_turn(self, session: str, prompt_token_ids: Sequence[int], max_new_tokens: int) -> None:
        """Queue a turn: its prompt follows whatever the session holds; it generates up to
        `max_new_tokens` tokens (>= 1). Every check comes first: a refused turn leaves nothing
        queued (a valid session id, token ids within the vocabulary, and a session that with
        the prompt still fits L1)."""
        validate_session_id(session)
        old = self.seqs.get(session)
        if old is not None and self._busy(old):
            raise BadRequestError(f"session {session!r} already has a turn in progress")
        new = check_count("max_new_tokens", max_new_tokens, MAX_SESSION_TOKENS,
                          "MAX_SESSION_TOKENS", low=1)
        vocab = self.model.config.vocab_size
        prompt = check_counts("prompt_token_ids", prompt_token_ids, vocab - 1, "vocab_size - 1")
        if not (len(prompt) or (old is not None and old.num_uncached)):
            raise BadRequestError(f"a turn needs a token to start from (session {session!r})")
        total, room = (len(old.token_ids) if old else 0) + len(prompt), self.num_slots
        if -(-total // self.block_tokens) > room:
            raise ArgumentError(f"session {session!r} would hold {total} tokens with this "
                                f"prompt of {len(prompt)}: {-(-total // self.block_tokens)} "
                                f"blocks, more than L1's {room} slots")
        seq = self.seqs.setdefault(session, Seq(session))
        seq.token_ids.extend(prompt.tolist())
        seq.max_new_tokens, seq.generated = new, []
        (self.waiting if self.admit is None else self.arrived).append(seq)

    def _busy(self, seq: Seq) -> bool:
        return any(seq is s for q in (self.arrived, self.returning, self.waiting, self.running)
                   for s in q)

    def capture_graphs(self, max_tokens: int) -> int:
        """Before the first turn: capture the CUDA graph of every step shape that batches of up
        to `max_batch` sessions of up to `max_tokens` tokens meet, so that no step pays for one
        (DecodeGraphs.capture_ahead); returns how many it captured (0 without graphs)."""
        blocks = -(-check_count("max_tokens", max_tokens, MAX_SESSION_TOKENS,
                                "MAX_SESSION_TOKENS", low=1) // self.block_tokens)
        if blocks > self.num_slots:
            raise ArgumentError(f"max_tokens {max_tokens} is {blocks} blocks, more than L1's "
                                f"{self.num_slots} slots")
        if self.seqs:  # their blocks may be copied while a capture writes into L1
            raise BadRequestError(f"capture_graphs runs before the first turn; the engine "
                                  f"holds {len(self.seqs)} sessions")
        if self.graphs is None:
            return 0
        keys = self.graphs.ahead_keys(self.max_batch, max_tokens)
        if len(keys) > MAX_AHEAD_GRAPHS:  # (tens of ms each: minutes, and their outputs' memory)
            raise ArgumentError(f"capture_graphs would capture {len(keys)} graphs (max_batch "
                                f"{self.max_batch}, max_tokens {max_tokens}), more than "
                                f"{MAX_AHEAD_GRAPHS}; lower max_tokens or max_batch")
        t0 = time.perf_counter()
        made = self.graphs.capture_ahead(keys)
        log.info("captured %d CUDA graphs in %.1f s", made, time.perf_counter() - t0)
        return made

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.arrived or self.returning)

    def step(self) -> list[Finished]:
        """One step: admit -> schedule -> wait for the step's blocks -> forward -> sample ->
        report."""
        if not self._admitted:
            self.admit_pending()
        self._admitted = False
        kind, seqs = self._pick()
        if not seqs:
            return []
        new = [s.num_uncached for s in seqs]
        tables = self.schedule([s.session for s in seqs], new)  # L1 slot of every block
        fed = tuple(s.num_uncached for s in seqs)  # with tokens the schedule lost (recompute)
        self.wait(tables)  # the step's plans are applied: its blocks are in L1
        t0 = time.perf_counter()
        self._step = (kind, seqs)
        try:
            out = self._forward(seqs, [tables.session_slots(i) for i in range(len(seqs))])
        finally:
            self._step = None
        self.tick += 1
        self.report(StepReport(self.tick, kind, tables, fed, out,
                               time.perf_counter() - t0))
        return self._postprocess(kind, seqs)

    def admit_pending(self) -> None:
        """The admit hook's choice for the coming step (step() makes it, once, unless called
        first, e.g. to see what the step will run in `waiting` and `running`): turns it lets in
        queue for the batch (those outside it first, then the ones just added); the others
        wait outside."""
        self._admitted = True
        if self.admit is None or not (self.arrived or self.returning):
            return
        back, new = self.returning, self.arrived
        idle = not (self.waiting or self.running)
        go = set(self.admit([s.session for s in new], [s.session for s in back], idle))
        self.arrived = []
        self.returning = [s for s in back + new if s.session not in go]
        self.waiting.extend(s for s in back + new if s.session in go)

    def run(self) -> list[Finished]:
        """Step until every queued turn is done."""
        done: list[Finished] = []
        while self.has_work:
            done.extend(self.step())
        return done

    def close_session(self, session: str) -> None:
        """Forget a session whose turns are over and release its blocks."""
        seq = self._seq(session)
        if self._busy(seq):
            raise BadRequestError(f"session {session!r} has a turn in progress")
        del self.seqs[session]
        self.release(session)

    def invalidate(self, session: str, keep_tokens: int) -> int:
        """K/V of the session's tokens from `keep_tokens` on are lost (e.g. the controller
        dropped their blocks): the next step feeds them again. Returns the tokens to recompute."""
        seq = self._seq(session)
        seq.num_cached = max(0, min(seq.num_cached, keep_tokens))
        return seq.num_uncached

    @property
    def prefill_next(self) -> bool:
        """Whether the next step() is a prefill: a turn waits and the batch has room for it."""
        return bool(self.waiting) and len(self.running) < self.max_batch

    def _pick(self) -> tuple[Literal["prefill", "decode"], list[Seq]]:
        """Prefill first while fewer than max_batch turns decode (whole prompts, up to
        max_prefill_tokens, at least one), else decode: a turn waits in `waiting` until the
        batch has room for it. Changes nothing: a step whose schedule or forward raises can
        simply be retried."""
        if self.prefill_next:
            return "prefill", self._prefill_pick(list(self.waiting), len(self.running))
        return "decode", self.running[:self.max_batch]

    def _prefill_pick(self, waiting: list[Seq], running: int) -> list[Seq]:
        """The turns of `waiting` a prefill takes: the first, then more while their tokens fit
        max_prefill_tokens and the batch (`running` decoding) stays within max_batch."""
        seqs = [waiting[0]]
        budget = self.max_prefill_tokens - seqs[0].num_uncached
        for seq in waiting[1:self.max_batch - running]:
            if seq.num_uncached > budget:
                break
            budget -= seq.num_uncached
            seqs.append(seq)
        return seqs

    def predict_next(self, joining: Sequence[str] = ()) -> tuple[list[str], list[int],
                                                                  list[str]] | None:
        """During step(), once its forward is launched: the batch (sessions, new tokens) the
        next step() runs if no turn is added or closed before it, none of this step's sessions
        samples its EOS token and the admit hook lets in the turns of `joining` (of those
        outside the batch) and no other, and the sessions decoding then (`running` after this
        step). None outside step()."""
        if self._step is None:
            return None
        join = set(joining)
        waiting, running = self._after_step(*self._step)
        waiting += [s for s in self.returning if s.session in join]
        names = [s.session for s in running]
        if waiting and len(running) < self.max_batch:
            picked = self._prefill_pick(waiting, len(running))
            return [s.session for s in picked], [s.num_uncached for s in picked], names
        batch = running[:self.max_batch]
        return [s.session for s in batch], [1] * len(batch), names

    def room(self) -> int:
        """Places in the batch for turns outside it (those the admit hook keeps out): max_batch
        less the turns decoding and those queued for it (`waiting`); during step(), once its
        forward is launched, those the next step has if none of this step's sessions samples
        its EOS token and no turn joins (as predict_next counts them)."""
        waiting, running = (self._after_step(*self._step) if self._step is not None
                            else (self.waiting, self.running))
        return max(0, self.max_batch - len(running) - len(waiting))

    def _after_step(self, kind: str, seqs: list[Seq]) -> tuple[list[Seq], list[Seq]]:
        """During step() (a `kind` step of `seqs`): `waiting` and `running` as this step
        leaves them, if none of its sessions samples its EOS token."""
        waiting, running = list(self.waiting), list(self.running)
        if kind == "prefill":  # (as _postprocess will move them)
            waiting, running = waiting[len(seqs):], running + seqs
        # this step adds one generated token to each of its sessions
        ending = {id(s) for s in seqs if len(s.generated) + 1 >= s.max_new_tokens}
        return waiting, [s for s in running if id(s) not in ending]

    def _postprocess(self, kind: str, seqs: list[Seq]) -> list[Finished]:
        if kind == "prefill":  # the prefilled turns move from waiting to running
            for _ in seqs:
                self.waiting.popleft()
            self.running.extend(seqs)
        done = []
        for seq in seqs:
            seq.generated.append(seq.token_ids[-1])
            if (len(seq.generated) >= seq.max_new_tokens
                    or seq.token_ids[-1] == self.eos_token_id):
                self.running.remove(seq)  # its last token stays uncached until the next turn
                done.append(Finished(seq.session, tuple(seq.generated)))
        return done

    # ---- explicit block tables (tests, and callers with their own scheduling) ---------------
    def prefill(self, session: str, token_ids: Sequence[int],
                block_slots: np.ndarray | Sequence[int]) -> StepOutput:
        """Append `token_ids` to a session (after its uncached tail, if any), write their K/V
        into `block_slots` (every block of the session, logical order) and sample one token."""
        seq = self.seqs.setdefault(session, Seq(session))
        seq.token_ids.extend(int(t) for t in token_ids)
        return self._forward([seq], [block_slots])

    def decode_step(self, batch: Sequence[tuple[str, np.ndarray | Sequence[int]]]
                    ) -> StepOutput:
        """One token for each (session, block_slots): feeds each session's uncached tail (the
        token sampled last) and samples the next."""
        return self._forward([self._seq(s) for s, _ in batch], [slots for _, slots in batch])

    @torch.inference_mode()
    def _forward(self, seqs: list[Seq], slots: Sequence[np.ndarray | Sequence[int]]
                 ) -> StepOutput:
        """Write the uncached tokens' K/V, attend through the block tables, sample greedily."""
        for seq in seqs:
            if seq.num_uncached < 1:
                raise BadRequestError(f"session {seq.session!r} has no token to feed")
        seq_lens, q_lens = [len(s.token_ids) for s in seqs], [s.num_uncached for s in seqs]
        block_mass: torch.Tensor | None
        timed = self.time_device and self.model.device.type == "cuda"
        graphs = self.graphs if self.graphs is not None and (max(q_lens) == 1 or (
            len(seqs) == 1 and self.graphs.takes_prefill(q_lens[0], seq_lens[0]))) else None
        if timed:  # from a replay's inputs (built on the host first), or an eager forward's
            begun, ended = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            if graphs is not None:
                graphs.begun = begun
            else:
                begun.record()
        if graphs is not None and max(q_lens) == 1:  # decode: one graph replay
            tables, _, _, nb = check_tables(slots, seq_lens, q_lens, self.block_tokens,
                                            self.num_slots)
            logits, block_mass = graphs.forward([s.token_ids[-1] for s in seqs], tables,
                                                seq_lens)
        elif graphs is not None:  # a turn: one replay
            tables, _, _, nb = check_tables(slots, seq_lens, q_lens, self.block_tokens,
                                            self.num_slots)
            logits = graphs.forward_prefill(seqs[0].token_ids[seqs[0].num_cached:], tables[0],
                                            seq_lens[0])
            block_mass = None
        else:
            meta = build_meta(slots, seq_lens, q_lens, self.block_tokens, self.num_slots,
                              self.model.device)
            new_ids = [t for s in seqs for t in s.token_ids[s.num_cached:]]
            token_ids = torch.tensor(new_ids, dtype=torch.long, device=self.model.device)
            attn = PagedAttention(self.pool, meta, self.attention)
            logits = self.model(token_ids, meta.positions, attn, meta.last_rows)  # [B, vocab]
            block_mass, nb = attn.block_mass, -(-np.asarray(seq_lens) // self.block_tokens)
        if timed:
            ended.record()
        self.launched()
        tokens = self.readback.tolist(logits.argmax(dim=-1))
        if timed:  # (the read back is past `ended`: no wait)
            ended.synchronize()
            self.forward_device_s = begun.elapsed_time(ended) / 1e3
        mass: tuple[np.ndarray, ...] = tuple(np.zeros(0, dtype=np.float32) for _ in seqs)
        if block_mass is not None:
            per_session = self.readback.numpy(block_mass)  # [B, NB]
            mass = tuple(per_session[i, :nb[i]].copy() for i in range(len(seqs)))
        for seq, token in zip(seqs, tokens):
            seq.num_cached = len(seq.token_ids)
            seq.token_ids.append(int(token))
        return StepOutput(tuple(s.session for s in seqs), tuple(tokens), logits, mass)

    def _seq(self, session: str) -> Seq:
        if not isinstance(session, str) or session not in self.seqs:
            raise UnknownSessionError(f"the engine holds no session {session!r}")
        return self.seqs[session]
