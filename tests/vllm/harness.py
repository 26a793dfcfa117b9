"""Runs tests/vllm/run_llm.py in a fresh Python process (a fresh vLLM) and reads its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
RUN_TIMEOUT_S = 420


def skip_without_vllm() -> None:
    """Skip the calling test module (call it at its top level) where vLLM does not import."""
    import pytest

    try:
        import vllm  # noqa: F401
    except Exception as exc:  # not installed, or its torch does not import beside it
        pytest.skip(f"vllm is not importable ({exc!r}); `make vllm-test` installs it in "
                    f".venv-vllm", allow_module_level=True)


def tp2_cpu_bind() -> str:
    """VLLM_CPU_OMP_THREADS_BIND for two CPU workers, one core each ("0|1"): vLLM's automatic
    binding wants a NUMA node per worker. Skips the calling test below two usable cores."""
    import pytest

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip(f"tensor parallel 2 on the CPU needs 2 cores, this process may use {cpus}")
    return f"{cpus[0]}|{cpus[1]}"


def run(model_dir: Path, out: Path, mode: str, extra: dict[str, Any] | None = None,
        env_extra: dict[str, str] | None = None) -> dict[str, Any]:
    """One vLLM process of `mode` (run_llm.py), with `env_extra` in its environment; its
    results, with `by_name` and the process's `stderr` added."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false", **(env_extra or {}))
    args = [sys.executable, str(HERE / "run_llm.py"), str(model_dir), str(out), mode]
    if extra is not None:
        args.append(json.dumps(extra))
    proc = subprocess.run(args, cwd=HERE, env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    if proc.returncode != 0:
        raise AssertionError(f"vLLM ({mode}) exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}")
    data = json.loads(out.read_text())
    data["by_name"] = {r["name"]: r for r in data["results"]}
    data["stderr"] = proc.stderr
    return data


def tpkv_stats(result: dict[str, Any]) -> dict[str, int]:
    params = result["kv_transfer_params"]
    assert params is not None and "tpkv" in params, params
    return params["tpkv"]
