"""The tiny random Llama the vLLM tests serve, made once per session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.vllm.run_llm import make_model

    path = tmp_path_factory.mktemp("model") / "tiny-llama"
    make_model(str(path))
    return path
