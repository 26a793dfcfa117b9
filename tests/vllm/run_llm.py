"""Runs offline vLLM on a tiny random Llama with or without tpkv's connector; writes JSON results.

`python tests/vllm/run_llm.py MODEL_DIR OUT_JSON
{baseline,tpkv,disk,restart,dashboard,tp2_baseline,tp2,async,controller} [EXTRA_JSON]`.
Each round is one LLM.generate call of its prompts (greedy, ignore_eos); rounds run in order in
one engine, most after emptying vLLM's own prefix cache. "baseline" runs every mode's prompts
without the connector; "disk" and "restart" run the connector with EXTRA_JSON as its
kv_connector_extra_config (a disk tier) and report the bytes of the disk tier's record files
after each round, once its background writes have landed; "dashboard" runs two turns of one
conversation with the connector's dashboard on (EXTRA_JSON names its port and token), then
reads its /api/snapshot over 127.0.0.1 (dashboard_snapshot); "tp2_baseline" and "tp2" run
tp2_rounds at tensor parallel 2, without and with the connector (its disk tier in EXTRA_JSON,
one rank's records damaged: sabotage.SabotagedRankConnector); "async" runs async_rounds with
EXTRA_JSON as the connector's config (a disk tier; its async_loads decides which loads run in
the background); "controller" runs controller_rounds with the prefix index in a Ray actor
(EXTRA_JSON sets controller "ray" and a disk tier) on a local Ray cluster this process starts,
killing the actor for good between two turns (kill_index_actor) and waiting for the new one
the scheduler makes (wait_index_actor), then killing it for Ray to restart
(restart_index_actor), then killing it from a thread while a generate of several prompts
runs, for Ray to restart and for good (kill_during). Each result carries the seconds its round
took. The entry point stays under __main__: vLLM spawns its engine core and workers.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable

BLOCK_TOKENS = 32
MAX_TOKENS = 8


def make_model(path: str) -> None:
    """A 2-layer Llama (head_dim 32, the smallest vLLM's CPU attention takes), random weights
    drawn wide so that greedy picks have clear margins."""
    if os.path.exists(os.path.join(path, "config.json")):
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, initializer_range=0.2,
                      bos_token_id=0, eos_token_id=1, pad_token_id=1)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)


def rounds() -> list[tuple[str, list[tuple[str, list[int]]]]]:
    """(what to empty first, named prompts) by round; token ids in 2..498 (499 marks the blocks
    the sabotage damages). "vllm" empties vLLM's own prefix cache, standing for vLLM having
    evicted those blocks (what it no longer holds, the connector serves); "all" the connector's
    blocks too."""
    def seq(start: int, n: int) -> list[int]:
        return [2 + (start + 7 * i) % 490 for i in range(n)]

    system = seq(0, 64)  # two full blocks shared by several prompts
    a = system + seq(300, 36)  # 100 tokens: 3 full blocks and 4 more
    corrupt = seq(50, 32) + [499] + seq(90, 31) + seq(120, 40)  # its block 1 starts with 499
    return [
        ("", [("a", a)]),
        ("vllm", [("a_again", a)]),  # every full block but the last token's is loaded
        ("vllm", [("b", system + seq(200, 40)), ("c", system + seq(400, 45))]),  # share 2 blocks
        # vLLM's own cache holds the system prompt (from b, c); the connector adds a's block 2
        ("", [("a_third", a)]),
        # a new shared prefix asked by two prompts in one step: written once
        ("vllm", [("d", seq(10, 64) + seq(250, 33)), ("e", seq(10, 64) + seq(350, 50))]),
        ("vllm", [("corrupt", corrupt)]),
        ("vllm", [("corrupt_again", corrupt)]),  # block 0 loads, block 1 fails its check
        ("all", [("a_forgotten", a)]),  # nothing to load: written again
    ]


def disk_rounds() -> list[tuple[str, list[tuple[str, list[int]]]]]:
    """With 2 blocks of host memory: the oldest blocks go to disk and load back from there; a
    damaged disk record (block 1 of "k", first token 499) is recomputed; "m" is left on disk
    (pushed out of memory by "n") for the next process."""
    def seq(start: int, n: int) -> list[int]:
        return [2 + (start + 11 * i) % 490 for i in range(n)]

    f, g, h = seq(0, 100), seq(100, 100), seq(200, 100)
    k = seq(60, 32) + [499] + seq(95, 31) + seq(130, 40)
    return [
        ("", [("f", f), ("g", g), ("h", h)]),  # 9 blocks: 2 stay in memory, 7 go to disk
        ("vllm", [("f_again", f)]),  # f's 3 blocks load from disk
        ("vllm", [("k", k)]),
        ("vllm", [("filler", seq(300, 100))]),  # pushes k's blocks out to disk
        ("vllm", [("k_again", k)]),  # block 0 loads from disk, block 1's record is damaged
        ("vllm", [("p1", seq(400, 100)), ("p2", seq(20, 100)), ("p3", seq(40, 100)),
                  ("p4", seq(140, 100))]),  # more blocks than both tiers hold
        ("vllm", [("m", seq(250, 70))]),
        ("vllm", [("n", seq(350, 100))]),
    ]


def restart_rounds() -> list[tuple[str, list[tuple[str, list[int]]]]]:
    """A new process over the same disk tier: "m" (written by the last one) loads from disk."""
    return [("", [("m_restart", disk_rounds()[-2][1][0][1])])]


def dashboard_rounds() -> list[tuple[str, list[tuple[str, list[int]]]]]:
    """Two turns: the second is the first and 60 more tokens (vLLM's own cache emptied
    between them, so tpkv serves the first turn's 3 blocks)."""
    first = [2 + (5 * i) % 490 for i in range(100)]
    return [("", [("turn1", first)]),
            ("vllm", [("turn2", first + [2 + (13 * i) % 490 for i in range(60)])])]


def tp2_rounds() -> list[tuple[str, list[tuple[str, list[int]]]]]:
    """Tensor parallel 2, 2 blocks of host memory a rank, disk writes on the step's path: a
    two-turn conversation; then "k" (block 1 starts with 499), pushed out to disk by "filler";
    "k2" extends k by two blocks: rank 1's record of k's block 1 is damaged (once), so its load
    fails there (with a load before the forward, both ranks compute k2's blocks 3 and 4 over a
    block rank 1 did not load; a background load, what the disk tier gets by default, has vLLM
    recompute before anything runs over it); vLLM recomputes from block 1; "k3" extends k2 and
    loads its five blocks, 3 and 4 included, on both ranks."""
    def seq(start: int, n: int) -> list[int]:
        return [2 + (start + 13 * i) % 490 for i in range(n)]

    turn1 = seq(0, 100)
    k = seq(200, 32) + [499] + seq(240, 31) + seq(280, 40)
    k2 = k + seq(400, 64)
    return [("", [("turn1", turn1)]),
            ("vllm", [("turn2", turn1 + seq(100, 60))]),
            ("vllm", [("k", k)]),
            ("vllm", [("filler", seq(320, 100))]),
            ("vllm", [("k2", k2)]),
            ("vllm", [("k3", k2 + seq(450, 40))])]


def async_rounds() -> list[tuple[str, list[tuple[str, list[int]]]]]:
    """With 2 blocks of host memory, disk writes on the step's path: a conversation whose
    first turn is pushed out to disk before the second asks for it; a record damaged on disk
    ("q", block 1 starts with 499) under the load of "q_again"; then a returning turn loaded
    in the same step as a new prompt is computed."""
    def seq(start: int, n: int) -> list[int]:
        return [2 + (start + 17 * i) % 490 for i in range(n)]

    turn1 = seq(0, 100)
    q = seq(60, 32) + [499] + seq(95, 31) + seq(130, 40)
    return [("", [("s1", turn1)]),
            ("vllm", [("s_filler", seq(300, 100))]),  # turn 1's 3 blocks go to disk
            ("vllm", [("s2", turn1 + seq(100, 60))]),
            ("vllm", [("q", q)]),
            ("vllm", [("q_filler", seq(330, 100))]),
            ("vllm", [("q_again", q)]),
            ("vllm", [("s_new", seq(410, 90)), ("s3", turn1 + seq(100, 60) + seq(200, 40))])]


def controller_rounds() -> list[tuple[str, list[tuple[str, list[int]]]]]:
    """With 2 blocks of host memory: turn 1 is pushed out to disk by a filler; the index actor
    is killed for good ("kill"); turn 2 (turn 1 and more) is computed or loaded as the
    scheduler still vouches for it; a third prompt over turn 1 is computed (the scheduler has
    seen the actor dead: no index); this process then waits for the new actor the scheduler
    makes ("wait", a short prompt at a time running the scheduler meanwhile); turn 3 then loads
    turn 1's blocks from the disk tier, as the new actor found them there. Then the actor is
    killed and Ray restarts it ("restart") before turn 4, and turn 5 (once the restarted actor
    answers) loads turn 1's blocks from the index it rebuilt from the disk tier. Then six
    prompts at once, the actor killed while vLLM computes them, for Ray to restart
    ("midrestart"); turn 1 again once it answers ("v_back"); six more, the actor killed for
    good while vLLM computes them ("midkill"); a new prompt, whose saves make the scheduler
    see the actor gone if it has not yet; and turn 6, once the new actor answers, loads turn
    1's blocks from the disk tier again."""
    def seq(start: int, n: int) -> list[int]:
        return [2 + (start + 19 * i) % 490 for i in range(n)]

    turn1 = seq(0, 100)

    def midway(at: int) -> list[tuple[str, list[int]]]:
        """Six prompts, two over turn 1 (loads), four new; most fill a block while decoding
        (a save, so a call on the actor, late in the generate)."""
        return [(f"w{at}_{i}", p) for i, p in enumerate(
            [turn1 + seq(at, 24), seq(at + 30, 92), seq(at + 60, 60), turn1 + seq(at + 90, 58),
             seq(at + 120, 156), seq(at + 150, 29)])]

    return [("", [("v1", turn1)]),
            ("vllm", [("v_filler", seq(300, 100))]),
            ("vllm+kill", [("v2", turn1 + seq(100, 40))]),
            ("vllm", [("v_down", turn1 + seq(150, 40))]),
            ("vllm+wait", [("v3", turn1 + seq(200, 50))]),
            ("vllm+restart", [("v4", turn1 + seq(260, 40))]),
            ("vllm+wait", [("v5", turn1 + seq(320, 40))]),
            ("vllm+midrestart", midway(11)),
            ("vllm+wait", [("v_back", turn1 + seq(380, 40))]),
            ("vllm+midkill", midway(23)),
            ("vllm", [("v_after", seq(470, 70))]),
            ("vllm+wait", [("v6", turn1 + seq(440, 40))])]


def start_ray() -> None:
    """A local Ray cluster on 127.0.0.1 that the engine core's connector joins (RAY_ADDRESS)."""
    import uuid

    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             namespace=f"tpkv-vllm-test-{uuid.uuid4().hex[:8]}", _node_ip_address="127.0.0.1")
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address


def index_actors() -> list[dict]:
    import ray

    from tpkv.integrations.vllm.ray_index import NAME_PREFIX

    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(NAME_PREFIX)]


