"""Checks of the policy a controller is built with and of a rank's registration (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tpkv.config import KvGeometry, PolicyConfig
from tpkv.errors import ArgumentTypeError, ConfigError
from tpkv.limits import check_count


def check_policy(pol: PolicyConfig) -> None:
    """ConfigError naming the first policy field a controller cannot run with."""
    for name in ("max_moves_per_step", "prefetch_max_blocks", "prefetch_stage_max_blocks",
                 "auto_pin_refresh_steps", "max_tracked_blocks", "max_pending_plans"):
        least = 0 if name == "prefetch_stage_max_blocks" else 1  # 0: measured (RateMeter)
        if not isinstance(getattr(pol, name), int) or getattr(pol, name) < least:
            what = "a positive integer" if least else "an integer >= 0"
            raise ConfigError(f"PolicyConfig.{name} must be {what}, got {getattr(pol, name)!r}")
    for name in ("prefill_tokens_per_s", "h2d_bytes_per_s", "ssd_read_bytes_per_s"):
        if not getattr(pol, name) > 0:
            raise ConfigError(f"PolicyConfig.{name} must be > 0, got {getattr(pol, name)}")
    if pol.gpu_share_weight < 0:
        raise ConfigError(f"gpu_share_weight must be >= 0, got {pol.gpu_share_weight}")


def check_rank(rank: int, geometry: KvGeometry | Mapping[str, Any], host: str,
               g: KvGeometry) -> None:
    """A registering rank's number, host and geometry (which must be the controller's `g`
    exactly); a typed error naming what is wrong."""
    if isinstance(geometry, Mapping):
        try:
            geometry = KvGeometry(**geometry)
        except TypeError as exc:
            raise ConfigError(f"rank {rank} sent a geometry that does not parse: "
                              f"{exc}") from exc
    check_count("rank", rank, g.tp_size - 1, "tp_size - 1")
    if not isinstance(geometry, KvGeometry):
        raise ArgumentTypeError(f"geometry must be a KvGeometry or a map of its fields, "
                                f"got {type(geometry).__name__}")
    if not isinstance(host, str):
        raise ArgumentTypeError(f"host must be a str, got {type(host).__name__}")
    if geometry != g:
        raise ConfigError(f"rank {rank} geometry {geometry} differs from the controller's {g}")
