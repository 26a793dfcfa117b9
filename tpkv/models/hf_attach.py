"""tpkv.attach: a transformers model on the tiers (geometry from its config, a cache a session)."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
from collections.abc import Mapping
from typing import Any

import torch

from tpkv.config import DTYPE_BYTES, KvGeometry, TpkvConfig
from tpkv.errors import ConfigError
from tpkv.launch.runtime import TpkvRuntime
from tpkv.models.hf_cache import HfTierStats, KvLostError, TpkvCache

_MODEL_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "dtype", "tp_size")


def model_tp_size(model: Any) -> int:
    """TP ranks the model's weights are split over (`from_pretrained(..., tp_plan="auto")` sets
    it under torchrun); 1 for a model on one device."""
    return int(getattr(model, "tp_size", None) or getattr(model, "_tp_size", None) or 1)


def model_geometry(model: Any, *, block_tokens: int = 16, tp_size: int | None = None
                   ) -> KvGeometry:
    """The KvGeometry of a transformers decoder: layers, KV heads, head dim and dtype from its
    config, TP size from the model. Raises ConfigError when the heads do not split evenly."""
    cfg = model.config.get_text_config(decoder=True)
    name = getattr(cfg, "_name_or_path", "") or getattr(cfg, "model_type", "model")
    types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"}:
        raise ConfigError(f"{name}: layer types {sorted(types)}; TpkvCache holds full-attention "
                          f"layers only")
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    tp = model_tp_size(model) if tp_size is None else int(tp_size)
    if tp < 1 or kv_heads % tp:
        raise ConfigError(f"{name}: num_key_value_heads={kv_heads} cannot be split over "
                          f"tp={tp} ranks (kv_heads % tp = {kv_heads % max(tp, 1)}); each rank "
                          f"must hold kv_heads / tp whole heads")
    dtype = str(getattr(model, "dtype", torch.float32)).removeprefix("torch.")
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"{name}: dtype {dtype} is not one of {sorted(DTYPE_BYTES)}")
    return KvGeometry(num_layers=int(cfg.num_hidden_layers), num_kv_heads=kv_heads,
                      head_dim=head_dim, dtype=dtype, block_tokens=block_tokens, tp_size=tp)


def cache_kwarg(model: Any) -> str:
    """The name generate and forward take the cache by: `cache` in later 5.x releases (which
    still take `past_key_values`, with a FutureWarning), `past_key_values` before."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def model_fingerprint(model: Any) -> str:
    """What makes L3 records of this model distinct from another's (name and architecture)."""
    cfg = model.config.get_text_config(decoder=True)
    keys = ("_name_or_path", "model_type", "num_hidden_layers", "hidden_size",
            "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")
    text = "|".join(f"{k}={getattr(cfg, k, None)}" for k in keys)
    return "hf-" + hashlib.sha256(text.encode()).hexdigest()[:24]


class HfTiers:
    """A model attached to the tiers: `cache(session_id)` gives the session's TpkvCache (the
    same object on every call until it is closed), `generate` runs a turn and feeds lost K/V
    again, `close` frees everything (and the runtime, if attach started it)."""

    def __init__(self, rt: TpkvRuntime, model: Any, owns_runtime: bool) -> None:
        self.rt, self.model, self.owns_runtime = rt, model, owns_runtime
        self.geometry = rt.config.geometry
        self.stats = HfTierStats()
        self.caches: dict[str, TpkvCache] = {}

    def cache(self, session_id: str) -> TpkvCache:
        if session_id not in self.caches:
            self.caches[session_id] = TpkvCache(self.rt, session_id, self.stats)
        return self.caches[session_id]

    def generate(self, cache: TpkvCache | str, input_ids: torch.Tensor, *,
                 max_recomputes: int = 2, **kwargs: Any) -> Any:
        """`model.generate(input_ids, past_key_values=cache, **kwargs)` with the whole
        conversation as input_ids (as with DynamicCache); where the tiers lost some of the
        session's K/V, generate again: the cache's length is then the first lost token, so the
        model feeds the rest again. The tokens equal DynamicCache's unless that happened (a
        recompute runs other matmul shapes, equal up to rounding)."""
        c = self.cache(cache) if isinstance(cache, str) else cache
        for attempt in range(max_recomputes + 1):
            try:
                return self.model.generate(input_ids, **{cache_kwarg(self.model): c}, **kwargs)
            except KvLostError:
                if attempt == max_recomputes:
                    raise
        raise AssertionError("unreachable")

    def close_session(self, session_id: str) -> None:
        cache = self.caches.pop(session_id, None)
        if cache is not None:
            cache.close()

    def close(self, error: BaseException | None = None) -> None:
        """Close every session's cache, then the runtime if attach started it."""
        try:
            if error is None:
                for session_id in list(self.caches):
                    self.close_session(session_id)
        finally:
            if self.owns_runtime:
                self.rt.close(error)

    def __enter__(self) -> HfTiers:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self.close(exc)


def attach(model: Any, config: TpkvConfig | Mapping[str, Any] | None = None, *,
           runtime: TpkvRuntime | None = None, block_tokens: int | None = None,
           tp_size: int | None = None, controller: Any = "ray",
           device: torch.device | str | None = None) -> HfTiers:
    """Attach a transformers decoder (one device, or `tp_plan="auto"` under torchrun, where
    each rank holds kv_heads / tp heads) to tpkv's tiers. Every rank calls it.

    `config`: a TpkvConfig (its geometry must be the model's: `model_geometry(model)`), or a
    mapping of TpkvConfig's other fields (`{"l1": HbmConfig(num_blocks=4096), ...}`; geometry
    from the model's config), or None with `runtime`. `runtime`: an already running
    `tpkv.init` runtime whose geometry is the model's; otherwise attach calls `tpkv.init(config,
    controller=controller, device=device or the model's device)` and `close()` ends it.
    """
    if runtime is not None:
        bt = block_tokens or runtime.config.geometry.block_tokens
        _check_same(model_geometry(model, block_tokens=bt, tp_size=tp_size),
                    runtime.config.geometry)
        return HfTiers(runtime, model, owns_runtime=False)
    if config is None:
        raise ConfigError("attach needs a config (TpkvConfig, or a mapping of its tier fields) "
                          "or a running runtime")
    if isinstance(config, TpkvConfig):
        bt = block_tokens or config.geometry.block_tokens
        geometry = model_geometry(model, block_tokens=bt, tp_size=tp_size)
        _check_same(geometry, config.geometry)
        cfg = dataclasses.replace(config, geometry=geometry)
    else:
        fields = dict(config)
        if "geometry" in fields:
            raise ConfigError("attach makes the geometry from the model's config; pass a "
                              "TpkvConfig to give one yourself")
        geometry = model_geometry(model, block_tokens=block_tokens or 16, tp_size=tp_size)
        cfg = TpkvConfig(geometry=geometry, **fields)
    if not cfg.model_fingerprint:
        cfg = dataclasses.replace(cfg, model_fingerprint=model_fingerprint(model))
    from tpkv.launch.join import init

    rt = init(cfg, controller=controller, device=device or getattr(model, "device", None))
    return HfTiers(rt, model, owns_runtime=True)


def _check_same(from_model: KvGeometry, given: KvGeometry) -> None:
    diff = [f"{f}: model {getattr(from_model, f)}, config {getattr(given, f)}"
            for f in (*_MODEL_FIELDS, "block_tokens")
            if getattr(from_model, f) != getattr(given, f)]
    if diff:
        raise ConfigError("the tiers' geometry is not the model's: " + "; ".join(diff))
