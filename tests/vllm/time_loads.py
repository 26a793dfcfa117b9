"""Not a test: times a returning turn whose blocks tpkv loads from its disk tier, with the load
in the background (async_loads "always") or before the step's forward ("never").

`python tests/vllm/time_loads.py MODEL_DIR OUT_JSON {always,never} [REPS] [{disk,memory}]` (the
venv of `make vllm-venv`; VLLM_CPU_KVCACHE_SPACE=1 as tests/vllm/harness.py sets it). Each rep:
a new 100-token first turn, a 100-token filler that pushes its 3 blocks out to disk (2 blocks of
host memory, disk writes on the step's path; with "memory", 64 MiB of host memory keeps them
there), vLLM's own prefix cache emptied, then the second turn
(the first and 60 more tokens, 8 greedy tokens) alone, and again beside a new 300-token prompt
in one generate call. Writes each rep's seconds and the tokens.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time


def main() -> None:
    model_dir, out_path, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    reps = int(sys.argv[4]) if len(sys.argv) > 4 else 8
    tier = sys.argv[5] if len(sys.argv) > 5 else "disk"
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from run_llm import BLOCK_TOKENS, make_model
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    make_model(model_dir)
    block_bytes = 2 * 2 * BLOCK_TOKENS * 2 * 32 * 4
    extra = {"host_bytes": 2 * block_bytes if tier == "disk" else 64 << 20,
             "disk_dir": tempfile.mkdtemp(prefix="tpkv-time-"), "disk_queue_bytes": 0,
             "async_loads": mode}
    llm = LLM(model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=1024,
              block_size=BLOCK_TOKENS, enable_prefix_caching=True, enforce_eager=True, seed=0,
              kv_transfer_config=KVTransferConfig(
                  kv_connector="TpkvConnector", kv_connector_module_path="tpkv.integrations.vllm",
                  kv_role="kv_both", kv_load_failure_policy="recompute",
                  kv_connector_extra_config=extra))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def seq(start: int, n: int) -> list[int]:
        return [2 + (start + 19 * i) % 490 for i in range(n)]

    def gen(prompts: list[list[int]]) -> tuple[float, list]:
        began = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - began, outs

    alone, beside, tokens = [], [], []
    for rep in range(reps):
        for second in (False, True):
            first = seq(1000 * rep + 500 * second, 100)
            gen([first])
            gen([seq(1000 * rep + 500 * second + 7, 100)])  # pushes first's blocks to disk
            llm.reset_prefix_cache()
            prompts = [first + seq(3 * rep + 1, 60)]
            if second:
                prompts.append(seq(1000 * rep + 250, 300))
            took, outs = gen(prompts)
            (beside if second else alone).append(took)
            stats = (outs[0].kv_transfer_params or {}).get("tpkv", {})
            tokens.append({"tokens": list(outs[0].outputs[0].token_ids),
                           "matched": stats.get("matched_tokens"),
                           "async_blocks": stats.get("async_load_blocks")})
    with open(out_path, "w") as f:
        json.dump({"mode": mode, "tier": tier, "alone_s": alone, "beside_s": beside,
                   "turns": tokens}, f)


if __name__ == "__main__":
    main()
