"""Multi-turn sessions through offline vLLM (CPU build) with and without tpkv's connector, and
with vLLM's own CPU offloading: prefill tokens computed vs saved, TTFT of returning turns,
throughput, and whether every variant generates the same tokens.

Seeded sessions, each a shared system prompt plus a context of its own, then returning turns
(a user message + the greedy answer vLLM generates, appended to the history). Turns are asked
one request at a time, round robin over the sessions, so each session's blocks wait while every
other session takes a turn; vLLM's KV cache (`--kv-blocks`) holds about two sessions, so its own
prefix cache has lost a session's blocks by the time it returns. Variants, each in a fresh vLLM
process (the interpreter of `--python`, `.venv-vllm` by default; `make vllm-venv` builds it):

- vllm: vLLM alone (its prefix cache only);
- vllm_all_fit: vLLM alone with a KV cache that holds every session (the ceiling);
- null_connector: vLLM with a connector that does nothing (bench/vllm_null.py): what vLLM's
  connector path costs by itself;
- tpkv: TpkvConnector with host memory for every session (`--host-mib`);
- tpkv_disk: TpkvConnector with little host memory (`--disk-host-kib`, of which
  `--disk-queue-kib` for blocks on their way to disk) and the disk tier;
- vllm_offload: vLLM's `kv_offloading_size` (its OffloadingConnector);
- vllm_simple_offload: the same with VLLM_USE_SIMPLE_KV_OFFLOAD=1 (SimpleCPUOffloadConnector).

A variant that does not run on this build is reported with its error. Every variant runs the
model's OpenMP threads on the same cores (`--reserved-cpus`): vLLM's CPU backend reserves one
more core when a KV connector is set, which on this 2-core machine leaves none reserved and
puts its busy scheduler beside both compute threads.

    .venv-vllm/bin/python bench/vllm.py [--sessions 6] [--turns 4] [--out bench/results/vllm.json]
    /work/main/.venv/bin/python bench/plot_vllm.py   # the PNG, where matplotlib is
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# run as a script, bench/ is sys.path[0] and this file would shadow the vllm package (here and
# in the engine processes vLLM spawns)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

REPO = os.path.dirname(HERE)
VARIANTS = ("vllm", "vllm_all_fit", "null_connector", "tpkv", "tpkv_disk", "vllm_offload",
            "vllm_simple_offload")
TOKEN_LO, TOKEN_HI = 2, 511  # prompt token ids: not bos (0) nor eos (1)
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


# ---- workload and summary: plain Python, tested without vLLM --------------------------------

@dataclass(frozen=True)
class Workload:
    system: list[int]  # shared by every session
    contexts: list[list[int]]  # one a session
    users: list[list[list[int]]]  # users[s][t]: session s's message at turn t

    @property
    def sessions(self) -> int:
        return len(self.contexts)

    @property
    def turns(self) -> int:
        return len(self.users[0]) if self.users else 0


def make_workload(seed: int, sessions: int, turns: int, system_tokens: int,
                  context_tokens: int, user_tokens: int) -> Workload:
    """Seeded token ids in [TOKEN_LO, TOKEN_HI]; the same arguments give the same workload."""
    for name, value in (("sessions", sessions), ("turns", turns)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    for name, value in (("system_tokens", system_tokens), ("context_tokens", context_tokens),
                        ("user_tokens", user_tokens)):
        if value < 0:
            raise ValueError(f"{name} must be at least 0, got {value}")
    rng = random.Random(seed)

    def draw(n: int) -> list[int]:
        return [rng.randint(TOKEN_LO, TOKEN_HI) for _ in range(n)]

    system = draw(system_tokens)
    contexts = [draw(context_tokens) for _ in range(sessions)]
    users = [[draw(user_tokens) for _ in range(turns)] for _ in range(sessions)]
    return Workload(system, contexts, users)


def schedule(sessions: int, turns: int) -> list[tuple[int, int]]:
    """(session, turn) in the order asked: every session's turn 0, then every turn 1, ..."""
    return [(s, t) for t in range(turns) for s in range(sessions)]


