"""The model fingerprint names the weights (issue #28, item 6): models of one architecture with
other weights, or a fine-tune saved over the same path, never read each other's L3 records;
the same checkpoint loaded again does; a fingerprint the user sets is the one used."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.hf_cases import BT, L1_BLOCKS, L2_BLOCKS, VOCAB, one_process, tiers_config, tiny_llama
from tpkv.errors import ConfigError

pytest.importorskip("transformers")

SESSIONS = ("s0", "s1", "s2", "s3")


@pytest.fixture(autouse=True)
def _one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    one_process(monkeypatch)
    torch.set_num_threads(1)


def test_same_architecture_other_weights_get_other_fingerprints():
    from tpkv.models.hf_attach import model_fingerprint

    a, again, b = tiny_llama(seed=0), tiny_llama(seed=0), tiny_llama(seed=1)
    assert model_fingerprint(a) == model_fingerprint(again)
    assert model_fingerprint(a) != model_fingerprint(b)
    with torch.no_grad():  # one element of one tensor (its first: a sampled one)
        a.model.layers[1].mlp.down_proj.weight[0, 0] += 1.0
    assert model_fingerprint(a) != model_fingerprint(again)


def test_a_fine_tune_saved_over_the_same_path_gets_another_fingerprint(tmp_path: Path):
    from transformers import LlamaForCausalLM

    from tpkv.models.fingerprint import checkpoint_digest
    from tpkv.models.hf_attach import model_fingerprint

    path = tmp_path / "ckpt"
    tiny_llama(seed=0).save_pretrained(path)
    first = model_fingerprint(LlamaForCausalLM.from_pretrained(path))
    assert model_fingerprint(LlamaForCausalLM.from_pretrained(path)) == first  # warm restart
    files = checkpoint_digest(path)
    st = os.stat(path / "model.safetensors")
    tuned = LlamaForCausalLM.from_pretrained(path)
    with torch.no_grad():  # one tensor changed, as a merged LoRA of one projection would
        tuned.model.layers[1].self_attn.q_proj.weight.mul_(1.01)
    tuned.save_pretrained(path)
    assert model_fingerprint(LlamaForCausalLM.from_pretrained(path)) != first
    # the files alone, their size and mtime as before: the tensor's sampled bytes tell
    os.utime(path / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path / "model.safetensors").st_size == st.st_size
    assert checkpoint_digest(path) != files


def test_a_fingerprint_the_user_sets_is_used(tmp_path: Path):
    import tpkv
    from tpkv.config import TpkvConfig
    from tpkv.models.hf_attach import model_geometry
    from tpkv.ssd.format import digest32

    model = tiny_llama()
    cfg = tiers_config(model, 32, 16, str(tmp_path / "l3"))
    with tpkv.attach(model, cfg, block_tokens=BT, controller="local", device="cpu",
                     model_fingerprint="my-ft-v3") as tiers:
        assert tiers.rt.config.model_fingerprint == "my-ft-v3"
        store = tiers.rt.worker.store
        assert store is not None and store._files.ident0.model_digest == digest32("my-ft-v3")
    with tpkv.attach(model, {**cfg, "model_fingerprint": "from-config"}, block_tokens=BT,
                     controller="local", device="cpu") as tiers:
        assert tiers.rt.config.model_fingerprint == "from-config"
    full = TpkvConfig(geometry=model_geometry(model, block_tokens=BT), **cfg,
                      model_fingerprint="a")
    with pytest.raises(ConfigError, match=r"model_fingerprint='b' and the config's .*'a'"):
        tpkv.attach(model, full, controller="local", device="cpu", model_fingerprint="b")
    with pytest.raises(ConfigError, match="must be a non-empty str"):
        tpkv.attach(model, cfg, block_tokens=BT, controller="local", model_fingerprint="")
    rt = tpkv.init(TpkvConfig(geometry=model_geometry(model, block_tokens=BT), **cfg),
                   controller="local", device="cpu")
    try:  # a runtime started without one, L3 on: any model's records would be read
        with pytest.raises(ConfigError, match="model_fingerprint is empty while L3 is on"):
            tpkv.attach(model, runtime=rt)
    finally:
        rt.close()


def test_tiered_config_fingerprints_the_llama_weights():
    from tpkv.models.llama import build_model
    from tpkv.models.tiered import tiered_config

    def fp(model: Any, **extra: Any) -> str:
        return tiered_config(model, 1, block_tokens=4, l1_blocks=8, l2_blocks=8,
                             **extra).model_fingerprint

    a, b = build_model("tiny", seed=0), build_model("tiny", seed=1)
    assert fp(a) == fp(build_model("tiny", seed=0)) and fp(a).startswith("tpkv-")
    assert fp(a) != fp(b)
    assert fp(b, model_fingerprint="mine") == "mine"


# ---- a warm restart on the same L3 root ------------------------------------------------------

def _chat(tiers: Any) -> dict[str, torch.Tensor]:
    """Three turns round robin over four sessions on tiny tiers (spills to L3): each
    session's whole conversation after it."""
    gen = torch.Generator().manual_seed(5)
    history: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for turn in range(3):
            for s in SESSIONS:
                user = torch.randint(0, VOCAB, (1, 14 if turn == 0 else 5), generator=gen)
                ids = user if turn == 0 else torch.cat([history[s], user], dim=1)
                history[s] = tiers.generate(s, ids, max_new_tokens=4, do_sample=False)
    return history


