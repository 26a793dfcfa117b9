"""Settings: every TPKV_* variable and every config field typed; the demo's dashboard settings.

Every bad value is a ConfigError naming the variable or field; `tpkv demo` lays
TPKV_DASHBOARD_HOST/PORT/TOKEN over its config like every other entry point (the token is
enforced), and a taken port is said clearly. The demo is driven up to its controller without
Ray: `actor.get_or_create` is replaced by a real DashboardServer built from the config exactly
as ControllerActor builds it.
"""

from __future__ import annotations

import dataclasses
import errno
import http.client
import math
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpkv.config import (
    HbmConfig,
    HostConfig,
    KvGeometry,
    PolicyConfig,
    SsdConfig,
    TpkvConfig,
    from_env,
)
from tpkv.controller.dashboard import DashboardServer, ServerThread
from tpkv.errors import ConfigError

pytestmark = pytest.mark.timeout(120)
TOKEN = "demo-s3cret-Token_42"
GEOMETRY = dict(num_layers=2, num_kv_heads=4, head_dim=8)


def small_config(**kw: Any) -> TpkvConfig:
    return TpkvConfig(geometry=KvGeometry(**GEOMETRY), l1=HbmConfig(num_blocks=8), **kw)


# ---- environment variables --------------------------------------------------------------------
BAD_ENV = [
    ("TPKV_DASHBOARD_PORT", v) for v in ("abc", "-1", "65536", "80.5", "", " ", "0x50", "1e3",
                                         "99999999999999999999999")
] + [
    ("TPKV_WAIT_TIMEOUT_S", v) for v in ("nan", "NaN", "inf", "-inf", "0", "-5", "abc", "",
                                         "1e300")
] + [
    ("TPKV_DASHBOARD_HOST", v) for v in ("", " ", "http://127.0.0.1", "127.0.0.1:8470",
                                         "a b", "host/path", "-bad-", "[127.0.0.1]x")
] + [
    ("TPKV_L2_BYTES", v) for v in ("lots", "0", "-1GiB", "", "nan")
] + [
    ("TPKV_SSD_DIR", v) for v in ("", "  ")
]