def kill_index_actor() -> None:
    """Kill the connector's index actor for good (Ray does not restart it)."""
    import ray

    (found,) = index_actors()
    ray.kill(ray.get_actor(found["name"], namespace=found["namespace"]), no_restart=True)
    deadline = time.monotonic() + 30
    while index_actors() and time.monotonic() < deadline:
        time.sleep(0.05)


def restart_index_actor() -> None:
    """Kill the connector's index actor; Ray restarts it (max_restarts)."""
    import ray

    (found,) = index_actors()
    ray.kill(ray.get_actor(found["name"], namespace=found["namespace"]))


def kill_during(generate: Callable[[Callable[..., object]], list], no_restart: bool
                ) -> tuple[list, dict]:
    """generate(progress_bar) run while a thread kills the index actor (for Ray to restart,
    or for good): the thread kills it as soon as vLLM has every request (generate makes the
    progress bar of its run then). Its outputs, and what the thread saw: the requests vLLM had
    finished when the kill returned, and whether generate was still running."""
    import io
    import threading

    import ray
    from tqdm import tqdm

    (found,) = index_actors()
    handle = ray.get_actor(found["name"], namespace=found["namespace"])
    started, returned = threading.Event(), threading.Event()
    bars: list = []
    seen: dict = {}

    def bar(*args: object, **kwargs: object) -> tqdm:
        made = tqdm(*args, file=io.StringIO(), **kwargs)
        if not args:  # the bar of the run (the one over the prompts comes first, as added)
            bars.append(made)
            started.set()
        return made

    def kill() -> None:
        try:
            if not started.wait(120) or not bars:
                raise RuntimeError("generate did not start")
            ray.kill(handle, no_restart=no_restart)
            seen.update(running=not returned.is_set(), finished=bars[0].n,
                        requests=bars[0].total)
        except BaseException as exc:  # reported by the main thread
            seen["error"] = repr(exc)

    thread = threading.Thread(target=kill, name="kill-index-actor")
    thread.start()
    try:
        outs = generate(bar)
    finally:
        returned.set()
        started.set()
        thread.join()
    if "error" in seen:
        raise RuntimeError(f"killing the index actor during generate: {seen['error']}")
    return outs, seen


