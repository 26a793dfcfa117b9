"""Hostile session ids and fuzzed messages: typed tpkv errors only, nothing outside the L3 root."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.faults.crashcheck import block_bytes_of, close_stores, files_outside, open_stores
from tpkv.config import HbmConfig, HostConfig, KvGeometry, SsdConfig, TpkvConfig
from tpkv.controller.controller import Controller
from tpkv.errors import InvalidSessionIdError, TpkvError
from tpkv.protocol.messages import CommitOutcome, StepResult, move_result_from_dict
from tpkv.protocol.plan import MovePlan
from tpkv.protocol.wire import decode, decode_plan, encode

VALID_ID = re.compile(r"[A-Za-z0-9._:-]{1,256}")
HOSTILE = ["../x", "/etc/passwd", "a\x00b", "\x00", "x" * 4096, "sessión", "日本",
           "..", "../../../../tmp/evil", "a/../../b", "C:\\x", "\u202e", "con", "-rf", ""]
_ids = st.one_of(st.sampled_from(HOSTILE), st.text(max_size=300),
                 st.text(alphabet="./\\\x00:-_aZ9é", max_size=12))


def _controller(l3_root: Path) -> Controller:
    g = KvGeometry(num_layers=1, num_kv_heads=2, head_dim=8, dtype="float16", block_tokens=4,
                   tp_size=1)
    return Controller(TpkvConfig(
        geometry=g, l1=HbmConfig(num_blocks=16),
        l2=HostConfig(budget_bytes=32 * g.block_bytes, arena_bytes=1 << 20),
        l3=SsdConfig(root=str(l3_root), budget_bytes=SsdConfig.budget_for(64, g))))


@pytest.fixture(scope="module")
def place(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    parent = tmp_path_factory.mktemp("ids")
    root = parent / "l3"
    stores = open_stores(root)
    yield {"parent": parent, "root": root, "stores": stores,
           "controller": _controller(tmp_path_factory.mktemp("controller-l3"))}
    close_stores(stores)


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sid=_ids)
@example(sid="../x")
@example(sid="/etc/passwd")
@example(sid="a\x00b")
@example(sid="x" * 4096)
@example(sid="naïve")
def test_any_session_id_is_served_or_refused_with_a_typed_error(place: dict[str, Any],
                                                                 sid: str) -> None:
    stores, root = place["stores"], place["root"]
    blocks = [block_bytes_of("fuzz", 0, 0, 1)]
    valid = VALID_ID.fullmatch(sid) is not None
    for call in (lambda: [s.write_blocks(sid, np.array([0]), blocks) for s in stores],
                 lambda: stores[0].commit_manifest(sid),
                 lambda: stores[1].read_blocks(sid, np.array([0]), [np.empty_like(blocks[0])]),
                 lambda: stores[0].session_indices(sid),
                 lambda: place["controller"].open_session(sid),
                 lambda: [s.drop_session(sid) for s in stores]):
        if valid:
            call()
        else:
            with pytest.raises(InvalidSessionIdError):
                call()
    if valid:
        place["controller"].close_session(sid)
    assert files_outside(root, place["parent"]) == []
    for path in root.rglob("*"):  # only fan-out dirs and hash-named files, never the raw id
        rel = path.relative_to(root).parts
        if len(rel) == 1 and re.fullmatch(r"owner\.r[0-9]+\.lock", rel[0]):
            continue  # the stores' owner locks
        assert re.fullmatch(r"[0-9a-f]{2}", rel[0]) and len(rel) <= 2, rel
        assert len(rel) == 1 or re.fullmatch(r"[0-9a-f]{64}\.[a-z0-9.]+", rel[1]), rel


# ---- fuzzed messages -------------------------------------------------------------------------

_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(),
                  st.text(max_size=8), st.binary(max_size=8))
_value = st.recursive(_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)


def _valid_messages() -> dict[str, dict[str, Any]]:
    plan = MovePlan(3, np.array([7]), np.array([0]), np.array([4]), np.array([1]),
                    np.array([2]), np.array([0]), np.array([0]), ("s",))
    step = StepResult(tick=1, session_ids=("s",), num_tokens=np.array([4]),
                      block_offsets=np.array([0, 1]), block_table=np.array([5]), plans=(plan,))
    return {"plan": plan.to_dict(), "step": step.to_dict(),
            "commit": CommitOutcome(3, True).to_dict(),
            "result": {"epoch": 3, "rank": 0, "moves_applied": 1, "slot_map_digest": 9}}


_DECODERS = {"plan": decode_plan,
             "step": lambda data: StepResult.from_dict(decode(data)),
             "commit": lambda data: CommitOutcome.from_dict(decode(data)),
             "result": lambda data: move_result_from_dict(decode(data))}
# One input each that once got an untyped error out (int(inf), numpy and 2**63).
_KNOWN_BUG: dict[str, dict[str, Any]] = {
    "plan": {"epoch": math.inf}, "step": {"num_tokens": [2**63]},
    "commit": {"epoch": math.inf}, "result": {"rank": math.inf},
}


# Untyped errors the fuzz below tolerates: none (anything but a TpkvError fails it).
_KNOWN_UNTYPED: tuple[type[BaseException], ...] = ()


def _decode_typed(kind: str, message: Any, tolerate: tuple[type[BaseException], ...]) -> None:
    try:
        data = encode(message)
    except TpkvError:
        return
    try:
        _DECODERS[kind](data)
    except TpkvError:
        pass
    except tolerate:
        pass


@pytest.mark.parametrize("kind", sorted(_DECODERS))
@settings(max_examples=250, deadline=None)
@given(data=st.data())
def test_a_message_with_any_field_replaced_gives_only_typed_errors(kind: str,
                                                                   data: st.DataObject) -> None:
    message = _valid_messages()[kind]
    field = data.draw(st.sampled_from(sorted(message)), label="field")
    message[field] = data.draw(_value, label="value")
    _decode_typed(kind, message, _KNOWN_UNTYPED)


@pytest.mark.parametrize("kind", sorted(_DECODERS))
def test_values_that_once_escaped_untyped_give_typed_errors(kind: str) -> None:
    """An epoch of inf, a count of 2**63: int() and numpy raised ValueError / OverflowError."""
    _decode_typed(kind, {**_valid_messages()[kind], **_KNOWN_BUG[kind]}, ())


@settings(max_examples=300, deadline=None)
@given(value=_value)
def test_any_msgpack_value_decodes_or_gives_a_typed_error(value: Any) -> None:
    try:
        data = msgpack.packb(value, use_bin_type=True)
    except (OverflowError, ValueError):
        return  # not representable in msgpack at all
    try:
        back = decode(data)
    except TpkvError:
        return
    assert msgpack.packb(back, use_bin_type=True) == data  # every legal value, exactly


def test_atheris_fuzz_of_the_wire_decoders(tmp_path: Path) -> None:
    """Coverage-guided, where atheris installs (it is not a project dependency)."""
    pytest.importorskip("atheris")
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("fuzz_wire.py")), "-runs=100000",
         "-seed=1", f"-artifact_prefix={tmp_path}/"], capture_output=True, text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
    assert done.returncode == 0 and "Done 100000 runs" in done.stderr, done.stderr[-3000:]
