"""Scheduler side: how many prompt tokens the store holds, and each step's loads and saves."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from tpkv.checks import check_int
from tpkv.integrations.prefix_index import PrefixIndex, extend_chain
from tpkv.integrations.vllm.load_policy import LoadPolicy
from tpkv.integrations.vllm.plan import LoadSpec, SaveSpec, StepPlan, StepReport
from tpkv.integrations.vllm.rank_check import unconfirmed_saves
from tpkv.integrations.vllm.remote_index import RemoteIndex
from tpkv.integrations.vllm.stats import ConnectorCounters


@dataclass
class _Req:
    """What the planner keeps of one live request."""

    request: Any  # vllm.v1.request.Request: read, never changed
    seed: bytes | None  # the chain's seed for this request; None: its KV is not the tokens'
    keys: list[bytes] = field(default_factory=list)
    local_tokens: int = 0  # tokens vLLM's own prefix cache held at the last match
    matched_tokens: int = 0  # tokens the store promised beyond them
    load: LoadSpec | None = None  # to go out in the next plan
    load_end: int = 0  # the logical block after the last one loaded
    load_async: bool = False  # the matched tokens load in the background
    awaits_load: bool = False  # its background load went out: vLLM allocates again after it
    async_load_blocks: int = 0
    saved_upto: int = 0  # logical blocks before this one were stored or asked to be
    written_blocks: int = 0
    deduplicated_blocks: int = 0
    failed_load_blocks: int = 0
    disk_loaded_blocks: int = 0


class Planner:
    """Owns the prefix index. Per request: the chain keys of its full blocks; at the first
    schedule, the leading keys the index holds beyond vLLM's own cache (a load); every step, the
    blocks that became full and computed (saves of the keys the index did not hold). The last
    token of a prompt is never served: vLLM computes at least one token to sample from. A
    request's chain starts from its own seed (request_seed): LoRA adapters and cache salts
    never share blocks with plain requests, multimodal ones are not cached. `counters` keeps
    the running figures the dashboard shows. With `num_ranks` ranks (tensor x pipeline
    parallel) the index holds a key only once every rank stored it (rank_check). `policy`
    says which loads run in the background (none without one): their keys are kept in the
    index, never dropped for room, until every rank reported the load finished
    (loads_finished). The index is this process's PrefixIndex, or a RemoteIndex on an actor
    (the connector's `controller`), asked once a step (reserve_all)."""

    def __init__(self, block_tokens: int, seed: bytes, capacity_blocks: int,
                 num_ranks: int = 1, policy: LoadPolicy | None = None,
                 index: PrefixIndex | RemoteIndex | None = None) -> None:
        check_int("block_tokens", block_tokens)
        check_int("num_ranks", num_ranks)
        self.num_ranks = num_ranks
        self.block_tokens = block_tokens
        self.seed = seed
        self.index = PrefixIndex(capacity_blocks) if index is None else index
        self._reqs: dict[str, _Req] = {}
        self._drops: list[bytes] = []  # keys forgotten by reset, for the next plan
        self.counters = ConnectorCounters(block_tokens)
        self.policy = policy
        self._inflight: dict[str, list[bytes]] = {}  # background loads by request

    def request_seed(self, request: Any) -> bytes | None:
        """The chain seed of a request: the model's, salted by a LoRA adapter and vLLM's
        cache_salt when it has them (their KV differs, or must not be shared). None for a
        request whose KV its token ids do not decide (images and other multimodal inputs,
        prompt embeddings): it is neither served nor stored."""
        if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds",
                                                            None) is not None:
            return None
        lora = getattr(request, "lora_request", None)
        salt = getattr(request, "cache_salt", None)
        if lora is None and not salt:
            return self.seed
        extra = (f"|lora={getattr(lora, 'lora_name', None)}|{getattr(lora, 'lora_path', None)}"
                 f"|salt={salt}")
        return xxhash.xxh3_128_digest(self.seed + extra.encode())

    def _keys(self, req: _Req, num_tokens: int) -> list[bytes]:
        if req.seed is None:
            return []
        tokens = req.request.all_token_ids
        upto = min(num_tokens, len(tokens)) // self.block_tokens * self.block_tokens
        if len(req.keys) * self.block_tokens < upto:
            extend_chain(req.keys, tokens[:upto], self.block_tokens, req.seed)
        return req.keys[:upto // self.block_tokens]

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens after `num_computed_tokens` (vLLM's own hit, block-aligned) that the store
        can load. Called again for the same request, it answers from the index as it is now."""
        req = self._reqs.get(request.request_id)
        if req is None or req.request is not request:
            req = self._reqs[request.request_id] = _Req(request, self.request_seed(request))
        req.local_tokens, req.matched_tokens, req.load = num_computed_tokens, 0, None
        req.load_async = req.awaits_load = False
        if num_computed_tokens % self.block_tokens:
            return 0
        keys = self._keys(req, len(request.all_token_ids) - 1)
        held = self.index.match(keys)
        first = num_computed_tokens // self.block_tokens
        if held <= first:
            return 0
        req.matched_tokens = (held - first) * self.block_tokens
        req.load_async = self.policy is not None and self.policy.runs_async(keys[first:held])
        return req.matched_tokens

    def loads_async(self, req_id: str) -> bool:
        """Whether the tokens matched_tokens last promised this request load in the
        background (False when it promised none)."""
        req = self._reqs.get(req_id)
        return req is not None and req.matched_tokens > 0 and req.load_async

    def after_alloc(self, request: Any, block_ids: Sequence[int], num_external: int) -> None:
        """vLLM allocated the request's blocks; plan the load of the `num_external` tokens."""
        req = self._reqs.get(request.request_id)
        if req is None or req.awaits_load:  # vLLM's second call, once the load is done
            return
        self.counters.allocated(len(request.all_token_ids), req.local_tokens, num_external)
        if num_external <= 0:
            return
        first = req.local_tokens // self.block_tokens
        count = num_external // self.block_tokens
        keys = req.keys[first:first + count]
        if num_external % self.block_tokens or len(keys) != count or len(block_ids) < first + count:
            raise AssertionError(f"request {request.request_id}: load of {num_external} tokens "
                                 f"from block {first} does not fit {len(keys)} keys and "
                                 f"{len(block_ids)} blocks")
        req.load = LoadSpec(request.request_id, first, list(block_ids[first:first + count]), keys,
                            background=req.load_async)
        req.load_end = first + count
        req.awaits_load = req.load_async
        if req.load_async:
            req.async_load_blocks += count
        self.index.touch(reversed(keys))

    def plan(self, scheduled: Iterable[tuple[str, int]],
             block_ids_of: Callable[[str], Sequence[int]], idle: bool = False) -> StepPlan:
        """This step's plan: the loads planned since the last one, and for each scheduled
        (request id, tokens computed once this step ran) the saves of its newly full blocks.
        In an `idle` step (no forward) a background load under the policy's min_bytes runs
        inline: nothing would run beside it, and a thread only adds hand-offs."""
        self.counters.step()
        plan = StepPlan(drops=self._drops)
        self._drops = []
        loading: list[bytes] = []
        for pending in self._reqs.values():
            if pending.load is not None:
                plan.loads.append(pending.load)
                loading.extend(pending.load.keys)
                if pending.load.background:
                    self._inflight[pending.load.req_id] = pending.load.keys
                    pending.load.inline = idle and self.policy is not None and (
                        len(pending.load.keys) * self.policy.block_bytes
                        < self.policy.min_bytes)
                if self.policy is not None:
                    self.policy.used(pending.load.keys)
                pending.load = None
        for keys in self._inflight.values():
            loading.extend(keys)  # read by a background load: not dropped for room
        batch: list[tuple[str, _Req, list[bytes], list[bytes], Sequence[int]]] = []
        for req_id, computed in scheduled:
            req = self._reqs.get(req_id)
            if req is None:
                continue
            keys = self._keys(req, computed)
            if len(keys) <= req.saved_upto:
                continue
            ids = block_ids_of(req_id)
            batch.append((req_id, req, keys, keys[req.saved_upto:min(len(keys), len(ids))],
                          ids))
        answers = self.index.reserve_all([b[3] for b in batch], keep=loading)
        if isinstance(self.index, RemoteIndex) and self.index.down:  # stored once it is back
            return plan
        for (req_id, req, keys, new, ids), (write, drop) in zip(batch, answers):
            plan.drops.extend(drop)
            if self.policy is not None:
                self.policy.gone(drop)
                self.policy.used(write)
            req.deduplicated_blocks += len(new) - len(write)
            req.written_blocks += len(write)
            wanted = set(write)
            tokens = req.request.all_token_ids
            for i in range(req.saved_upto, req.saved_upto + len(new)):
                if keys[i] in wanted:
                    parent = keys[i - 1] if i else req.seed
                    assert parent is not None  # a request without a seed has no keys
                    chunk = tuple(tokens[i * self.block_tokens:(i + 1) * self.block_tokens])
                    plan.saves.append(SaveSpec(req_id, int(ids[i]), keys[i], parent, chunk))
            req.saved_upto += len(new)
        return plan

    def report(self, report: StepReport) -> None:
        """The workers' report of a step (merged over ranks): keep what every rank wrote,
        forget what a rank failed to save or load or lost, or what a rank did not report on,
        and have every rank drop those keys (a rank whose save went through may hold KV that
        another rank's failed load made wrong: vLLM recomputes it, and it is saved again from
        there), save again from a request's first block whose load failed (vLLM recomputes
        it), and count the blocks loaded from disk before that block (vLLM recomputes the
        rest)."""
        failed = report.failed_saves | report.failed_loads | report.lost
        failed |= unconfirmed_saves(report, self.num_ranks)
        self.index.confirm(report.saved - failed)
        self.index.forget(failed)
        self._drops.extend(sorted(failed))
        if self.policy is not None:
            self.policy.gone(failed)
        recomputed = failed_blocks = disk_blocks = 0
        for req_id, first in report.failed_load_reqs.items():
            req = self._reqs.get(req_id)
            if req is not None:
                req.saved_upto = min(req.saved_upto, first)
                num_failed = len(report.failed_loads & set(req.keys[first:]))
                req.failed_load_blocks += num_failed
                failed_blocks += num_failed
                recomputed += max(0, req.load_end - first)
        for req_id, blocks in report.disk_loads.items():
            req = self._reqs.get(req_id)
            if req is not None:
                first_failed = report.failed_load_reqs.get(req_id)
                loaded = sum(1 for b in blocks if first_failed is None or b < first_failed)
                req.disk_loaded_blocks += loaded
                disk_blocks += loaded
        self.counters.reported(report, recomputed, failed_blocks, disk_blocks)

    def loads_finished(self, req_ids: Iterable[str]) -> None:
        """Every rank finished these requests' background loads (vLLM's finished_recving):
        their keys may be dropped for room again."""
        for req_id in req_ids:
            self._inflight.pop(req_id, None)

    def reset(self) -> None:
        """Forget every stored block (vLLM's reset_prefix_cache(reset_connector=True)): the
        next plan drops them on every rank, and nothing matches until written again."""
        self._drops.extend(self.index.clear())
        if self.policy is not None:
            self.policy.clear()

    def finished(self, req_id: str) -> dict[str, int]:
        """Forget a finished request; what it got from and gave to the store."""
        req = self._reqs.pop(req_id, None)
        if req is None:
            return {}
        return {
            "matched_tokens": req.matched_tokens,
            "failed_load_blocks": req.failed_load_blocks,
            "disk_loaded_blocks": req.disk_loaded_blocks,
            "async_load_blocks": req.async_load_blocks,
            "written_blocks": req.written_blocks,
            "deduplicated_blocks": req.deduplicated_blocks,
            "index_blocks": self.index.num_stored,
        }
