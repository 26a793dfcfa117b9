"""The tiny random Llama the vLLM tests serve, and vLLM's tokens without tpkv, once a session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.vllm.run_llm import make_model

    path = tmp_path_factory.mktemp("model") / "tiny-llama"
    make_model(str(path))
    return path


@pytest.fixture(scope="session")
def baseline(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> dict[str, Any]:
    """Every mode's prompts through vLLM without the connector (tests/vllm/run_llm.py)."""
    from tests.vllm.harness import run

    return run(tiny_llama, tmp_path_factory.mktemp("baseline") / "baseline.json", "baseline")