def _restart(model: Any, root: Path) -> tuple[Any, dict[str, Any]]:
    """attach again on the same root (an L1 that holds everything: this run writes nothing to
    L3), its controller lost before the first step, as when the Ray actor restarts: it is
    rebuilt from this rank's slot map and the sessions the L3 store lists."""
    import tpkv
    from tpkv.controller.controller import Controller

    tiers = tpkv.attach(model, tiers_config(model, 256, 16, str(root)), block_tokens=BT,
                        controller="local", device="cpu")
    tiers.rt.controller = Controller(tiers.rt.config, restarts=1, awaiting_rebuild=True)
    return tiers, tiers.rt.rebuild_controller()


def _resume(tiers: Any, session: str) -> Any:
    """The session's cache, at the length the rebuilt controller holds for it (0 if it holds
    none): what an app that reopens a session after the restart has."""
    cache = tiers.cache(session)
    sessions = tiers.rt.controller.sessions
    if session in sessions.index:
        n = int(sessions.tokens[sessions.index[session]])
        cache.opened, cache.num_tokens, cache.ctl_tokens = True, n, n
    return cache


def _l3_hits(tiers: Any, session: str, num_blocks: int) -> tuple[int, Any]:
    """What this rank's L3 store reads of the session's first blocks (as the executor reads
    them for a load or a resync): hits, and the bytes."""
    import numpy as np

    store = tiers.rt.worker.store
    out = np.zeros((num_blocks, store.block_bytes), dtype=np.uint8)
    hits = store.read_blocks(session, np.arange(num_blocks), list(out))
    return int(hits.sum()), out


def _turn(model: Any, tiers: Any, session: str, ids: torch.Tensor) -> dict[str, Any]:
    """The next turn of `session` through the tiers, and through a DynamicCache of this
    model that starts empty."""
    from transformers import DynamicCache

    from tpkv.models.hf_attach import cache_kwarg

    cache = _resume(tiers, session)
    start, kw = cache.num_tokens, cache_kwarg(model)
    with torch.no_grad():
        got = tiers.generate(cache, ids, max_new_tokens=5, do_sample=False)
        ref = DynamicCache()
        want = model.generate(ids, **{kw: ref}, max_new_tokens=5, do_sample=False)
    kv = cache.read_kv()
    same_kv = all(torch.equal(k, lay.keys) and torch.equal(v, lay.values)
                  for (k, v), lay in zip(kv, ref.layers, strict=True))
    return {"got": got, "want": want, "same_kv": same_kv, "start": start,
            "resumed": list(cache.resumed_from), "lost": tiers.stats.lost_tokens}


@pytest.mark.timeout(180)
def test_another_model_on_the_same_l3_root_reads_none_of_the_first_models_records(
        tmp_path: Path):
    """Model A (seed 0) chats on tiny tiers and stops with its sessions' K/V in L3 (not
    closed). A again on the root (control, a warm restart): its store reads the records as
    hits and a restarted controller finds every session. Then B, same architecture, seed 1,
    the same root and session id: its store reads A's records as misses, the restarted
    controller finds no session, and B's turn is computed from the prompt: B's
    DynamicCache's tokens and K/V, never A's."""
    import tpkv

    a, b, root = tiny_llama(seed=0), tiny_llama(seed=1), tmp_path / "l3"
    first = tpkv.attach(a, tiers_config(a, L1_BLOCKS, L2_BLOCKS, str(root)), block_tokens=BT,
                        controller="local", device="cpu")
    try:
        history = _chat(first)
        moves = dict(first.stats.moves)
    finally:
        first.rt.close()  # the sessions stay open: their records stay in L3
    assert moves["l2_l3"] > 0, moves
    user = torch.tensor([[7, 8, 9, 10, 11]])

    tiers, summary = _restart(a, root)  # control: the same weights find their records
    try:
        counts = {s: len(tiers.rt.worker.store.session_indices(s)) for s in SESSIONS}
        session = max(counts, key=lambda s: counts[s])
        hits, a_bytes = _l3_hits(tiers, session, counts[session])
    finally:
        tiers.rt.close()
    assert summary["sessions"] == len(SESSIONS) and summary["l3"] > 0, summary
    assert hits == counts[session] > 0, (hits, counts)

    tiers, summary = _restart(b, root)  # another model: A's records are not B's
    try:
        b_hits, b_bytes = _l3_hits(tiers, session, counts[session])
        out = _turn(b, tiers, session, torch.cat([history[session], user], dim=1))
    finally:
        tiers.rt.close()
    assert b_hits == 0 and not b_bytes.any(), f"B read {b_hits} of A's blocks as hits"
    assert out["same_kv"] and torch.equal(out["got"], out["want"])
    assert out["start"] == 0 and "l3" not in out["resumed"], out
    assert summary["sessions"] == 0 and summary["l3"] == 0, summary
    print(f"\nfingerprint: control read {hits} of {counts[session]} blocks of {session} as "
          f"hits; model B read 0, listed 0 of {len(SESSIONS)} sessions, recomputed the turn")