@pytest.mark.parametrize("name,value", BAD_ENV)
def test_bad_env_value_is_a_config_error_naming_it(name: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_env(small_config(), {name: value})
    assert name in str(info.value) and repr(value) in str(info.value)
    assert "expected" in str(info.value)  # says what is allowed


@pytest.mark.parametrize("value", ["", "two words", "tab\there", "naïve-token"])
def test_bad_token_is_refused_without_echoing_it(value: str) -> None:
    with pytest.raises(ConfigError, match="TPKV_DASHBOARD_TOKEN") as info:
        from_env(small_config(), {"TPKV_DASHBOARD_TOKEN": value})
    if len(value) > 3:
        assert value not in str(info.value)  # a secret stays out of logs


def test_good_env_values_apply() -> None:
    env = {"TPKV_DASHBOARD_PORT": " 0 ", "TPKV_DASHBOARD_HOST": "::1",
           "TPKV_DASHBOARD_TOKEN": TOKEN, "TPKV_WAIT_TIMEOUT_S": "2.5"}
    out = from_env(small_config(), env)
    assert (out.dashboard_port, out.dashboard_host, out.dashboard_token,
            out.wait_timeout_s) == (0, "::1", TOKEN, 2.5)


def test_cli_refuses_a_bad_variable_before_running(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from tpkv.launch.cli import main

    monkeypatch.setenv("TPKV_DASHBOARD_PORT", "abc")
    assert main(["demo-tiers", "--blocks", "2", "--layers", "1"]) == 2
    err = capsys.readouterr().err
    assert "TPKV_DASHBOARD_PORT='abc'" in err and "1-65535" in err


# ---- config fields ----------------------------------------------------------------------------
NAN, INF = math.nan, math.inf
BAD_INT = [True, 1.5, "4", NAN, -1]
BAD_FLOAT = [NAN, INF, -INF, "0.5", True, None]
# (class, valid kwargs, field, bad values beyond the kind's)
FIELDS: list[tuple[Any, dict[str, Any], str, list[Any]]] = [
    *[(KvGeometry, GEOMETRY, f, BAD_INT + [0]) for f in
      ("num_layers", "num_kv_heads", "head_dim", "block_tokens", "tp_size")],
    (HbmConfig, {"num_blocks": 8}, "num_blocks", BAD_INT + [0]),
    (HbmConfig, {"budget_bytes": 1 << 20}, "budget_bytes", BAD_INT + [0]),
    *[(c, kw, f, BAD_FLOAT + [0.0, -0.5, 1.5]) for c, kw in
      ((HbmConfig, {"num_blocks": 8}), (HostConfig, {}), (SsdConfig, {}))
      for f in ("high_watermark", "low_watermark")],
    *[(HostConfig, {}, f, BAD_INT + [0]) for f in ("budget_bytes", "arena_bytes")],
    (HostConfig, {}, "max_memory_fraction", BAD_FLOAT + [0.0, 1.5]),
    *[(SsdConfig, {}, f, BAD_INT + [0]) for f in
      ("budget_bytes", "io_threads", "write_threads", "write_piece_bytes")],
    (SsdConfig, {}, "o_direct", [1, "yes", None]),
    (SsdConfig, {}, "root", ["", "  ", 5]),
    *[(PolicyConfig, {}, f, BAD_FLOAT + [-0.1]) for f in ("w_attn", "w_recency")],
    (PolicyConfig, {}, "cooldown_s", BAD_FLOAT + [-1.0]),
    (PolicyConfig, {}, "auto_pin_fraction", BAD_FLOAT + [-0.1, 1.1]),
    (PolicyConfig, {}, "lru_k", BAD_INT + [0, 10**6]),
    *[(PolicyConfig, {}, f, BAD_INT) for f in
      ("max_auto_pin_blocks", "prefetch_steps", "prefetch_stage_max_blocks")],
    *[(PolicyConfig, {}, f, BAD_INT + [0]) for f in
      ("max_moves_per_step", "prefetch_max_blocks",
       "auto_pin_refresh_steps", "max_tracked_blocks", "max_pending_plans")],
    (PolicyConfig, {}, "gpu_share_weight", BAD_FLOAT + [-1.0]),
    *[(PolicyConfig, {}, f, BAD_FLOAT + [0.0, -1.0]) for f in
      ("prefill_tokens_per_s", "h2d_bytes_per_s", "ssd_read_bytes_per_s")],
    *[(PolicyConfig, {}, f, [1, None, "LRU"]) for f in ("kind", "spill")],
    (TpkvConfig, {}, "wait_timeout_s", BAD_FLOAT + [0.0, -1.0, 1e12]),
    (TpkvConfig, {}, "heartbeat_s", BAD_FLOAT + [0.0, -1.0]),
    (TpkvConfig, {}, "dashboard_port", BAD_INT + [65536, "8470"]),
    (TpkvConfig, {}, "dashboard_host", ["", "a b", None, 8470, "http://x"]),
    (TpkvConfig, {}, "dashboard_token", ["", "a b", 12345]),
    (TpkvConfig, {}, "layer_chunk_bytes", BAD_INT),
    (TpkvConfig, {}, "layer_events", [1, "true", None]),
    (TpkvConfig, {}, "confirm_backend", ["mpi", None]),
    *[(TpkvConfig, {}, f, [NAN, 1, "x"]) for f in ("geometry", "l1", "l2", "l3", "policy")],
]
CASES = [(c, kw, f, v) for c, kw, f, bad in FIELDS for v in bad]


def build(cls: Any, kw: dict[str, Any], field: str, value: Any) -> Any:
    if cls is TpkvConfig:
        base = {"geometry": KvGeometry(**GEOMETRY), "l1": HbmConfig(num_blocks=8)}
        return TpkvConfig(**{**base, field: value})
    return cls(**{**kw, field: value})


@pytest.mark.parametrize("cls,kw,field,value", CASES,
                         ids=[f"{c.__name__}.{f}={v!r}" for c, _, f, v in CASES])
def test_every_field_refuses_bad_values(cls: Any, kw: dict[str, Any], field: str,
                                        value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        build(cls, kw, field, value)
    message = str(info.value)
    assert field in message, (cls.__name__, field, value, message)
    if field != "dashboard_token":  # a token is not echoed
        assert repr(value) in message or str(value) in message, message


def good_value(cls: Any, kw: dict[str, Any], field: str) -> Any:
    if field in kw:
        return kw[field]
    f = {f.name: f for f in dataclasses.fields(cls)}[field]
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return {"geometry": KvGeometry(**GEOMETRY), "l1": HbmConfig(num_blocks=8)}[field]


@pytest.mark.parametrize("cls,kw,field", [(c, kw, f) for c, kw, f, _ in FIELDS],
                         ids=[f"{c.__name__}.{f}" for c, _, f, _ in FIELDS])
def test_each_field_with_a_good_value_passes(cls: Any, kw: dict[str, Any], field: str) -> None:
    """Guards the table above: each refusal is the bad value's, not the other fields'."""
    value = good_value(cls, kw, field)
    assert getattr(build(cls, kw, field, value), field) == value


NON_NEGATIVE = [(c, kw, f) for c, kw, f, bad in FIELDS if NAN in bad and -INF in bad]


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(NON_NEGATIVE),
       value=st.floats(allow_nan=True, allow_infinity=True).filter(
           lambda v: not math.isfinite(v) or v < 0))
def test_float_fields_refuse_nan_inf_and_negatives(case: tuple[Any, dict[str, Any], str],
                                                   value: float) -> None:
    cls, kw, field = case
    with pytest.raises(ConfigError, match=field):
        build(cls, kw, field, value)


@settings(max_examples=200, deadline=None)
@given(w_attn=st.floats(0, 1e6), w_recency=st.floats(0, 1e6), cooldown=st.floats(0, 3600),
       timeout=st.floats(1e-3, 86400))
def test_finite_values_in_range_pass(w_attn: float, w_recency: float, cooldown: float,
                                     timeout: float) -> None:
    if w_attn + w_recency <= 0:
        w_recency = 1.0
    p = PolicyConfig(w_attn=w_attn, w_recency=w_recency, cooldown_s=cooldown)
    assert small_config(policy=p, wait_timeout_s=timeout).policy.cooldown_s == cooldown


@pytest.mark.parametrize("kw", [{"w_attn": NAN}, {"w_recency": NAN}, {"cooldown_s": NAN},
                                {"w_attn": INF}, {"cooldown_s": INF}])
def test_nan_heat_weights_and_cooldown_refused(kw: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match=next(iter(kw))):
        PolicyConfig(**kw)


@pytest.mark.parametrize("value", [NAN, INF, -1.0, 0.0])
def test_wait_timeout_nan_refused(value: float) -> None:
    with pytest.raises(ConfigError, match="wait_timeout_s"):
        small_config(wait_timeout_s=value)


# ---- the demo's dashboard -----------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(port: int, path: str, token: str | None = None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        headers = {"Host": f"127.0.0.1:{port}"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        conn.request("GET", path, headers=headers)
        return conn.getresponse().status
    finally:
        conn.close()


class Stop(Exception):
    """Ends the demo once its controller and dashboard are up."""


@pytest.fixture
def demo_seam(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """tpkv.launch.demo.demo with Ray replaced: the 'controller' is a DashboardServer built from
    the config the demo hands to actor.get_or_create (as ControllerActor builds it)."""
    import ray

    from tpkv.controller import actor
    from tpkv.launch import demo as demo_mod

    seen: dict[str, Any] = {"threads": []}

    def get_or_create(config: TpkvConfig, detached: bool = False) -> ServerThread:
        seen["config"] = config
        server = DashboardServer(lambda: {"tick": 1}, host=config.dashboard_host,
                                 port=config.dashboard_port, token=config.dashboard_token,
                                 sample_interval_s=None)
        thread = ServerThread(server)
        seen["threads"].append(thread)
        thread.start()
        return thread

    class Client:
        def __init__(self, handle: ServerThread, timeout_s: float = 0.0) -> None:
            self.handle = handle

        def dashboard(self) -> dict[str, Any]:
            s = self.handle.server
            return {"url": s.url, "host": s.host, "port": s.port,
                    "token_required": s.token is not None, "error": None}

    def run(*args: Any, **kwargs: Any) -> None:
        raise Stop

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "kill", lambda handle: None)
    monkeypatch.setattr(actor, "get_or_create", get_or_create)
    monkeypatch.setattr(actor, "ControllerClient", Client)
    monkeypatch.setattr(demo_mod, "_run_with_progress", run)
    for name in ("TPKV_DASHBOARD_HOST", "TPKV_DASHBOARD_PORT", "TPKV_DASHBOARD_TOKEN",
                 "TPKV_SSD_DIR", "TPKV_L2_BYTES", "TPKV_WAIT_TIMEOUT_S"):
        monkeypatch.delenv(name, raising=False)
    seen["demo"] = lambda **kw: demo_mod.demo(tp=1, seconds=1.0, model="tiny", sessions=2, **kw)
    try:
        yield seen
    finally:
        for t in seen["threads"]:
            t.stop()


def test_demo_applies_dashboard_env_and_enforces_the_token(
        demo_seam: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    monkeypatch.setenv("TPKV_DASHBOARD_PORT", str(port))
    monkeypatch.setenv("TPKV_DASHBOARD_HOST", "127.0.0.1")
    monkeypatch.setenv("TPKV_DASHBOARD_TOKEN", TOKEN)
    with pytest.raises(Stop):
        demo_seam["demo"]()
    cfg = demo_seam["config"]
    assert (cfg.dashboard_host, cfg.dashboard_port, cfg.dashboard_token) == ("127.0.0.1", port,
                                                                             TOKEN)
    printed = capsys.readouterr().out
    assert f"dashboard: http://127.0.0.1:{port}/" in printed  # the URL it really serves
    assert TOKEN not in printed and "TPKV_DASHBOARD_TOKEN" in printed
    assert get(port, "/api/snapshot") == 401
    assert get(port, "/metrics", "wrong-token") == 401
    assert get(port, "/api/snapshot", TOKEN) == 200


def test_demo_flags_override_env(demo_seam: dict[str, Any],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TPKV_DASHBOARD_PORT", "abc")  # refused even though the flag decides
    with pytest.raises(ConfigError, match="TPKV_DASHBOARD_PORT='abc'"):
        demo_seam["demo"](dashboard_port=0)
    assert "config" not in demo_seam  # refused before a controller was made
    monkeypatch.setenv("TPKV_DASHBOARD_PORT", str(free_port()))
    with pytest.raises(Stop):
        demo_seam["demo"](dashboard_port=0, dashboard_host="localhost")
    assert demo_seam["config"].dashboard_port == 0
    assert demo_seam["config"].dashboard_host == "localhost"


@pytest.fixture
def listener() -> Iterator[int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        yield int(s.getsockname()[1])
    finally:
        s.close()


def test_demo_taken_port_asked_for_is_an_error(demo_seam: dict[str, Any], listener: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TPKV_DASHBOARD_PORT", str(listener))
    with pytest.raises(ConfigError, match=rf"port {listener} .*TPKV_DASHBOARD_PORT.* is taken"):
        demo_seam["demo"]()
    assert "config" not in demo_seam
    monkeypatch.delenv("TPKV_DASHBOARD_PORT")
    with pytest.raises(ConfigError, match=rf"port {listener} .*--dashboard-port"):
        demo_seam["demo"](dashboard_port=listener)
    assert "config" not in demo_seam


def test_demo_default_port_taken_falls_back_with_a_notice(
        demo_seam: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    default = 8470
    holder = socket.socket()
    try:
        try:
            holder.bind(("127.0.0.1", default))
            holder.listen()
        except OSError as exc:  # something here holds it already: taken all the same
            assert exc.errno == errno.EADDRINUSE
        with pytest.raises(Stop):
            demo_seam["demo"]()
    finally:
        holder.close()
    printed = capsys.readouterr().out
    port = demo_seam["threads"][0].server.port
    assert port not in (0, default)
    assert f"port {default} on 127.0.0.1 is taken" in printed
    assert "TPKV_DASHBOARD_PORT" in printed and f"dashboard: http://127.0.0.1:{port}/" in printed


def test_server_says_which_port_is_taken_and_what_to_set(listener: int) -> None:
    thread = ServerThread(DashboardServer(lambda: {}, port=listener, sample_interval_s=None))
    with pytest.raises(OSError) as info:
        thread.start()
    assert info.value.errno == errno.EADDRINUSE
    assert str(listener) in str(info.value) and "TPKV_DASHBOARD_PORT" in str(info.value)


def test_launch_passes_checked_settings_to_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    from tpkv.settings import tpkv_env

    monkeypatch.setenv("TPKV_DASHBOARD_PORT", "9001")
    monkeypatch.setenv("TPKV_EXTERNAL_STORE", "1")  # the launcher's own: never passed on
    assert tpkv_env()["TPKV_DASHBOARD_PORT"] == "9001"
    assert "TPKV_EXTERNAL_STORE" not in tpkv_env()
    monkeypatch.setenv("TPKV_WAIT_TIMEOUT_S", "nan")
    with pytest.raises(ConfigError, match="TPKV_WAIT_TIMEOUT_S='nan'"):
        tpkv_env()


def test_replace_keeps_checking() -> None:
    cfg = small_config()
    with pytest.raises(ConfigError, match="dashboard_port"):
        dataclasses.replace(cfg, dashboard_port=True)
    with pytest.raises(ConfigError, match="wait_timeout_s"):
        dataclasses.replace(cfg, wait_timeout_s=math.inf)
    with pytest.raises(ConfigError, match="cooldown_s"):
        dataclasses.replace(cfg.policy, cooldown_s=math.nan)