def prompt_of(work: Workload, session: int, turn: int, answers: list[list[int]]) -> list[int]:
    """System prompt + context + every earlier (user message + answer) + this turn's message;
    answers[t] is the session's answer at turn t (each earlier one must be there)."""
    if len(answers) < turn:
        raise ValueError(f"session {session} turn {turn} needs {turn} earlier answers, "
                         f"has {len(answers)}")
    prompt = work.system + work.contexts[session]
    for t in range(turn):
        prompt = prompt + work.users[session][t] + answers[t]
    return prompt + work.users[session][turn]


def max_prompt_tokens(work: Workload, answer_tokens: int) -> int:
    return (len(work.system) + len(work.contexts[0])
            + work.turns * len(work.users[0][0]) + (work.turns - 1) * answer_tokens)


def all_fit_blocks(sessions: int, max_len: int, block_tokens: int) -> int:
    """KV cache blocks that hold every session's longest request, and one more of each."""
    return (sessions + 1) * -(-max_len // block_tokens)


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(run: dict[str, Any], reference: dict[str, Any] | None) -> dict[str, Any]:
    """One variant's figures from its child's JSON; tokens compared with `reference` (vLLM
    alone), request by request."""
    reqs = run["requests"]
    returning = [r for r in reqs if r["turn"] > 0]
    ttft = [r["ttft_s"] * 1e3 for r in returning if r["ttft_s"] is not None]
    wall = [r["wall_s"] * 1e3 for r in returning]
    decode = [(r["wall_s"] - r["ttft_s"]) * 1e3 / (len(r["tokens"]) - 1) for r in returning
              if r["ttft_s"] is not None and len(r["tokens"]) > 1]
    src = run["prompt_tokens_by_source"]
    prompt = sum(len(r["prompt"]) for r in reqs)
    saved = src.get("local_cache_hit", 0) + src.get("external_kv_transfer", 0)
    generated = sum(len(r["tokens"]) for r in reqs)
    out: dict[str, Any] = {
        "kv_blocks": run["kv_blocks"],
        "requests": len(reqs),
        "returning_requests": len(returning),
        "prompt_tokens": prompt,
        "prefill_computed_tokens": src.get("local_compute", 0),
        "prefix_cache_hit_tokens": src.get("local_cache_hit", 0),
        "connector_loaded_tokens": src.get("external_kv_transfer", 0),
        "prefill_saved_tokens": saved,
        "prefill_saved_frac": round(saved / prompt, 4) if prompt else None,
        "returning_computed_tokens": sum(len(r["prompt"]) - r["num_cached_tokens"]
                                         for r in returning),
        "ttft_ms_p50": _ms(percentile(ttft, 50)),
        "ttft_ms_p99": _ms(percentile(ttft, 99)),
        "wall_ms_p50": _ms(percentile(wall, 50)),
        "wall_ms_p99": _ms(percentile(wall, 99)),
        "decode_ms_per_token_p50": _ms(percentile(decode, 50)),
        "generated_tokens": generated,
        "run_s": round(run["run_s"], 3),
        "gen_tokens_per_s": round(generated / run["run_s"], 2) if run["run_s"] > 0 else None,
        "start_s": round(run["start_s"], 2),
    }
    if "disk_loaded_blocks" in run:
        out["disk_loaded_blocks"] = run["disk_loaded_blocks"]
    if reference is not None:
        ref = {(r["session"], r["turn"]): r["tokens"] for r in reference["requests"]}
        out["tokens_equal"] = (len(ref) == len(reqs) and all(
            ref.get((r["session"], r["turn"])) == r["tokens"] for r in reqs))
    return out


def combine(per_rep: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant's summaries over repetitions: the median of each number (None where a
    repetition has none), a flag true only where every repetition's is, and each repetition's
    own summary under "by_rep"."""
    if not per_rep:
        raise ValueError("no repetitions to combine")
    out: dict[str, Any] = {"reps": len(per_rep)}
    for key in per_rep[0]:
        values = [s.get(key) for s in per_rep]
        if all(isinstance(v, bool) for v in values):
            out[key] = all(values)
        elif any(v is None for v in values):
            out[key] = None
        else:
            out[key] = round(statistics.median(values), 4)
    out["by_rep"] = per_rep
    return out


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


# ---- one variant in its own process ---------------------------------------------------------

def make_model(path: str, layers: int, hidden: int, max_len: int) -> None:
    """A random Llama as tests/vllm/run_llm.py saves it (head_dim 32, weights drawn wide so
    greedy picks have clear margins), with `layers` and `hidden` as asked."""
    if os.path.exists(os.path.join(path, "config.json")):
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    heads = max(hidden // 32, 2)
    cfg = LlamaConfig(vocab_size=512, hidden_size=heads * 32, intermediate_size=2 * heads * 32,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=max(heads // 2, 1), max_position_embeddings=max_len,
                      initializer_range=0.2, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)


def _counters(llm: Any) -> dict[str, int]:
    """vLLM's prompt tokens by source (prometheus counters), summed over engines."""
    out = dict.fromkeys(SOURCES, 0)
    for m in llm.get_metrics():
        if m.name == "vllm:prompt_tokens_by_source" and m.labels.get("source") in out:
            out[m.labels["source"]] += int(m.value)
    return out


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one variant's workload in this process; its per-request records."""
    a = spec["args"]
    make_model(spec["model_dir"], a["layers"], a["hidden"], spec["max_model_len"])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = {}
    variant = spec["variant"]
    if variant in ("tpkv", "tpkv_disk"):
        extra: dict[str, Any] = {"host_bytes": a["host_mib"] << 20}
        if variant == "tpkv_disk":
            extra = {"host_bytes": a["disk_host_kib"] << 10, "disk_dir": spec["disk_dir"],
                     "disk_bytes": a["disk_mib"] << 20,
                     "disk_queue_bytes": a["disk_queue_kib"] << 10}
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="TpkvConnector", kv_connector_module_path="tpkv.integrations.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra)
    elif variant == "null_connector":
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="NullConnector", kv_connector_module_path="bench.vllm_null",
            kv_role="kv_both")
    elif variant in ("vllm_offload", "vllm_simple_offload"):
        kwargs["kv_offloading_size"] = a["offload_mib"] / 1024
    work = make_workload(a["seed"], a["sessions"], a["turns"], a["system_tokens"],
                         a["context_tokens"], a["user_tokens"])
    began = time.perf_counter()
    llm = LLM(spec["model_dir"], skip_tokenizer_init=True, dtype="float32",
              max_model_len=spec["max_model_len"], block_size=a["block_tokens"],
              num_gpu_blocks_override=spec["kv_blocks"], enable_prefix_caching=True,
              enforce_eager=True, seed=0, disable_log_stats=False, **kwargs)
    start_s = time.perf_counter() - began
    params = SamplingParams(max_tokens=a["answer_tokens"], temperature=0.0, ignore_eos=True)
    warm = make_workload(a["seed"] + 1, 1, 1, 0, len(work.system) + len(work.contexts[0]), 0)
    llm.generate([{"prompt_token_ids": warm.contexts[0]}], params, use_tqdm=False)
    before = _counters(llm)
    answers: list[list[list[int]]] = [[] for _ in range(work.sessions)]
    requests = []
    disk_blocks = 0
    run_began = time.perf_counter()
    for s, t in schedule(work.sessions, work.turns):
        prompt = prompt_of(work, s, t, answers[s])
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        wall = time.perf_counter() - t0
        tokens = list(out.outputs[0].token_ids)
        answers[s].append(tokens)
        metrics = out.metrics
        ttft = getattr(metrics, "first_token_latency", None) if metrics is not None else None
        stats = (out.kv_transfer_params or {}).get("tpkv", {})
        disk_blocks += stats.get("disk_loaded_blocks", 0)
        requests.append({"session": s, "turn": t, "prompt": prompt, "tokens": tokens,
                         "num_cached_tokens": out.num_cached_tokens or 0,
                         "connector_matched_tokens": stats.get("matched_tokens"),
                         "ttft_s": ttft if ttft else None, "wall_s": wall})
    run_s = time.perf_counter() - run_began
    after = _counters(llm)
    result = {"variant": variant, "kv_blocks": spec["kv_blocks"], "start_s": start_s,
              "run_s": run_s, "requests": requests,
              "prompt_tokens_by_source": {k: after[k] - before[k] for k in SOURCES}}
    if variant.startswith("tpkv"):
        result["disk_loaded_blocks"] = disk_blocks
    return result


