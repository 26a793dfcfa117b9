"""tpkv: a three-tier KV cache (GPU HBM, pinned DRAM, NVMe) for tensor-parallel LLMs."""

from tpkv.config import HbmConfig, HostConfig, KvGeometry, PolicyConfig, SsdConfig, TpkvConfig
from tpkv.errors import (
    ConfigError,
    InvalidSessionIdError,
    PlanMismatchError,
    TierFullError,
    TpkvError,
)

__version__ = "0.1.0"

__all__ = [
    "ConfigError", "HbmConfig", "HostConfig", "InvalidSessionIdError", "KvGeometry", "MovePlan",
    "MoveResult", "PlanMismatchError", "PolicyConfig", "SsdConfig", "Tier", "TierFullError",
    "TpkvConfig", "TpkvError", "TpkvRuntime", "__version__", "attach", "init", "launch_ray",
]

# Imported on first use: `import tpkv` (and the controller, which must not pull in torch or
# Ray; and `tpkv --help`, which needs no numpy either) stays light; tpkv.init / tpkv.launch_ray
# bring the worker and launcher modules in.
_LAZY = {"init": "tpkv.launch.join", "TpkvRuntime": "tpkv.launch.runtime",
         "launch_ray": "tpkv.launch.ray_launch", "attach": "tpkv.models.hf_attach",
         "MovePlan": "tpkv.protocol.plan", "MoveResult": "tpkv.protocol.plan",
         "Tier": "tpkv.protocol.plan"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        from tpkv.startup import gc_paused

        with gc_paused():  # torch, numba: seconds of imports (tpkv.startup says why)
            return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tpkv' has no attribute {name!r}")
