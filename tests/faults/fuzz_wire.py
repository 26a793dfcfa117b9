"""Coverage-guided fuzz (atheris) of the wire decoders: `python tests/faults/fuzz_wire.py -runs=N`.

Any exception other than a TpkvError (and the two untyped kinds pinned in test_bad_input.py) is a
crash: atheris prints the input and exits non-zero. test_bad_input.py runs it where atheris
imports.
"""

from __future__ import annotations

import sys

import atheris
import msgpack
import numpy  # noqa: F401  (imported here: only tpkv's own code is instrumented)

with atheris.instrument_imports(include=["tpkv"]):
    from tpkv.errors import TpkvError
    from tpkv.protocol.messages import CommitOutcome, StepResult, move_result_from_dict
    from tpkv.protocol.wire import decode, decode_plan, encode

_KNOWN_UNTYPED = (ValueError, OverflowError)  # see RELIABILITY.md, "Open bug"
_FIELDS = {
    "plan": ["epoch", "session_names", "block_ids", "src_tier", "src_slot", "dst_tier",
             "dst_slot", "session_idx", "logical_idx"],
    "commit": ["epoch", "committed", "mismatch_ranks", "num_misses", "expected_digest",
               "resync_needed"],
    "result": ["epoch", "rank", "moves_applied", "slot_map_digest", "miss_block_ids"],
}


def _value(fdp: atheris.FuzzedDataProvider, depth: int = 0) -> object:
    """Any msgpack-able value: ints up to 80 bits, floats (inf, nan), text, bytes, lists."""
    pick = fdp.ConsumeIntInRange(0, 6 if depth < 2 else 4)
    if pick == 0:
        return fdp.ConsumeInt(10)
    if pick == 1:
        return fdp.ConsumeRegularFloat() if fdp.ConsumeBool() else fdp.ConsumeFloat()
    if pick == 2:
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 6))
    if pick == 3:
        return fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 6))
    if pick == 4:
        return None if fdp.ConsumeBool() else fdp.ConsumeBool()
    if pick == 5:
        return [_value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 4))]
    return {fdp.ConsumeUnicodeNoSurrogates(3): _value(fdp, depth + 1)
            for _ in range(fdp.ConsumeIntInRange(0, 3))}


def _structured(fdp: atheris.FuzzedDataProvider) -> bytes:
    """A map with (most of) the field names one decoder expects and fuzzed values: reaches past
    the msgpack layer into the field checks far more often than raw bytes do."""
    kind = fdp.PickValueInList(sorted(_FIELDS))
    message = {name: _value(fdp) for name in _FIELDS[kind] if fdp.ConsumeIntInRange(0, 9)}
    try:
        return bytes([ord(kind[0])]) + encode(message)
    except TpkvError:
        return b""


def test_one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    payload = _structured(fdp) if fdp.ConsumeBool() else fdp.ConsumeBytes(4096)
    decoders = {ord("p"): decode_plan,
                ord("c"): lambda d: CommitOutcome.from_dict(decode(d)),
                ord("r"): lambda d: move_result_from_dict(decode(d)),
                ord("s"): lambda d: StepResult.from_dict(decode(d))}
    try:
        if payload and payload[0] in decoders:
            decoders[payload[0]](payload[1:])
        else:
            decode(payload)
    except TpkvError:
        pass
    except _KNOWN_UNTYPED:
        pass
    except msgpack.ExtraData:  # never escapes decode: reaching here is a crash
        raise


if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
