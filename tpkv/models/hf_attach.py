"""tpkv.attach: a transformers model on the tiers (geometry from its config, a cache a session)."""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Mapping
from typing import Any

import torch

from tpkv.config import DTYPE_BYTES, KvGeometry, TpkvConfig
from tpkv.errors import ConfigError
from tpkv.launch.runtime import TpkvRuntime
from tpkv.models.fingerprint import check_fingerprint, weights_fingerprint
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


def max_new_tokens(model: Any, num_ids: int, kwargs: Mapping[str, Any]) -> int | None:
    """The most tokens `model.generate(ids of num_ids tokens, **kwargs)` makes: max_new_tokens,
    else max_length less the ids, from kwargs, their generation_config or the model's (None
    when none says)."""
    if kwargs.get("max_new_tokens") is not None:
        return int(kwargs["max_new_tokens"])
    cfg = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    if kwargs.get("max_length") is not None:
        return max(0, int(kwargs["max_length"]) - num_ids)
    if cfg is not None and getattr(cfg, "max_new_tokens", None) is not None:
        return int(cfg.max_new_tokens)
    if cfg is not None and getattr(cfg, "max_length", None) is not None:
        return max(0, int(cfg.max_length) - num_ids)
    return None


def model_fingerprint(model: Any, *, tp_size: int | None = None) -> str:
    """What tells this model's L3 records from another's: its architecture, the checkpoint
    files it was loaded from (when `config._name_or_path` is a local directory: names, sizes,
    mtimes, safetensors headers and sampled bytes of each tensor; `_commit_hash` for a Hub
    model) and PARAM_SAMPLES elements of each parameter, so that two models of the same
    architecture, or a fine-tune saved over the same path, never read each other's records.
    The same on every TP rank: sharded over tp > 1 ranks (tp_size, else the model's), it is a
    collective over the default process group (every rank calls it). Costs a few ms to tens of
    ms (tpkv.models.fingerprint); set `attach(..., model_fingerprint=...)` to name it
    yourself."""
    return _fingerprint_of(model, model_tp_size(model) if tp_size is None else int(tp_size))


def _fingerprint_of(model: Any, tp: int) -> str:
    cfg = model.config.get_text_config(decoder=True)
    keys = ("_name_or_path", "model_type", "num_hidden_layers", "hidden_size",
            "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")
    text = "|".join(f"{k}={getattr(cfg, k, None)}" for k in keys)
    path = (getattr(model.config, "_name_or_path", "") or getattr(cfg, "_name_or_path", "")
            or getattr(model, "name_or_path", ""))
    text += f"|commit={getattr(model.config, '_commit_hash', None)}"
    return weights_fingerprint("hf", text, model, sharded=tp > 1,
                               checkpoint=path if path and os.path.isdir(path) else None)


class HfTiers:
    """A model attached to the tiers: `cache(session_id)` gives the session's TpkvCache (the
    same object on every call until it is closed), `generate` runs a turn and feeds lost K/V
    again, `close` frees everything (and the runtime, if attach started it)."""

    def __init__(self, rt: TpkvRuntime, model: Any, owns_runtime: bool) -> None:
        self.rt, self.model, self.owns_runtime = rt, model, owns_runtime
        self.geometry = rt.config.geometry
        self.stats = HfTierStats()
        self.caches: dict[str, TpkvCache] = {}
        self.kwarg = cache_kwarg(model)

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
        recompute runs other matmul shapes, equal up to rounding). The step of the turn's
        first pass is sent to the controller before generate starts, and none is sent for a
        pass after its last (TpkvCache.plan_turn)."""
        c = self.cache(cache) if isinstance(cache, str) else cache
        num_ids = int(input_ids.shape[-1])
        max_new = max_new_tokens(self.model, num_ids, kwargs)
        for attempt in range(max_recomputes + 1):
            try:
                c.plan_turn(num_ids, max_new)
                return self.model.generate(input_ids, **{self.kwarg: c}, **kwargs)
            except KvLostError:
                if attempt == max_recomputes:
                    raise
            finally:
                c.room.turn_end = None
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
           device: torch.device | str | None = None,
           model_fingerprint: str | None = None) -> HfTiers:
    """Attach a transformers decoder (one device, or `tp_plan="auto"` under torchrun, where
    each rank holds kv_heads / tp heads) to tpkv's tiers. Every rank calls it.

    `config`: a TpkvConfig (its geometry must be the model's: `model_geometry(model)`), or a
    mapping of TpkvConfig's other fields (`{"l1": HbmConfig(num_blocks=4096), ...}`; geometry
    from the model's config), or None with `runtime`. `runtime`: an already running
    `tpkv.init` runtime whose geometry is the model's; otherwise attach calls `tpkv.init(config,
    controller=controller, device=device or the model's device)` and `close()` ends it.

    `model_fingerprint`: what L3 records of this model are stored under (a record written
    under another is a miss): this argument if given, else the config's
    `TpkvConfig.model_fingerprint` (or the mapping's "model_fingerprint") if not empty, else
    `model_fingerprint(model)`, computed from the model's checkpoint files and weights (a
    collective under TP). Name it yourself (e.g. "llama-70b-ft-v3") to skip the computation
    or to keep records across a copy of the checkpoint. With `runtime`, its config's
    fingerprint is used; it must not be empty where L3 is on.
    """
    if model_fingerprint is not None:
        check_fingerprint(model_fingerprint)
    if runtime is not None:
        bt = block_tokens or runtime.config.geometry.block_tokens
        _check_same(model_geometry(model, block_tokens=bt, tp_size=tp_size),
                    runtime.config.geometry)
        _check_runtime_fingerprint(runtime.config, model_fingerprint)
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
    if model_fingerprint is not None and cfg.model_fingerprint not in ("", model_fingerprint):
        raise ConfigError(f"model_fingerprint={model_fingerprint!r} and the config's "
                          f"model_fingerprint={cfg.model_fingerprint!r} differ; give one")
    name = model_fingerprint or cfg.model_fingerprint or _fingerprint_of(model, geometry.tp_size)
    cfg = dataclasses.replace(cfg, model_fingerprint=check_fingerprint(name))
    from tpkv.launch.join import init

    rt = init(cfg, controller=controller, device=device or getattr(model, "device", None))
    return HfTiers(rt, model, owns_runtime=True)


def _check_runtime_fingerprint(config: TpkvConfig, given: str | None) -> None:
    have = config.model_fingerprint
    if given is not None and given != have:
        raise ConfigError(f"model_fingerprint={given!r} is not the runtime's ({have!r}): a "
                          f"running runtime keeps the fingerprint it was started with")
    if not have and config.l3.root is not None:
        raise ConfigError("the runtime's TpkvConfig.model_fingerprint is empty while L3 is on "
                          f"({config.l3.root}): L3 records of any model would be read as "
                          f"this one's; start it with model_fingerprint=model_fingerprint(model)")


def _check_same(from_model: KvGeometry, given: KvGeometry) -> None:
    diff = [f"{f}: model {getattr(from_model, f)}, config {getattr(given, f)}"
            for f in (*_MODEL_FIELDS, "block_tokens")
            if getattr(from_model, f) != getattr(given, f)]
    if diff:
        raise ConfigError("the tiers' geometry is not the model's: " + "; ".join(diff))
