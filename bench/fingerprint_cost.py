"""Cost of the model fingerprint (tpkv.models.fingerprint): sampled parameters of a Llama-shaped
set of tensors, and the checkpoint digest over sparse safetensors shards of a 70B layout.

Measured: 1.50e9 bf16 parameters in 147 tensors on this 2-core CPU, 40 ms (fp32, one thread,
23 ms); one rank of a 70B at TP 8 (723 tensors, 10.7e9 with the replicated embeddings and
head) on an H200, the same loop inline, 30-33 ms; the checkpoint digest of 720 tensors in 30
sparse shards, 38-91 ms."""

from __future__ import annotations

import argparse
import json
import os
import struct
import tempfile
import time

import torch
from torch import nn

from tpkv.models.fingerprint import checkpoint_digest, params_digest


def llama_like(layers: int, hidden: int, inter: int, kv: int, vocab: int, tp: int,
               dtype: torch.dtype, device: str) -> nn.Module:
    """One TP rank's shards of a Llama: 9 tensors a layer, embeddings and head (filled)."""
    m = nn.Module()
    shapes = {"embed": (vocab, hidden), "head": (vocab, hidden), "norm": (hidden,)}
    for i in range(layers):
        shapes.update({f"{i}.q": (hidden // tp, hidden), f"{i}.k": (kv // tp, hidden),
                       f"{i}.v": (kv // tp, hidden), f"{i}.o": (hidden, hidden // tp),
                       f"{i}.gate": (inter // tp, hidden), f"{i}.up": (inter // tp, hidden),
                       f"{i}.down": (hidden, inter // tp), f"{i}.n1": (hidden,),
                       f"{i}.n2": (hidden,)})
    for name, shape in shapes.items():
        m.register_parameter(name.replace(".", "_"),
                             nn.Parameter(torch.ones(shape, dtype=dtype, device=device)))
    return m


def sparse_checkpoint(root: str, layers: int, shards: int, tensor_bytes: int) -> None:
    """Safetensors shards whose data is a hole (reads cost what the page cache costs)."""
    per = -(-layers * 9 // shards)
    names = [f"model.layers.{i}.t{j}" for i in range(layers) for j in range(9)]
    for s in range(shards):
        mine = names[s * per:(s + 1) * per]
        header = {n: {"dtype": "BF16", "shape": [tensor_bytes // 2],
                      "data_offsets": [k * tensor_bytes, (k + 1) * tensor_bytes]}
                  for k, n in enumerate(mine)}
        raw = json.dumps(header).encode()
        with open(os.path.join(root, f"model-{s:05d}.safetensors"), "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + len(mine) * tensor_bytes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preset", choices=["1b", "70b-tp8"], default="1b")
    ap.add_argument("--out", default=None,
                    help="JSON to write (default bench/results/fingerprint_cost_<preset>_<device>"
                         ".json)")
    a = ap.parse_args()
    if a.preset == "1b":  # 1.24e9 parameters (Llama 3.2 1B shapes, untied head)
        m = llama_like(16, 2048, 8192, 512, 128256, 1, torch.bfloat16, a.device)
    else:  # one of 8 ranks of a 70B (Llama 3 70B shapes): 80 layers, 8.8e9 parameters
        m = llama_like(80, 8192, 28672, 1024, 128256, 8, torch.bfloat16, a.device)
    n = sum(p.numel() for p in m.parameters())
    params_digest(m)  # first call: allocator and kernels
    t = time.perf_counter()
    params_digest(m)
    took = time.perf_counter() - t
    print(f"params_digest: {n / 1e9:.2f}e9 parameters in {len(list(m.parameters()))} tensors "
          f"on {a.device}: {took * 1e3:.1f} ms")
    with tempfile.TemporaryDirectory() as root:
        sparse_checkpoint(root, 80, 30, 235 << 20)  # 80 x 9 tensors, 30 shards, ~160 GB
        t = time.perf_counter()
        checkpoint_digest(root)
        file_took = time.perf_counter() - t
        print(f"checkpoint_digest: 720 tensors in 30 sparse shards: {file_took * 1e3:.1f} ms")
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                f"fingerprint_cost_{a.preset}_{a.device.split(':')[0]}.json")
    with open(out, "w") as f:
        json.dump({"preset": a.preset, "device": a.device, "num_params": n,
                   "num_tensors": len(list(m.parameters())), "params_digest_ms": took * 1e3,
                   "checkpoint_tensors": 720, "checkpoint_shards": 30,
                   "checkpoint_digest_ms": file_took * 1e3}, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
