"""A small Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU) with seeded weights; no TP inside."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tpkv.config import KvGeometry
from tpkv.errors import ConfigError

MODEL_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of the decoder; `preset(name)` gives tiny (CPU tests), small (CPU demo), 1b (GPU)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"model has {self.num_heads} query heads, not a multiple of its "
                              f"{self.num_kv_heads} KV heads")
        if self.head_dim % 2:
            raise ConfigError(f"RoPE needs an even head_dim, got {self.head_dim}")
        if self.dtype not in MODEL_DTYPES:
            raise ConfigError(f"model dtype {self.dtype!r} is not one of {MODEL_DTYPES}")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ConfigError(f"rope_theta and norm_eps must be > 0, got {self.rope_theta}, "
                              f"{self.norm_eps}")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        if name not in PRESETS:
            raise ConfigError(f"no model preset {name!r}; choose one of {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype

    def num_params(self) -> int:
        """Parameter count, computed from the shapes (nothing is allocated)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    def kv_geometry(self, tp_size: int = 1, block_tokens: int = 16,
                    dtype: str | None = None) -> KvGeometry:
        """Geometry of this model's KV cache split over `tp_size` ranks."""
        return KvGeometry(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                          head_dim=self.head_dim, dtype=dtype or self.dtype,
                          block_tokens=block_tokens, tp_size=tp_size)


PRESETS: dict[str, ModelConfig] = {
    # ~0.5M parameters: fast on 2 CPU cores, GQA with 2 query heads per KV head.
    "tiny": ModelConfig(vocab_size=512, hidden_size=128, num_layers=3, num_heads=8,
                        num_kv_heads=4, head_dim=16, intermediate_size=256),
    # ~4M parameters: a CPU demo with some depth.
    "small": ModelConfig(vocab_size=2048, hidden_size=256, num_layers=4, num_heads=8,
                         num_kv_heads=4, head_dim=32, intermediate_size=768),
    # Llama-3.2-1B shapes (1.24B parameters, 32 KiB of KV per token in bf16), for the GPU.
    "1b": ModelConfig(vocab_size=128_256, hidden_size=2048, num_layers=16, num_heads=32,
                      num_kv_heads=8, head_dim=64, intermediate_size=8192,
                      rope_theta=500_000.0, tie_embeddings=True, dtype="bfloat16"),
}


class AttentionFn(Protocol):
    """Attention of one layer: q [T, Hq, D], k, v [T, Hkv, D] (after RoPE) -> [T, Hq, D].

    The model hands every layer's q, k, v to this object and knows nothing of where the cache is.
    """

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


def causal_attention(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """No cache: the T tokens are one whole sequence, each attends to itself and those before."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0), is_causal=True, enable_gqa=True)  # [1, Hq, T, D]
    return out.squeeze(0).transpose(0, 1)  # [T, Hq, D]


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin of the rotary angles: each [T, D/2] in float32."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=positions.device,
                                       dtype=torch.float64) / head_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # [T, D/2]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate halves (x1, x2) of the last dim of x [T, H, D] by the angles [T, D/2]."""
    x1, x2 = x.float().chunk(2, dim=-1)  # [T, H, D/2] each
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class Attention(nn.Module):
    """Projections around an `AttentionFn`; head counts follow the weights (TP shards them)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.head_dim = cfg.head_dim
        h, d = cfg.hidden_size, cfg.head_dim
        self.wq = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.wk = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.wv = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.wo = nn.Linear(cfg.num_heads * d, h, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionFn) -> Tensor:
        t, d = x.shape[0], self.head_dim
        q = apply_rope(self.wq(x).view(t, -1, d), cos, sin)  # [T, Hq, D]
        k = apply_rope(self.wk(x).view(t, -1, d), cos, sin)  # [T, Hkv, D]
        v = self.wv(x).view(t, -1, d)  # [T, Hkv, D]
        out = attn(self.layer, q, k, v)  # [T, Hq, D]
        return self.wo(out.reshape(t, -1).to(x.dtype))  # [T, hidden]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w_gate = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.w_up = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.w_down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionFn) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, attn)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Tokens in flat varlen form: token_ids [T], positions [T] -> logits [R, vocab] (float32)."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = cfg
        with torch.device(device or "cpu"):
            self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
            self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
            self.lm_head = (None if cfg.tie_embeddings
                            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False))
        self.to(cfg.torch_dtype)
        self.requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def blocks(self) -> list[Block]:
        return [cast(Block, b) for b in self.layers]

    def kv_geometry(self, tp_size: int = 1, block_tokens: int = 16,
                    dtype: str | None = None) -> KvGeometry:
        return self.config.kv_geometry(tp_size, block_tokens, dtype)

    def init_weights(self, seed: int) -> Llama:
        """Seeded random weights, the same for a seed on every process of one device type.

        Every matrix N(0, 1/columns), norms 1: activations keep their scale, the residual stream
        is not dominated by the token's own embedding (tied heads do not just echo the input),
        and logits spread about 1 apart, so greedy tokens are varied and stable.
        """
        gen = torch.Generator(device=self.device).manual_seed(seed)
        for name, p in self.named_parameters():  # fixed order: registration order
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            std = 1.0 / math.sqrt(p.shape[1])
            w = torch.empty(p.shape, dtype=torch.float32, device=p.device)
            p.copy_(w.normal_(0.0, std, generator=gen))
        return self

    def forward(self, token_ids: Tensor, positions: Tensor | None = None,
                attn: AttentionFn = causal_attention, logits_rows: Tensor | None = None
                ) -> Tensor:
        """token_ids [T], positions [T] (default 0..T-1), rows of T to score (default all)."""
        if positions is None:
            positions = torch.arange(token_ids.shape[0], device=token_ids.device)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        x = self.embed(token_ids)  # [T, hidden]
        for block in self.blocks:
            x = block(x, cos, sin, attn)
        if logits_rows is not None:
            x = x[logits_rows]  # [R, hidden]
        x = self.norm(x)
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, weight).float()  # [R, vocab]


def build_model(cfg: ModelConfig | str, seed: int = 0,
                device: torch.device | str | None = None) -> Llama:
    """A model with seeded weights: `build_model("tiny", seed=0)`."""
    if isinstance(cfg, str):
        cfg = ModelConfig.preset(cfg)
    return Llama(cfg, device).init_weights(seed)


@torch.inference_mode()
def dense_generate(model: Llama, token_ids: list[int], num_new_tokens: int
                   ) -> tuple[list[int], Tensor]:
    """Reference greedy decoding: the whole sequence recomputed each step, no cache at all.

    Returns the new tokens and the logits [num_new_tokens, vocab] each was chosen from.
    """
    seq = list(token_ids)
    rows = []
    for _ in range(num_new_tokens):
        ids = torch.tensor(seq, dtype=torch.long, device=model.device)
        logits = model(ids, logits_rows=torch.tensor([len(seq) - 1], device=model.device))
        rows.append(logits[0])
        seq.append(int(logits[0].argmax()))
    return seq[len(token_ids):], torch.stack(rows)
