"""A second start compiles nothing: two fresh processes share one empty numba cache directory;
the first compiles tpkv's kernels (itself or in tpkv.kernel_pool's processes) and stores them,
the second, through the same tpkv.init, steps and close, loads every one of them from the cache
and compiles none. Also where numba can
write nothing (a read-only install, no writable user cache): tpkv falls back to a directory
under the temp dir, with a warning, and still compiles only once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
from numba.core import event
from numba.core.registry import CPUDispatcher

compiled = []

class Compiles(event.Listener):
    def on_start(self, ev):
        compiled.append(ev.data["dispatcher"].py_func.__qualname__)
    def on_end(self, ev):
        pass

event.register("numba:compile", Compiles())

import tpkv
from tpkv.config import HbmConfig, HostConfig, KvGeometry, TpkvConfig
from tpkv.controller import (arena, batchtable, kernels, planner, plankernels, rowkernels,
                             stepkernels)
from tpkv.workers import kernels as worker_kernels

g = KvGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", block_tokens=4)
cfg = TpkvConfig(geometry=g, l1=HbmConfig(num_blocks=8),
                 l2=HostConfig(budget_bytes=16 * g.block_bytes))
rt = tpkv.init(cfg, controller="local", device="cpu")
for i in range(4):
    rt.open_session(f"s{i}", num_tokens=9)
for step in range(12):  # outgrows L1: demotions to L2 and promotions back
    names = [f"s{step % 4}"]
    rt.run_step(names, [1], lambda step: None)
rt.close()
hits = misses = 0
for m in (arena, batchtable, kernels, planner, plankernels, rowkernels, stepkernels,
          worker_kernels):
    for v in vars(m).values():
        if isinstance(v, CPUDispatcher):
            hits += sum(v.stats.cache_hits.values())
            misses += sum(v.stats.cache_misses.values())
from tpkv import kernel_pool  # on a cold cache, most kernels compile in its processes
pooled = len(kernel_pool.report().get("kernels", []))
print(json.dumps({"compiled": compiled, "pooled": pooled, "cache_hits": hits,
                  "cache_misses": misses}))
"""


def _start(cache_dir: Path | None, root: Path = ROOT, **env_extra: str
           ) -> tuple[dict[str, object], str]:
    env = {**os.environ, "PYTHONPATH": str(root), "RAY_USAGE_STATS_ENABLED": "0", **env_extra}
    env.pop("NUMBA_CACHE_DIR", None)
    if cache_dir is not None:
        env["NUMBA_CACHE_DIR"] = str(cache_dir)
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, env=env,
                         capture_output=True, text=True, timeout=580)
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result, out.stderr


@pytest.mark.timeout(1200)
def test_a_second_start_compiles_no_kernel(tmp_path: Path) -> None:
    cache = tmp_path / "numba"
    first, _ = _start(cache)
    assert len(first["compiled"]) + first["pooled"] >= 10, first  # type: ignore[arg-type,operator]
    assert any(cache.rglob("*.nbi")), "the first start stored nothing in NUMBA_CACHE_DIR"
    second, _ = _start(cache)
    assert second["compiled"] == [] and second["cache_misses"] == 0, second
    assert second["cache_hits"] >= 10, second  # type: ignore[operator]


@pytest.mark.timeout(1200)
def test_a_read_only_install_caches_under_the_temp_dir(tmp_path: Path) -> None:
    """A copy of tpkv where numba can write neither beside the kernels (each `__pycache__` is a
    file), nor in the user cache (under a file), nor NUMBA_CACHE_DIR (unset): the start works,
    warns, and the kernels land in the fallback directory, which a second start reuses."""
    install = tmp_path / "site"
    shutil.copytree(ROOT / "tpkv", install / "tpkv",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for d in ("controller", "workers"):
        (install / "tpkv" / d / "__pycache__").write_text("not a directory")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {"XDG_CACHE_HOME": str(blocker / "cache"), "HOME": str(blocker / "home"),
           "TMPDIR": str(temp)}
    first, err = _start(None, install, **env)
    fallback = temp / f"tpkv-numba-cache-{os.getuid()}"
    assert f"kernels are cached in {fallback}" in err, err[-2000:]
    assert len(first["compiled"]) + first["pooled"] >= 10, first  # type: ignore[arg-type,operator]
    assert any(fallback.rglob("*.nbi")), first
    second, err = _start(None, install, **env)
    assert second["compiled"] == [] and second["cache_hits"] >= 10, second  # type: ignore


def test_the_fallback_must_be_this_users_alone(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """No writable directory at all, or a fallback others may write (numba unpickles what it
    finds there): a ConfigError that names the directories, and numba's setting is unchanged."""
    from numba.core import config

    from tpkv import numba_cache
    from tpkv.errors import ConfigError

    monkeypatch.setattr(numba_cache, "numba_finds_a_dir", lambda source: False)
    before = config.CACHE_DIR
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(numba_cache.tempfile, "tempdir", str(blocker))
    with pytest.raises(ConfigError, match=r"no writable directory .*kernels\.py.*NUMBA_CACHE_DIR"):
        numba_cache.ensure_cache_dir("/site/tpkv/controller/kernels.py")
    shared = tmp_path / "shared"
    (shared / f"{numba_cache.FALLBACK_NAME}-{os.getuid()}").mkdir(parents=True, mode=0o777)
    os.chmod(shared / f"{numba_cache.FALLBACK_NAME}-{os.getuid()}", 0o777)
    monkeypatch.setattr(numba_cache.tempfile, "tempdir", str(shared))
    with pytest.raises(ConfigError, match="is not this user's alone"):
        numba_cache.ensure_cache_dir("/site/tpkv/controller/kernels.py")
    assert config.CACHE_DIR == before
    private = tmp_path / "private"
    private.mkdir()
    monkeypatch.setattr(numba_cache.tempfile, "tempdir", str(private))
    monkeypatch.setattr(config, "CACHE_DIR", before)  # undone after the test
    got = numba_cache.ensure_cache_dir("/site/tpkv/controller/kernels.py")
    assert got == str(private / f"{numba_cache.FALLBACK_NAME}-{os.getuid()}") == config.CACHE_DIR
