"""Typed errors raised at tpkv's boundaries; every message carries the numbers behind it."""

from __future__ import annotations


class TpkvError(Exception):
    """Base of every error tpkv raises on purpose."""


class ConfigError(TpkvError, ValueError):
    """A configuration value is invalid (raised at construction, before anything is allocated)."""


class SsdRootInUseError(ConfigError):
    """Another live SsdStore (this process or another) owns the L3 root for this rank; the
    message names the root, the rank and the holder's pid, host and model."""


class TierFullError(TpkvError):
    """A tier has fewer free slots than a request needs: `L2 needs 512 slots, 37 free of 4096`."""


class SlotError(TpkvError, IndexError):
    """A slot index is out of range or in the wrong state (double free, not allocated)."""


class InvalidSessionIdError(TpkvError, ValueError):
    """A session id is empty, too long or has characters outside `[A-Za-z0-9._:-]`."""


class UnknownSessionError(TpkvError, KeyError):
    """A session id the controller does not know."""


class PlanOrderError(TpkvError):
    """A plan arrived out of epoch order."""


class PlanMismatchError(TpkvError):
    """TP ranks disagree after applying a plan; names the ranks and the epoch."""


class ControllerError(TpkvError, RuntimeError):
    """A controller call failed on a bug of the controller (not a refusal of the request):
    its message names the call and the exception. The controller marks itself broken where
    its table may have changed; the runtime rebuilds it at its next call."""


class WireFormatError(TpkvError, ValueError):
    """A message failed to decode (bad msgpack, unknown type, limits exceeded)."""


class DeviceError(TpkvError, RuntimeError):
    """A CUDA call failed; the message holds the call and its error code."""


class SsdError(TpkvError):
    """The L3 SSD tier refused a request (its reads never raise for bad data: that is a miss)."""


class SsdRequestError(SsdError, ValueError):
    """An L3 call got bad arguments: wrong buffer size, dtype or shape, or a negative index."""


class SsdIoError(SsdError):
    """An OS call failed while writing L3 (e.g. ENOSPC); the previous committed state is intact."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


class SsdFormatError(SsdError):
    """An L3 file failed validation (magic, CRC32C, fingerprint); readers turn it into a miss."""


class DuplicateSessionError(TpkvError, ValueError):
    """A session id is opened twice, or appears twice in one step."""


class SessionClosedError(UnknownSessionError):
    """A session id that was closed (a double close, or a step naming a closed session)."""


class BadRequestError(TpkvError, ValueError):
    """A controller call got arguments it cannot act on (negative tokens, lengths that differ)."""


class ArgumentError(BadRequestError):
    """An argument of a public call is outside its bound (tpkv.limits) or of the wrong kind; the
    message names the argument, the value given and the bound."""


class ArgumentTypeError(ArgumentError, TypeError):
    """An argument of a public call has the wrong type (a float, bool or str for a count...)."""


class ControllerRecoveringError(TpkvError):
    """The controller restarted and waits for the workers' slot maps before it plans again."""


class RankMismatchError(PlanMismatchError):
    """All-gathered confirmations differ: `.epoch` is the first plan they differ on, `.ranks` the
    ranks whose row is not the one every rank expects from the plan."""

    def __init__(self, message: str, epoch: int = -1, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.epoch = epoch
        self.ranks = tuple(ranks)

    def __reduce__(self) -> tuple[type, tuple[str, int, tuple[int, ...]]]:
        return (type(self), (str(self), self.epoch, self.ranks))


class RankTimeoutError(TpkvError, TimeoutError):
    """A collective of the TP group failed or passed its bound; `.ranks` names the ranks that did
    not answer (dead, hung, or behind), as far as their heartbeats tell."""

    def __init__(self, message: str, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)

    def __reduce__(self) -> tuple[type, tuple[str, tuple[int, ...]]]:
        return (type(self), (str(self), self.ranks))


class WaitTimeoutError(TpkvError, TimeoutError):
    """A local wait (copy event, SSD I/O, controller lock) passed its bound."""


class IndexUnavailableError(TpkvError, RuntimeError):
    """The prefix index's actor is dead or did not answer in time (the scheduler goes on
    without it: nothing matches, nothing new is stored, until it is back)."""


class IndexOwnerError(IndexUnavailableError):
    """A prefix index's actor was called by a scheduler other than the one that made it (two
    vLLM instances given one engine_id): it answers only its owner, never with another's
    blocks; the message names the engine_id and both owner tokens."""


class LaunchError(TpkvError, RuntimeError):
    """Starting or joining a tpkv TP group failed (rendezvous, Ray, placement group, the app)."""


class KvLayoutError(TpkvError, ValueError):
    """An engine's KV cache (vLLM's) is laid out in a way tpkv cannot copy block by block; the
    message names the layer, its shape and strides."""
