"""The connector's settings (vLLM's kv_connector_extra_config) and the model's identity."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tpkv.checks import check_int
from tpkv.errors import ConfigError
from tpkv.models.fingerprint import check_fingerprint, checkpoint_digest
from tpkv.settings import parse_bytes

GiB = 1 << 30
DEFAULT_HOST_BYTES = 4 * GiB
KNOWN_KEYS = ("host_bytes", "model_fingerprint")


@dataclass(frozen=True)
class ConnectorOptions:
    """host_bytes: each rank's budget for stored blocks (an int or a size like "8GiB");
    model_fingerprint: what identifies the weights in the block keys (derived from the model's
    name, revision, dtypes, parallelism and checkpoint files when not set)."""

    host_bytes: int = DEFAULT_HOST_BYTES
    model_fingerprint: str | None = None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorOptions:
        extra = dict(extra or {})
        unknown = sorted(k for k in extra if k not in KNOWN_KEYS)
        if unknown:
            raise ConfigError(f"kv_connector_extra_config has keys tpkv does not know: {unknown}; "
                              f"known: {list(KNOWN_KEYS)}")
        raw = extra.get("host_bytes", DEFAULT_HOST_BYTES)
        if isinstance(raw, bool) or not isinstance(raw, (int, str)):
            raise ConfigError(f"host_bytes must be an int or a size like '8GiB', got {raw!r}")
        host_bytes = parse_bytes(raw)
        check_int("host_bytes", host_bytes)
        fp = extra.get("model_fingerprint")
        return cls(host_bytes, None if fp is None else check_fingerprint(fp))


def vllm_fingerprint(vllm_config: Any, options: ConnectorOptions) -> str:
    """The set fingerprint, else one made of what decides the KV a model writes: model path or
    name, revision, dtype, KV cache dtype, tensor and pipeline parallel sizes, and the digest of
    the checkpoint files when the model is a local directory."""
    if options.model_fingerprint is not None:
        return options.model_fingerprint
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    model = str(mc.model)
    files = checkpoint_digest(model) if os.path.isdir(model) else None
    return (f"vllm|model={model}|rev={getattr(mc, 'revision', None)}|dtype={mc.dtype}"
            f"|kv={vllm_config.cache_config.cache_dtype}|tp={pc.tensor_parallel_size}"
            f"|pp={pc.pipeline_parallel_size}|files={files}")
