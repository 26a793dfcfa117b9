"""A TpkvConnector whose worker flips a byte of chosen records before loading: a corrupt store.

Records of blocks whose first token is CORRUPT_TOKEN are damaged just before each load, in
memory or in their file on disk, so the store's checks must turn them into failed loads (vLLM
recomputes them) and the tokens must stay equal to a run without the connector. Other blocks
are served as usual.
"""

from __future__ import annotations

from typing import Any

from tpkv.integrations.vllm.connector import TpkvConnector

CORRUPT_TOKEN = 499


class SabotagedTpkvConnector(TpkvConnector):
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self.copier is not None and self.copier.store is not None
        store = self.copier.store
        for spec in self._plan().loads:
            for key in spec.keys:
                rec = store.record(key)
                if rec is not None and rec.tokens[0] == CORRUPT_TOKEN:
                    rec.data[0, 0] ^= 0xFF
                peeked = store.disk.peek(key) if store.disk is not None else None
                if rec is None and peeked is not None and peeked[1][0] == CORRUPT_TOKEN:
                    with open(store.disk.path(key), "r+b") as f:  # the block's last byte
                        f.seek(-1, 2)
                        last = f.read(1)[0]
                        f.seek(-1, 2)
                        f.write(bytes([last ^ 0xFF]))
        super().start_load_kv(forward_context, **kwargs)