def wait_index_actor(poke: Callable[[], list], limit_s: float = 60.0) -> float:
    """Seconds until the scheduler works on an index actor again: the actor answers, and
    `poke` (a short prompt: the scheduler looks for the actor as it schedules) reports an index
    that holds blocks (the one the actor built from the disk tier)."""
    import ray

    began = time.monotonic()
    while time.monotonic() - began < limit_s:
        outs = poke()
        found = index_actors()
        if found and outs[0].kv_transfer_params["tpkv"]["index_blocks"] > 0:
            handle = ray.get_actor(found[0]["name"], namespace=found[0]["namespace"])
            try:
                ray.get(handle.ping.remote(), timeout=limit_s)
                return time.monotonic() - began
            except ray.exceptions.RayError:
                pass
        time.sleep(0.1)
    raise RuntimeError(f"the scheduler took no index actor's index within {limit_s} s")


def rank_files(root: str) -> dict[str, list[str]]:
    """The record files of each rank directory under a disk tier's root, by directory."""
    return {sub: sorted(e.name for e in os.scandir(os.path.join(root, sub)) if e.is_file())
            for sub in sorted(os.listdir(root)) if sub.startswith("rank")}


def dashboard_snapshot(llm: object, params: object, extra: dict, disk_dir: str) -> dict:
    """Once the disk tier settled, a short prompt (no full block: nothing to save) makes every
    rank report its store's figures as they are now; then /api/snapshot, without the token
    (its status) and with it, and the disk tier's record files of rank 0."""
    import urllib.error
    import urllib.request

    settled_bytes(disk_dir)
    llm.generate([{"prompt_token_ids": [2, 3, 4, 5, 6]}], params, use_tqdm=False)  # type: ignore
    time.sleep(1.0)  # past the dashboard's frame cache
    url = f"http://127.0.0.1:{extra['dashboard_port']}/api/snapshot"
    try:
        urllib.request.urlopen(url, timeout=10)
        status = 200
    except urllib.error.HTTPError as exc:
        status = exc.code
    req = urllib.request.Request(url, headers={
        "Authorization": f"Bearer {extra['dashboard_token']}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        snap = json.load(r)
    rank0 = os.path.join(disk_dir, "rank0")
    files = [e for e in os.scandir(rank0) if e.is_file() and e.name.endswith(".blk")]
    return {"status_without_token": status, "snapshot": snap,
            "rank0_files": len(files), "rank0_bytes": sum(e.stat().st_size for e in files)}


def dir_bytes(root: str) -> int:
    """Bytes of every file in the rank directories under a disk tier's root."""
    total = 0
    for sub in os.listdir(root):
        path = os.path.join(root, sub)
        if sub.startswith("rank") and os.path.isdir(path):
            total += sum(e.stat().st_size for e in os.scandir(path) if e.is_file())
    return total


def settled_bytes(root: str, quiet_s: float = 0.5, limit_s: float = 30.0) -> int:
    """dir_bytes once the disk tier's background writes have landed: no `.tmp` file and the
    same listing and bytes for `quiet_s`."""
    def look() -> tuple[int, tuple[str, ...]]:
        names = tuple(sorted(e.name for sub in os.listdir(root) if sub.startswith("rank")
                             for e in os.scandir(os.path.join(root, sub))))
        return dir_bytes(root), names

    deadline = time.monotonic() + limit_s
    last, since = look(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = look()
        if now != last or any(n.endswith(".tmp") for n in now[1]):
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return now[0]
    raise RuntimeError(f"the disk tier under {root} did not settle in {limit_s} s")


def main() -> None:
    model_dir, out_path, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {"host_bytes": "64MiB"}
    make_model(model_dir)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs: dict = {}
    plan = {"baseline": rounds() + disk_rounds() + restart_rounds() + async_rounds()
            + controller_rounds(),
            "tpkv": rounds(), "async": async_rounds(), "controller": controller_rounds(),
            "disk": disk_rounds(), "restart": restart_rounds(),
            "dashboard": dashboard_rounds(), "tp2_baseline": tp2_rounds(),
            "tp2": tp2_rounds()}[mode]
    if mode.startswith("tp2"):
        kwargs["tensor_parallel_size"] = 2
    if mode not in ("baseline", "tp2_baseline"):
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="SabotagedRankConnector" if mode == "tp2" else "SabotagedTpkvConnector",
            kv_connector_module_path="sabotage", kv_role="kv_both",
            kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    disk_dir = (extra.get("disk_dir") if mode in ("disk", "restart", "dashboard", "tp2", "async",
                                                  "controller") else None)
    if mode == "controller":
        start_ray()
    began = time.perf_counter()
    llm = LLM(model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=1024,
              block_size=BLOCK_TOKENS, enable_prefix_caching=True, enforce_eager=True, seed=0,
              **kwargs)
    started_s = time.perf_counter() - began
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    results = []
    disk_used = [dir_bytes(disk_dir)] if disk_dir else []
    waited_s = []
    for reset, batch in plan:
        reset, _, action = reset.partition("+")
        if action == "kill" and mode == "controller":
            kill_index_actor()
        if action == "restart" and mode == "controller":
            restart_index_actor()
        if action == "wait" and mode == "controller":
            waited_s.append(wait_index_actor(lambda: llm.generate(
                [{"prompt_token_ids": [2, 3, 4, 5, 6]}], params, use_tqdm=False)))
        if reset and not llm.reset_prefix_cache(reset_connector=reset == "all"):
            raise RuntimeError(f"vLLM refused to empty its prefix cache ({reset})")
        round_began = time.perf_counter()

        def generate(bar: object = False, batch: list = batch) -> list:
            return llm.generate([{"prompt_token_ids": p} for _, p in batch], params,
                                use_tqdm=bar)  # type: ignore[arg-type]

        kill = None
        if action in ("midrestart", "midkill") and mode == "controller":
            outs, kill = kill_during(generate, no_restart=action == "midkill")
        else:
            outs = generate()
        round_s = time.perf_counter() - round_began
        for (name, prompt), out in zip(batch, outs):
            results.append({"name": name, "prompt": prompt,
                            "tokens": list(out.outputs[0].token_ids),
                            "num_cached_tokens": out.num_cached_tokens,
                            "kv_transfer_params": out.kv_transfer_params,
                            "round_s": round_s, "kill": kill})
        if disk_dir:
            disk_used.append(settled_bytes(disk_dir))
    dash = dashboard_snapshot(llm, params, extra, disk_dir) if mode == "dashboard" else None
    with open(out_path, "w") as f:
        json.dump({"mode": mode, "start_s": started_s, "disk_used_bytes": disk_used,
                   "total_s": time.perf_counter() - began, "results": results,
                   "index_actor_waited_s": waited_s,
                   "dashboard": dash, "rank_files": rank_files(disk_dir) if disk_dir else None},
                  f)


if __name__ == "__main__":
    main()