def run_variant(args: argparse.Namespace, variant: str, model_dir: str, max_len: int
                ) -> dict[str, Any]:
    """One variant in a fresh process: its JSON, or {"error": ...} with the output's tail."""
    tmp = tempfile.mkdtemp(prefix=f"tpkv-bench-vllm-{variant}-")
    try:
        blocks = args.kv_blocks
        if variant == "vllm_all_fit":
            blocks = all_fit_blocks(args.sessions, max_len, args.block_tokens)
        spec = {"variant": variant, "args": vars(args), "model_dir": model_dir,
                "kv_blocks": blocks,
                "max_model_len": max_len, "disk_dir": os.path.join(tmp, "disk"),
                "out": os.path.join(tmp, "out.json")}
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH",
                                                                                "")]),
                   TOKENIZERS_PARALLELISM="false", VLLM_CPU_KVCACHE_SPACE="1",
                   VLLM_CPU_NUM_OF_RESERVED_CPU=str(args.reserved_cpus))
        if variant == "vllm_simple_offload":
            env["VLLM_USE_SIMPLE_KV_OFFLOAD"] = "1"
        cmd = [args.python, os.path.abspath(__file__), "--child", json.dumps(spec)]
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=args.variant_timeout_s)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {args.variant_timeout_s} s"}
        if proc.returncode != 0:
            log = os.path.join(tempfile.gettempdir(), f"tpkv-bench-vllm-{variant}.log")
            with open(log, "w") as f:
                f.write(proc.stdout + proc.stderr)
            return {"error": _error_line(proc.stdout + proc.stderr), "exit": proc.returncode,
                    "log": log}
        with open(spec["out"]) as f:
            data: dict[str, Any] = json.load(f)
        return data
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _error_line(text: str) -> str:
    """The root cause: the first line that names an exception (vLLM logs the worker's first and
    wraps it in later ones), without vLLM's log prefix; else the last non-empty line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    named = [ln.rsplit("] ", 1)[-1] for ln in lines
             if re.search(r"(Error|Exception): ", ln)]
    return (named[:1] or lines[-1:] or ["(no output)"])[0][:500]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4, help="turns a session, the first included")
    ap.add_argument("--system-tokens", type=int, default=64, help="shared by every session")
    ap.add_argument("--context-tokens", type=int, default=512, help="each session's own")
    ap.add_argument("--user-tokens", type=int, default=32)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--block-tokens", type=int, default=32)
    ap.add_argument("--kv-blocks", type=int, default=48, help="vLLM's KV cache, blocks")
    ap.add_argument("--host-mib", type=int, default=256, help="tpkv: host memory")
    ap.add_argument("--disk-host-kib", type=int, default=16384, help="tpkv_disk: host memory")
    ap.add_argument("--disk-queue-kib", type=int, default=12288,
                    help="tpkv_disk: the part of host memory for blocks on their way to disk "
                         "(a block the writer has no room for is given up)")
    ap.add_argument("--disk-mib", type=int, default=256, help="tpkv_disk: disk budget")
    ap.add_argument("--offload-mib", type=int, default=64, help="vLLM offloading: CPU buffer")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=1,
                    help="runs of each variant, alternating; figures are medians over them")
    ap.add_argument("--model-dir", default=None, help="default: a folder in /tmp by shape")
    ap.add_argument("--python", default=None, help="vLLM's interpreter (.venv-vllm)")
    ap.add_argument("--reserved-cpus", type=int, default=1,
                    help="VLLM_CPU_NUM_OF_RESERVED_CPU for every variant: cores kept from the "
                         "model's OpenMP threads (vLLM reserves one more with a KV connector; "
                         "on 2 cores that leaves none, and the variants would not compare)")
    ap.add_argument("--variant-timeout-s", type=int, default=420)
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "vllm.json"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        spec = json.loads(args.child)
        result = child(spec)
        with open(spec["out"], "w") as f:
            json.dump(result, f)
        return
    if args.python is None:
        venv = os.path.join(REPO, ".venv-vllm", "bin", "python")
        args.python = venv if os.path.exists(venv) else sys.executable
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    work = make_workload(args.seed, args.sessions, args.turns, args.system_tokens,
                         args.context_tokens, args.user_tokens)
    max_len = max_prompt_tokens(work, args.answer_tokens) + args.answer_tokens
    max_len = -(-max_len // args.block_tokens) * args.block_tokens
    if max_len > args.kv_blocks * args.block_tokens:
        raise SystemExit(f"--kv-blocks {args.kv_blocks} ({args.kv_blocks * args.block_tokens} "
                         f"tokens) cannot hold one request of up to {max_len} tokens")
    model_dir = args.model_dir or os.path.join(
        tempfile.gettempdir(), f"tpkv-bench-vllm-llama-{args.layers}x{args.hidden}-{max_len}")
    load_start = round(os.getloadavg()[0], 2)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for rep in range(args.reps):  # variants alternate, so a busy spell hits every one
        for variant in variants:
            if rep and "error" in runs[variant][0]:
                continue  # it did not start: once is enough
            load = round(os.getloadavg()[0], 2)
            began = time.perf_counter()
            run = run_variant(args, variant, model_dir, max_len)
            run["load_avg_1m"] = load
            runs[variant].append(run)
            print(f"rep {rep} {variant}: {time.perf_counter() - began:.0f} s "
                  f"{run.get('error', '')}", file=sys.stderr)
    refs = [r for r in runs.get("vllm", []) if "error" not in r]
    results: dict[str, dict[str, Any]] = {}
    for v, rs in runs.items():
        if "error" in rs[0]:
            results[v] = {"error": rs[0]["error"]}
            continue
        per_rep = [summarize(r, refs[i] if i < len(refs) else None) | {
            "load_avg_1m": r["load_avg_1m"]} for i, r in enumerate(rs)]
        results[v] = combine(per_rep)
    out = {
        "bench": "vllm",
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join([os.path.relpath(args.python, REPO), "bench/vllm.py",
                             *sys.argv[1:]]),
        "config": {k: v for k, v in vars(args).items() if k not in ("child", "out", "python")},
        "max_model_len": max_len,
        "kv_cache_tokens": args.kv_blocks * args.block_tokens,
        "session_tokens_last_turn": max_prompt_tokens(work, args.answer_tokens),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_avg_1m_at_start": load_start,
                    "load_avg_1m_at_end": round(os.getloadavg()[0], 2)},
        "results": results,
        "errors": {v: rs[0] for v, rs in runs.items() if "error" in rs[0]},
        "requests_first_rep": {
            v: [{k: x[k] for k in ("session", "turn", "num_cached_tokens",
                                   "connector_matched_tokens", "ttft_s", "wall_s")}
                | {"prompt_tokens": len(x["prompt"])} for x in rs[0]["requests"]]
            for v, rs in runs.items() if "error" not in rs[0]},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(json.dumps(out, indent=1) + "\n")
    print(json.dumps({v: {k: x for k, x in r.items() if k != "by_rep"}
                      for v, r in results.items()}, indent=1))


if __name__ == "__main__":
    main()
