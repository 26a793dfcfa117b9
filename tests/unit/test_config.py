"""Config validation: bad values fail at construction with the numbers in the message."""

import dataclasses
import os

import pytest

from tpkv.config import (
    GiB,
    HbmConfig,
    HostConfig,
    KvGeometry,
    PolicyConfig,
    SsdConfig,
    TpkvConfig,
    from_env,
    machine_memory_bytes,
    parse_bytes,
)
from tpkv.errors import ConfigError


def test_geometry_sizes_llama8b_like():
    g = KvGeometry(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", block_tokens=16)
    assert g.block_shape == (32, 2, 16, 8, 128)
    assert g.block_bytes == 2 * 1024 * 1024
    tp8 = dataclasses.replace(g, tp_size=8)
    assert tp8.heads_per_rank == 1 and tp8.block_bytes == 256 * 1024
    assert g.token_bytes_all_ranks == tp8.token_bytes_all_ranks == 128 * 1024


def test_kv_heads_not_divisible_by_tp():
    with pytest.raises(ConfigError, match=r"8 KV heads .* 3 TP ranks"):
        KvGeometry(num_layers=2, num_kv_heads=8, head_dim=64, tp_size=3)


@pytest.mark.parametrize("field,value", [("num_layers", 0), ("head_dim", -1), ("block_tokens", 0),
                                         ("tp_size", 1.5)])
def test_geometry_rejects_non_positive(field, value):
    kwargs = dict(num_layers=2, num_kv_heads=4, head_dim=8)
    kwargs[field] = value
    with pytest.raises(ConfigError, match=field):
        KvGeometry(**kwargs)


def test_unknown_dtype():
    with pytest.raises(ConfigError, match="int3"):
        KvGeometry(num_layers=2, num_kv_heads=4, head_dim=8, dtype="int3")


def test_fingerprint_changes_with_every_field():
    base = KvGeometry(num_layers=2, num_kv_heads=4, head_dim=8)
    others = [dataclasses.replace(base, num_layers=3), dataclasses.replace(base, dtype="float16"),
              dataclasses.replace(base, tp_size=2), dataclasses.replace(base, block_tokens=32)]
    prints = {base.fingerprint(), *(o.fingerprint() for o in others)}
    assert len(prints) == 5
    assert base.fingerprint() == KvGeometry(num_layers=2, num_kv_heads=4, head_dim=8).fingerprint()


def test_l2_budget_above_machine_memory():
    too_much = machine_memory_bytes() * 2
    with pytest.raises(ConfigError, match=r"L2 budget of .* GiB is above"):
        HostConfig(budget_bytes=too_much)


def test_l2_split_across_ranks_not_multiplied():
    g = KvGeometry(num_layers=32, num_kv_heads=8, head_dim=128, tp_size=4)  # 512 KiB blocks
    l2 = HostConfig(budget_bytes=1 * GiB)
    assert l2.bytes_per_rank(4) == GiB // 4
    assert l2.slots_per_rank(g) * g.block_bytes * 4 <= GiB


def test_watermarks_must_be_ordered():
    with pytest.raises(ConfigError, match="low=0.9 high=0.8"):
        HbmConfig(num_blocks=10, high_watermark=0.8, low_watermark=0.9)


def test_l1_needs_one_size():
    with pytest.raises(ConfigError, match="exactly one"):
        HbmConfig()
    with pytest.raises(ConfigError, match="holds no block"):
        HbmConfig(budget_bytes=100).slots(KvGeometry(num_layers=2, num_kv_heads=4, head_dim=8))


def test_ssd_dir_not_writable(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    if os.geteuid() == 0:  # root passes permission bits; answer as a read-only mount would
        monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(ConfigError, match="not writable"):
        SsdConfig(root=str(ro))


def test_ssd_dir_cannot_be_created(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="cannot be created"):
        SsdConfig(root=str(blocker / "sub"))


@pytest.mark.parametrize("field", ["io_threads", "write_threads", "write_piece_bytes",
                                   "budget_bytes"])
def test_ssd_sizes_must_be_positive(field):
    with pytest.raises(ConfigError, match=f"{field} must be a positive integer, got 0"):
        SsdConfig(**{field: 0})


def test_policy_validation():
    with pytest.raises(ConfigError, match="w_attn=-1"):
        PolicyConfig(w_attn=-1)
    with pytest.raises(ConfigError, match="kind"):
        PolicyConfig(kind="fifo")  # type: ignore[arg-type]


@pytest.mark.parametrize("text,expected", [("4096", 4096), ("512MiB", 512 << 20), ("8GiB", 8 << 30),
                                           ("2G", 2 << 30), ("1.5KiB", 1536), (77, 77)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


def test_parse_bytes_rejects_garbage():
    with pytest.raises(ConfigError, match="12 parsecs"):
        parse_bytes("12 parsecs")


def test_from_env_overlays(tmp_path):
    cfg = TpkvConfig(geometry=KvGeometry(num_layers=2, num_kv_heads=4, head_dim=8),
                     l1=HbmConfig(num_blocks=8))
    out = from_env(cfg, {"TPKV_SSD_DIR": str(tmp_path), "TPKV_L2_BYTES": "64MiB",
                         "TPKV_DASHBOARD_PORT": "9000", "RAY_ADDRESS": "127.0.0.1:6379"})
    assert out.l3.root == str(tmp_path) and out.l3.enabled
    assert out.l2.budget_bytes == 64 << 20
    assert out.dashboard_port == 9000 and out.ray_address == "127.0.0.1:6379"
    assert out.dashboard_host == "127.0.0.1"
    assert from_env(cfg, {}) == cfg
