"""Tensor parallelism added from outside the model: shard its weights in place, all-reduce hooks."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tpkv.errors import ConfigError
from tpkv.models.llama import Llama

_APPLIED = "_tpkv_tp"  # attribute that marks a model already sharded: (rank, world_size)


def maybe_init_dist(backend: str | None = None) -> int | None:
    """This process's rank in the default group, initialising it under torchrun (NCCL where CUDA
    is present, gloo otherwise); None for one plain process, so one script runs both ways."""
    if not dist.is_available():
        return None
    if not dist.is_initialized():
        if not dist.is_torchelastic_launched():
            return None
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend)  # rank, world size, address: torchrun's environment
        if backend == "nccl":
            torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    return dist.get_rank()


def _shard(linear: nn.Linear, dim: int, rank: int, world_size: int) -> None:
    """Keep this rank's contiguous 1/world_size of the weight along `dim` (0: out, 1: in)."""
    weight = linear.weight
    size = weight.shape[dim] // world_size
    part = weight.narrow(dim, rank * size, size).clone()  # [out/ws, in] or [out, in/ws]
    linear.weight = nn.Parameter(part, requires_grad=False)
    linear.out_features, linear.in_features = part.shape


def _all_reduce_hook(group: Any) -> Any:
    def hook(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> Tensor:
        dist.all_reduce(output, group=group)  # partial sums of a row-parallel layer -> full
        return output

    return hook


def apply_tp(model: Llama, rank: int, world_size: int, group: Any = None) -> Llama:
    """Shard `model` (holding the full seeded weights) for TP rank `rank` of `world_size`.

    Column-parallel (output split by heads / intermediate columns): wq, wk, wv, w_gate, w_up.
    Row-parallel (input split the same way) with an all-reduce of their output: wo, w_down.
    Embeddings, norms and the LM head stay replicated, so every rank computes the same logits.
    Rank r keeps query heads [r*Hq/ws, (r+1)*Hq/ws) and KV heads [r*Hkv/ws, (r+1)*Hkv/ws): with
    head i reading KV head i // (Hq/Hkv), each rank's GQA groups stay whole.
    """
    cfg = model.config
    if getattr(model, _APPLIED, None) is not None:
        raise ConfigError(f"TP already applied to this model: {getattr(model, _APPLIED)}")
    if not 0 <= rank < world_size:
        raise ConfigError(f"TP rank {rank} outside 0..{world_size - 1}")
    for name in ("num_heads", "num_kv_heads", "intermediate_size"):
        if getattr(cfg, name) % world_size:
            raise ConfigError(f"model {name}={getattr(cfg, name)} cannot be split evenly over "
                              f"{world_size} TP ranks")
    setattr(model, _APPLIED, (rank, world_size))
    if world_size == 1:
        return model
    for block in model.blocks:
        attn, mlp = block.attn, block.mlp
        for linear in (attn.wq, attn.wk, attn.wv, mlp.w_gate, mlp.w_up):
            _shard(linear, 0, rank, world_size)
        for linear in (attn.wo, mlp.w_down):
            _shard(linear, 1, rank, world_size)
            linear.register_forward_hook(_all_reduce_hook(group))
    return model


def tp_info(model: nn.Module) -> tuple[int, int]:
    """(rank, world_size) a model was sharded for; (0, 1) when `apply_tp` never ran."""
    info = getattr(model, _APPLIED, None)
    return (0, 1) if info is None else (int(info[0]), int(info[1]))
