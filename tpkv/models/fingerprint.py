"""What identifies a model's weights for L3 records: checkpoint files and sampled parameters."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from typing import Any

import torch
import xxhash

from tpkv.errors import ConfigError

# Elements sampled per parameter, spread evenly over it (a fine-tune that touches a tensor
# moves about every element of it: merged LoRA, full fine-tune).
PARAM_SAMPLES = 4096
# Bytes read at the start, middle and end of each tensor of a safetensors file.
TENSOR_WINDOW = 4096
# Other weight files (pickles, ...): windows of this many bytes at evenly spaced offsets.
FILE_WINDOW = 64 << 10
FILE_WINDOWS = 32
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".msgpack", ".h5",
                   ".index.json")


def check_fingerprint(value: object, what: str = "model_fingerprint") -> str:
    """A user-set fingerprint: a non-empty str, else ConfigError."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{what} must be a non-empty str, got {value!r}")
    return value


def checkpoint_digest(path: str | os.PathLike[str]) -> str | None:
    """Digest of the weight files directly in directory `path` (None if it is not a directory
    or holds none): each file's name, size and mtime_ns (a checkpoint saved again over the
    same path changes them), a safetensors file's header (every tensor's name, dtype, shape
    and offsets) and three 4 KiB windows of each tensor's bytes, other files' bytes at 32
    evenly spaced 64 KiB windows. Reads a few MiB for a 70B checkpoint."""
    try:
        names = sorted(e.name for e in os.scandir(path)
                       if e.is_file() and e.name.endswith(WEIGHT_SUFFIXES))
    except (NotADirectoryError, FileNotFoundError, PermissionError):
        return None
    if not names:
        return None
    h = xxhash.xxh3_128()
    for name in names:
        full = os.path.join(path, name)
        st = os.stat(full)
        h.update(f"{name}|{st.st_size}|{st.st_mtime_ns}|".encode())
        with open(full, "rb") as f:
            fd = f.fileno()
            if name.endswith(".index.json"):
                h.update(f.read())
            elif not (name.endswith(".safetensors") and _safetensors(fd, st.st_size, h)):
                for offset in _spread(st.st_size, FILE_WINDOW, FILE_WINDOWS):
                    h.update(os.pread(fd, FILE_WINDOW, offset))
    return h.hexdigest()


def _safetensors(fd: int, size: int, h: Any) -> bool:
    """Hash a safetensors file's header and windows of each tensor; False if it is not one."""
    raw = os.pread(fd, 8, 0)
    if len(raw) < 8:
        return False
    (header_len,) = struct.unpack("<Q", raw)
    if header_len > min(size - 8, 100 << 20):
        return False
    header = os.pread(fd, header_len, 8)
    try:
        tensors = json.loads(header)
    except ValueError:
        return False
    h.update(header)
    base = 8 + header_len
    for key in sorted(tensors):
        entry = tensors[key]
        if key == "__metadata__" or not isinstance(entry, dict):
            continue
        start, stop = (int(x) for x in entry.get("data_offsets", (0, 0)))
        for offset in _spread(stop - start, TENSOR_WINDOW, 3):
            h.update(os.pread(fd, TENSOR_WINDOW, base + start + offset))
    return True


def _spread(size: int, window: int, count: int) -> Iterable[int]:
    """Offsets of `count` windows spread from the start to the end of `size` bytes."""
    if size <= window * count:
        return range(0, max(size, 1), window)
    last = size - window
    return sorted({i * last // (count - 1) for i in range(count)})


def params_digest(model: torch.nn.Module) -> str:
    """Digest of the parameters this process holds (a TP rank: its shards): each one's name,
    dtype and shape, and PARAM_SAMPLES of its elements spread evenly over it and its last
    (one strided copy a tensor on its device, one copy to the host a device). Parameters on
    the meta device count by name and shape only."""
    h = xxhash.xxh3_128()
    samples: dict[torch.device, list[torch.Tensor]] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            t = param.detach()
            to_local = getattr(t, "to_local", None)  # a DTensor: this rank's shard
            if callable(to_local):
                t = to_local()
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)};".encode())
            n = t.numel()
            if n == 0 or t.device.type == "meta":
                continue
            flat = t.reshape(-1)  # a view (a copy only of a non-contiguous tensor)
            step = max(n // PARAM_SAMPLES, 1)  # a strided view: no index tensor to gather by
            picked = torch.cat([flat[::step][:PARAM_SAMPLES], flat[-1:]])
            try:
                raw = picked.view(torch.uint8)
            except RuntimeError:  # a dtype with no byte view: its values as float64
                raw = picked.to(torch.float64).view(torch.uint8)
            samples.setdefault(t.device, []).append(raw)
        for device in sorted(samples, key=str):
            h.update(torch.cat(samples[device]).cpu().numpy().tobytes())
    return h.hexdigest()


def gather_digest(local: str, sharded: bool) -> str:
    """Every rank's `local` digest hashed in rank order (one all_gather_object through the
    default process group) when the model is sharded over more than one rank: the same on
    every rank though each holds other shards. Every rank must call it; otherwise `local`."""
    import torch.distributed as dist

    if not (sharded and dist.is_available() and dist.is_initialized()
            and dist.get_world_size() > 1):
        return local
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return xxhash.xxh3_128("|".join(map(str, parts)).encode()).hexdigest()


def weights_fingerprint(prefix: str, text: str, model: torch.nn.Module, *, sharded: bool,
                        checkpoint: str | os.PathLike[str] | None = None) -> str:
    """`prefix-<hex>` over `text` (the architecture), the checkpoint files in `checkpoint`
    (if a directory of weight files) and the sampled parameters; the same on every TP rank
    (a collective when `sharded`)."""
    files = checkpoint_digest(checkpoint) if checkpoint else None
    local = f"{text}|files={files}|params={params_digest(model)}"
    digest = gather_digest(xxhash.xxh3_128(local.encode()).hexdigest(), sharded)
    return f"{prefix}-{digest[:24]}"


def llama_fingerprint(model: Any) -> str:
    """tpkv's own Llama (tpkv.models.llama): its config and sampled weights; after `apply_tp`
    a collective over the default process group (every rank calls it)."""
    from tpkv.models.tp import tp_info

    return weights_fingerprint("tpkv", repr(model.config), model, sharded=tp_info(model)[1] > 1)
