"""tpkv: a three-tier KV cache (GPU HBM, pinned DRAM, NVMe) for tensor-parallel LLMs."""

from tpkv.config import HbmConfig, HostConfig, KvGeometry, PolicyConfig, SsdConfig, TpkvConfig
from tpkv.errors import (
    ConfigError,
    InvalidSessionIdError,
    PlanMismatchError,
    TierFullError,
    TpkvError,
)
from tpkv.types import MovePlan, MoveResult, Tier

__version__ = "0.1.0"

__all__ = [
    "ConfigError", "HbmConfig", "HostConfig", "InvalidSessionIdError", "KvGeometry", "MovePlan",
    "MoveResult", "PlanMismatchError", "PolicyConfig", "SsdConfig", "Tier", "TierFullError",
    "TpkvConfig", "TpkvError", "__version__",
]
