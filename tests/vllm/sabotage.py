"""A TpkvConnector whose worker flips a byte of chosen records before loading: a corrupt store.

Records of blocks whose first token is CORRUPT_TOKEN are damaged just before each load, in
memory or in their file on disk, so the store's checks must turn them into failed loads (vLLM
recomputes them) and the tokens must stay equal to a run without the connector. Other blocks
are served as usual. SabotagedRankConnector damages only the disk records of one rank
(tensor parallel runs), each once, and fills that rank's vLLM blocks whose load failed with
large noise (standard deviation 50), so that the KV every rank computes over them in the failed
step is far from right: a copy of it served later changes the greedy tokens. A background
load's failed blocks get the noise when the rank reports them (the request has not run over
them: vLLM must recompute them before it does).

With TPKV_TEST_LAYER_LOG set, SabotagedTpkvConnector writes after each step, to that path, how
many blocks its rank loaded and how many of those layer by layer, the forwards that skipped a
layer's wait, and the layer order its hooks learned (JSON).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from tpkv.integrations.vllm.connector import TpkvConnector

CORRUPT_TOKEN = 499
DAMAGED_RANK = 1


def damage(connector: TpkvConnector, in_memory: bool, once: set[bytes] | None = None) -> None:
    """Damage the records of this step's loads that start with CORRUPT_TOKEN: those on disk,
    and with `in_memory` those in memory too; with `once`, only keys not in it (then added)."""
    assert connector.copier is not None and connector.copier.store is not None
    store = connector.copier.store
    for spec in connector._plan().loads:
        for key in spec.keys:
            if once is not None and key in once:
                continue
            rec = store.record(key)
            if in_memory and rec is not None and rec.tokens[0] == CORRUPT_TOKEN:
                rec.data[0, 0] ^= 0xFF
            peeked = store.disk.peek(key) if store.disk is not None else None
            if rec is None and peeked is not None and peeked[1][0] == CORRUPT_TOKEN:
                with open(store.disk.path(key), "r+b") as f:  # the block's last byte
                    f.seek(-1, 2)
                    last = f.read(1)[0]
                    f.seek(-1, 2)
                    f.write(bytes([last ^ 0xFF]))
                if once is not None:
                    once.add(key)


class SabotagedTpkvConnector(TpkvConnector):
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        damage(self, in_memory=True)
        super().start_load_kv(forward_context, **kwargs)

    def wait_for_save(self) -> None:
        super().wait_for_save()
        path = os.environ.get("TPKV_TEST_LAYER_LOG")
        copier = self.copier
        if path and copier is not None:
            hooks = getattr(self, "hooks", None)
            with open(path, "w") as f:
                json.dump({"loaded_blocks": copier.num_loaded_blocks,
                           "layer_loaded_blocks": getattr(copier, "num_layer_loaded_blocks", 0),
                           "layer_misses": getattr(copier, "num_layer_misses", 0),
                           "order": getattr(hooks, "order", None)}, f)


class SabotagedRankConnector(TpkvConnector):
    damaged: set[bytes] = set()  # each record is damaged once: its recomputed copy loads

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        copier = self.copier
        assert copier is not None
        if copier.rank != DAMAGED_RANK:
            super().start_load_kv(forward_context, **kwargs)
            return
        damage(self, in_memory=False, once=self.damaged)
        super().start_load_kv(forward_context, **kwargs)
        noise(self, copier._failed_block_ids)  # what the failed step computes over

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed = super().get_block_ids_with_load_errors()
        if self.copier is not None and self.copier.rank == DAMAGED_RANK:
            noise(self, failed)
        return failed


def noise(connector: TpkvConnector, block_ids: set[int]) -> None:
    assert connector.copier is not None
    for block_id in block_ids:
        for view in connector.copier._views:
            view[block_id].view(torch.float32).normal_(0.0, 50.0)
