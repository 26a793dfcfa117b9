"""vLLM's KV connector over tpkv's blocks: `kv_connector_module_path="tpkv.integrations.vllm"`.

Importing `TpkvConnector` imports vLLM; the planner, copier and store modules do not.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TpkvConnector"]


def __getattr__(name: str) -> Any:
    if name == "TpkvConnector":
        from tpkv.integrations.vllm.connector import TpkvConnector

        return TpkvConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
