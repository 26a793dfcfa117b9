"""bench/e2e.py's setup: a configuration of tiers, its model, the link and disk ceilings."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.e2e_emulate import model_config
from tpkv.config import GiB, HbmConfig, HostConfig, PolicyConfig, SsdConfig, TpkvConfig
from tpkv.models.fingerprint import llama_fingerprint
from tpkv.models.llama import Llama, build_model


@dataclass(frozen=True)
class Setting:
    key: str
    label: str
    l1_bytes: int
    l2_bytes: int  # 0: the smallest L2 the config allows (one block)
    ssd_root: str | None
    l3_bytes: int = 0
    spill: str = "always"  # PolicyConfig.spill: "always" keeps the most sessions
    # Returns always load from L2/L3: the cost model is told a prefill speed far below any
    # real one, and the engine does not report the measured speed (to time L3 resumes on a
    # machine whose disk reads KV slower than the model recomputes it).
    always_load: bool = False
    # > 0: L3 on a RAM-backed directory, its reads and writes paced to this many GB/s each
    # (bench.e2e_emulate.PacedStore): a faster disk than the machine's, emulated
    emulate_gbps: float = 0.0


# The prefill speed (tokens/s) the cost model believes in an always_load setting.
_SLOW_PREFILL = 1.0


_MODELS: dict[tuple[str, str], Llama] = {}


def model_for(name: str, device: torch.device) -> Llama:
    key = (name, str(device))
    if key not in _MODELS:
        _MODELS[key] = build_model(model_config(name), seed=0, device=device)
    return _MODELS[key]


def ceilings(device: torch.device, ssd_root: str) -> dict[str, float]:
    """GB/s of one contiguous 1 GiB pinned copy each way and of raw O_DIRECT on the L3 disk."""
    from bench.transfer import raw_odirect

    out: dict[str, float] = {}
    if device.type == "cuda":
        from bench.transfer import ceilings as pcie

        c = pcie(GiB, 5)
        out["h2d"], out["d2h"] = c["h2d"], c["d2h"]
    disk = raw_odirect(Path(ssd_root) / "raw-ceiling.bin", GiB // 4 if device.type == "cpu"
                       else 2 * GiB)
    out["disk_write"], out["disk_read"] = disk["write"], disk["read"]
    return out


def config_for(s: Setting, model: Llama, block_tokens: int, cuda: bool,
               layer_events: int = 1,
               write_piece_bytes: int = 4 << 20, write_threads: int = 8,
               prefetch_max_blocks: int = 1024,
               prefetch_stage_max_blocks: int = 0) -> TpkvConfig:
    g = model.kv_geometry(tp_size=1, block_tokens=block_tokens)
    bb = g.block_bytes
    l2 = max(s.l2_bytes, bb)
    l3 = (SsdConfig(root=str(Path(s.ssd_root) / f"l3-{s.key}"), budget_bytes=s.l3_bytes,
                    o_direct=cuda and not s.emulate_gbps, io_threads=8 if cuda else 2,
                    write_piece_bytes=write_piece_bytes, write_threads=write_threads)
          if s.ssd_root else SsdConfig())
    # Automatic pins off: at these sizes 10% of all blocks is about the whole L1 budget.
    extra: dict[str, Any] = {"prefill_tokens_per_s": _SLOW_PREFILL} if s.always_load else {}
    if s.emulate_gbps:  # the cost model's L3 read speed until it measures one: the pace's (the
        # fill round's spill choices come before any L3 read; the default is this VM's disk)
        extra["ssd_read_bytes_per_s"] = s.emulate_gbps * 1e9
    policy = PolicyConfig(cooldown_s=0.0, auto_pin_fraction=0.0, spill=s.spill,
                          prefetch_max_blocks=prefetch_max_blocks,
                          prefetch_stage_max_blocks=prefetch_stage_max_blocks, **extra)
    return TpkvConfig(geometry=g, l1=HbmConfig(num_blocks=s.l1_bytes // bb),
                      l2=HostConfig(budget_bytes=l2, arena_bytes=min(l2, GiB) // bb * bb),
                      l3=l3, policy=policy, wait_timeout_s=300.0,
                      layer_events=bool(layer_events), model_fingerprint=llama_fingerprint(model))
