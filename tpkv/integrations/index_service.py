"""The prefix index as a service: one step's index calls in, their answers out, as msgpack bytes.

IndexService holds a PrefixIndex and takes a batch of operations in one call (`call`, bytes in
and out through tpkv.protocol.wire: no pickled objects). It imports neither Ray nor torch: the
Ray actor around it is tpkv.integrations.vllm.ray_index, and tests call it in-process. Made
with an owner token (the scheduler's transport that made it, a str beside the spec's bytes, so
a restart from the same arguments keeps it), it answers no call that names another token
(IndexOwnerError): its host tier is that one scheduler's ranks' memory.

A request is a map: "inc", the incarnation the caller last saw (None: none yet); "sync", the
caller wants the whole index (it starts, or comes back after a failure); "keep", the keys no
reserve may drop this step; "ops", a list of [name, keys] run in order: "touch", "confirm",
"forget", "reserve" (answered, in order, by [keys to write, keys to drop]), and ["clear"]. The
answer has "inc", "stats" and either "reserved" or, when the caller's incarnation is not this
service's or it asked to sync, "stored" and "pending": the whole index, the caller's operations
not applied. Every (re)start of the service rebuilds the index from the disk tier (`rebuild`),
under a new incarnation; a sync from a caller that knew this incarnation (its earlier call
timed out and may have changed the index unseen) rebuilds it too.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from tpkv.checks import check_int
from tpkv.errors import IndexOwnerError, WireFormatError
from tpkv.integrations.disk_blocks import stored_keys
from tpkv.integrations.prefix_index import KEY_BYTES, IndexStats, PrefixIndex
from tpkv.protocol.wire import decode, encode

log = logging.getLogger(__name__)

OPS = ("touch", "confirm", "forget", "reserve", "clear")


@dataclass(frozen=True)
class IndexSpec:
    """What an index is made from: its capacity (host and disk blocks), and the disk tier it
    takes its blocks from at start (none when disk_dir is None): the first `disk_blocks` keys,
    newest first, that every one of `num_ranks` ranks holds for `seed` and `block_tokens`.
    `instance` names the vLLM instance whose index it is: its host tier is that instance's
    processes' own memory, so two instances never share an index (ray_index.actor_name)."""

    capacity_blocks: int
    block_tokens: int
    seed: bytes
    num_ranks: int = 1
    disk_dir: str | None = None
    disk_blocks: int = 0
    instance: str = ""

    def __post_init__(self) -> None:
        check_int("capacity_blocks", self.capacity_blocks)
        check_int("block_tokens", self.block_tokens)
        check_int("num_ranks", self.num_ranks)
        check_int("disk_blocks", self.disk_blocks, lo=0)
        if not isinstance(self.seed, bytes) or len(self.seed) != KEY_BYTES:
            raise WireFormatError(f"seed must be {KEY_BYTES} bytes, got {self.seed!r}")
        if self.disk_dir is not None and not isinstance(self.disk_dir, str):
            raise WireFormatError(f"disk_dir must be a str or None, got {self.disk_dir!r}")
        if not isinstance(self.instance, str):
            raise WireFormatError(f"instance must be a str, got {self.instance!r}")

    def to_bytes(self) -> bytes:
        return encode(asdict(self))

    @classmethod
    def from_bytes(cls, data: bytes) -> IndexSpec:
        d = decode(data)
        if not isinstance(d, dict) or set(d) != set(cls.__dataclass_fields__):
            raise WireFormatError(f"index spec must be a map of {sorted(cls.__dataclass_fields__)}")
        return cls(**d)


def build_index(spec: IndexSpec) -> PrefixIndex:
    """A PrefixIndex of spec's capacity holding the disk tier's blocks (see IndexSpec)."""
    index = PrefixIndex(spec.capacity_blocks)
    if spec.disk_dir is not None:
        found = stored_keys(spec.disk_dir, spec.seed, spec.block_tokens, spec.num_ranks)
        taken = index.adopt(found[-spec.disk_blocks:]) if spec.disk_blocks else 0
        log.info("tpkv prefix index: %d blocks found in the disk tier %s, %d taken",
                 len(found), spec.disk_dir, taken)
    return index


def _keys(value: Any, what: str) -> list[bytes]:
    if not isinstance(value, list) or not all(
            isinstance(k, bytes) and len(k) == KEY_BYTES for k in value):
        raise WireFormatError(f"{what} must be a list of {KEY_BYTES}-byte keys")
    return value


class IndexService:
    """One PrefixIndex behind a bytes-in, bytes-out call (see the module docstring)."""

    def __init__(self, spec: IndexSpec | bytes, owner: str = "") -> None:
        if not isinstance(owner, str):
            raise WireFormatError(f"owner must be a str, got {type(owner).__name__}")
        self.spec = spec if isinstance(spec, IndexSpec) else IndexSpec.from_bytes(spec)
        self.owner_token = owner  # "": any caller (in process)
        self.index = PrefixIndex(self.spec.capacity_blocks)
        self.incarnation = ""
        self.rebuild()

    def rebuild(self) -> None:
        """The index anew from the disk tier, under a new incarnation."""
        self.index = build_index(self.spec)
        self.incarnation = uuid.uuid4().hex

    def ping(self) -> str:
        return self.incarnation

    def owner(self) -> str:
        """The token of the caller this service answers ("" for any)."""
        return self.owner_token

    def call(self, payload: bytes, caller: str = "") -> bytes:
        """One batch of operations (see the module docstring); WireFormatError on a malformed
        one and IndexOwnerError from a caller that is not the owner, before any is applied."""
        if self.owner_token and caller != self.owner_token:
            raise IndexOwnerError(
                f"the prefix index of engine_id {self.spec.instance!r} belongs to the scheduler "
                f"with owner token {self.owner_token}, not to {str(caller)!r}: give each vLLM "
                f"instance its own engine_id")
        req = decode(payload)
        if not isinstance(req, dict):
            raise WireFormatError("index request must be a map")
        inc, ops = req.get("inc"), req.get("ops", [])
        keep = _keys(req.get("keep", []), "keep")
        if not isinstance(ops, list) or not all(
                isinstance(op, list) and op and op[0] in OPS for op in ops):
            raise WireFormatError(f"ops must be a list of [name, keys], name one of {OPS}")
        checked = [(op[0], _keys(op[1] if len(op) > 1 else [], op[0])) for op in ops]
        if req.get("sync") or inc != self.incarnation:
            if req.get("sync") and inc == self.incarnation:
                self.rebuild()  # the caller lost track of it: start over from the disk tier
            stored, pending = self.index.state()
            return encode({"inc": self.incarnation, "stored": stored, "pending": pending,
                           "stats": self._stats()})
        reserved: list[list[list[bytes]]] = []
        for name, keys in checked:
            if name == "reserve":
                write, drop = self.index.reserve(keys, keep=keep)
                reserved.append([write, drop])
            elif name == "clear":
                self.index.clear()
            else:
                getattr(self.index, name)(keys)
        return encode({"inc": self.incarnation, "reserved": reserved, "stats": self._stats()})

    def _stats(self) -> list[int]:
        return list(asdict(self.index.stats).values())


def stats_from_wire(values: Any) -> IndexStats:
    """IndexStats from the answer's "stats" list."""
    names = list(IndexStats.__dataclass_fields__)
    if not isinstance(values, list) or len(values) != len(names) or not all(
            isinstance(v, int) for v in values):
        raise WireFormatError(f"stats must be {len(names)} ints")
    return IndexStats(**dict(zip(names, values)))
