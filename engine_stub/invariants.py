"""Runtime invariants: named, bucketed, level-gated checks that never synchronize the device.

Mirrors SGLang's invariant framework. Every check has two layers:

- the data layer (`recover`): an unconditional, branchless sanitiser that runs at every level,
  including OFF;
- the signal layer: gated by `InvariantCheckLevel`. At a level that crashes for the invariant's
  bucket, `expect` hands `ok.all()` to `torch._assert_async` (a device assert: on CUDA it
  surfaces at the next synchronization, on CPU it raises at once). Otherwise the count path adds
  `(~ok).sum()` to a per-invariant device counter, which only `hit_counts()` and
  `drain_firings()` read back, at points where the engine synchronizes anyway.

Every firing the host learns about becomes a `Firing` handed to the registered sink (the engine
wires the sink to its durable event log), before a crash path raises.
"""

from __future__ import annotations

import contextlib
import enum
import os
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from engine_stub.detectors import SCRATCH_PREFIX, detector

__all__ = [
    "Bucket",
    "Finite",
    "Firing",
    "InClosedRange",
    "InRange",
    "Invariant",
    "InvariantCheckLevel",
    "InvariantViolation",
    "IsTrue",
    "IsZero",
    "Positive",
    "checks_enabled",
    "counter_snapshot",
    "NotInf",
    "NotNaN",
    "PageAligned",
    "Property",
    "crashes",
    "drain_firings",
    "expect",
    "firing_from_device_assert",
    "get_invariant",
    "hit_counts",
    "override_level",
    "registered_invariants",
    "reset_counters",
    "resolve_level",
    "set_default_level",
    "set_firing_sink",
]

LEVEL_ENV = "ENGINE_STUB_INVARIANT_CHECK"
_ASSERT_PREFIX = "invariant-check FAILED"
_ASSERT_PATTERN = re.compile(re.escape(_ASSERT_PREFIX) + r" \[([^\]]+)\]")


class Bucket(enum.Enum):
    """Blast radius x recoverability of a violated invariant."""

    SOFTEN = "SOFTEN"  # a legitimate event, never a bug
    GUARD = "GUARD"  # recoverable, but a bug (or the cause is unknown)
    FATAL_CONTAINABLE = "FATAL_CONTAINABLE"  # no correct fallback, containment is cheap
    FATAL_UNCONTAINABLE = "FATAL_UNCONTAINABLE"  # global corruption


class InvariantCheckLevel(enum.IntEnum):
    OFF = 0
    WARN = 1
    STRICT = 2

    @classmethod
    def parse(cls, text: str, *, source: str = LEVEL_ENV) -> InvariantCheckLevel:
        """Parse `off|warn|strict` or `0|1|2` (case-insensitive); anything else is a ValueError."""
        key = text.strip().lower()
        by_text = {"off": cls.OFF, "warn": cls.WARN, "strict": cls.STRICT}
        by_digit = {"0": cls.OFF, "1": cls.WARN, "2": cls.STRICT}
        if key in by_text:
            return by_text[key]
        if key in by_digit:
            return by_digit[key]
        raise ValueError(f"{source}={text!r} is not a check level; use one of off|warn|strict or 0|1|2")


def crashes(bucket: Bucket, level: InvariantCheckLevel) -> bool:
    """SGLang's crash matrix: does a violation of `bucket` kill the process at `level`?"""
    if level == InvariantCheckLevel.OFF or bucket == Bucket.SOFTEN:
        return False
    if bucket == Bucket.FATAL_UNCONTAINABLE:
        return True
    return level == InvariantCheckLevel.STRICT


# --------------------------------------------------------------------------------------------
# Properties: element-wise predicates, no reductions (a reduction is the caller's business).


class Property:
    """An element-wise predicate: `ok(value)` returns a bool tensor shaped like `value`."""

    def ok(self, value: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return type(self).__name__ + "()"


class IsTrue(Property):
    """The value is the condition itself."""

    def ok(self, value: torch.Tensor) -> torch.Tensor:
        return value if value.dtype == torch.bool else value != 0


class Positive(Property):
    """value > 0 (e.g. a mapped SWA peer: 0 is the padding slot)."""

    def ok(self, value: torch.Tensor) -> torch.Tensor:
        return value > 0


class IsZero(Property):
    """value == 0 (e.g. a released SWA peer)."""

    def ok(self, value: torch.Tensor) -> torch.Tensor:
        return value == 0


class NotNaN(Property):
    def ok(self, value: torch.Tensor) -> torch.Tensor:
        return ~torch.isnan(value)


class NotInf(Property):
    def ok(self, value: torch.Tensor) -> torch.Tensor:
        return ~torch.isinf(value)


class Finite(Property):
    def ok(self, value: torch.Tensor) -> torch.Tensor:
        return torch.isfinite(value)


@dataclass(frozen=True, repr=True)
class InRange(Property):
    """lo <= value < hi (half-open)."""

    lo: float
    hi: float

    def __post_init__(self) -> None:
        if not self.lo < self.hi:
            raise ValueError(f"InRange needs lo < hi, got lo={self.lo}, hi={self.hi}")

    def ok(self, value: torch.Tensor) -> torch.Tensor:
        return (value >= self.lo) & (value < self.hi)


@dataclass(frozen=True, repr=True)
class InClosedRange(Property):
    """lo <= value <= hi."""

    lo: float
    hi: float

    def __post_init__(self) -> None:
        if not self.lo <= self.hi:
            raise ValueError(f"InClosedRange needs lo <= hi, got lo={self.lo}, hi={self.hi}")

    def ok(self, value: torch.Tensor) -> torch.Tensor:
        return (value >= self.lo) & (value <= self.hi)


@dataclass(frozen=True, repr=True)
class PageAligned(Property):
    """value % page_size == 0."""

    page_size: int

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"PageAligned needs page_size >= 1, got {self.page_size}")

    def ok(self, value: torch.Tensor) -> torch.Tensor:
        return torch.remainder(value, self.page_size) == 0


# --------------------------------------------------------------------------------------------
# Invariants and their registry.

_REGISTRY: dict[str, Invariant] = {}
_REGISTRY_LOCK = threading.Lock()


class Invariant:
    """A named runtime check, registered once per process by its unique name.

    Every name is declared in the detector catalogue (`engine_stub/detectors.py`) with the same
    bucket; names under `test.` are unit tests' scratch invariants, outside the catalogue.

    Args:
        name: unique dotted name (`swa.peer_mapped`); a duplicate raises KeyError, a name the
            catalogue does not declare raises KeyError.
        bucket: blast radius, which decides the crash matrix row; one that differs from the
            catalogue's raises ValueError.
        prop: the element-wise property `expect` evaluates.
        site: where the check runs (`SWATokenToKVPoolAllocator.free_swa`), for events.
        description: one line for `canary list invariants`.
        recover: optional branchless sanitiser `recover(value) -> value`, applied at every level.
            FATAL_UNCONTAINABLE invariants cannot be recovered from, so passing one is an error.
    """

    __slots__ = ("name", "bucket", "prop", "site", "description", "recover", "_counters")

    def __init__(
        self,
        name: str,
        bucket: Bucket,
        prop: Property,
        *,
        site: str = "",
        description: str = "",
        recover: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        if not name or not isinstance(name, str):
            raise ValueError(f"an invariant needs a non-empty name, got {name!r}")
        if not isinstance(bucket, Bucket):
            raise TypeError(f"invariant {name}: bucket must be a Bucket, got {bucket!r}")
        if bucket == Bucket.FATAL_UNCONTAINABLE and recover is not None:
            raise ValueError(f"invariant {name}: FATAL_UNCONTAINABLE has no correct recovery")
        _check_catalogued(name, bucket)
        self.name = name
        self.bucket = bucket
        self.prop = prop
        self.site = site
        self.description = description
        self.recover = recover
        # One int64 counter per device the check has run on; created on first use.
        self._counters: dict[torch.device, torch.Tensor] = {}
        with _REGISTRY_LOCK:
            if name in _REGISTRY:
                raise KeyError(f"invariant {name!r} is already registered")
            _REGISTRY[name] = self

    def __repr__(self) -> str:
        return f"Invariant({self.name!r}, {self.bucket.name}, {self.prop!r})"

    def _counter(self, device: torch.device) -> torch.Tensor:
        counter = self._counters.get(device)
        if counter is None:
            counter = torch.zeros((), dtype=torch.int64, device=device)
            self._counters[device] = counter
        return counter


def _check_catalogued(name: str, bucket: Bucket) -> None:
    """Refuse an invariant the detector catalogue does not declare, or declares otherwise."""
    if name.startswith(SCRATCH_PREFIX):
        return
    try:
        entry = detector(name)
    except KeyError:
        raise KeyError(f"invariant {name!r} is not in the detector catalogue: declare it in "
                       "engine_stub/detectors.py (name, bucket, site, description)") from None
    if entry.bucket != bucket.name:
        raise ValueError(f"invariant {name}: bucket {bucket.name} differs from the catalogue's "
                         f"{entry.bucket} (engine_stub/detectors.py)")


def registered_invariants() -> tuple[Invariant, ...]:
    """Every registered invariant, sorted by name."""
    with _REGISTRY_LOCK:
        return tuple(sorted(_REGISTRY.values(), key=lambda inv: inv.name))


def get_invariant(name: str) -> Invariant:
    """The invariant registered as `name`; an unknown name lists the registered ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise KeyError(f"unknown invariant {name!r}; registered: {known}") from None


# --------------------------------------------------------------------------------------------
# Level resolution.

_level_override: InvariantCheckLevel | None = None
_env_cache: tuple[str | None, InvariantCheckLevel] = (None, InvariantCheckLevel.OFF)


def resolve_level() -> InvariantCheckLevel:
    """The level in force: an `override_level` block, else `ENGINE_STUB_INVARIANT_CHECK`, else OFF."""
    global _env_cache
    if _level_override is not None:
        return _level_override
    raw = os.environ.get(LEVEL_ENV)
    cached_raw, cached_level = _env_cache
    if raw == cached_raw:
        return cached_level
    level = InvariantCheckLevel.OFF if raw is None or raw == "" else InvariantCheckLevel.parse(raw)
    _env_cache = (raw, level)
    return level


def checks_enabled() -> bool:
    """Whether `expect` evaluates anything now; guard costly value construction with it."""
    return resolve_level() != InvariantCheckLevel.OFF


@contextlib.contextmanager
def override_level(level: InvariantCheckLevel | str | int) -> Iterator[InvariantCheckLevel]:
    """Run a block at `level`, whatever the environment says (for tests and the engine config)."""
    global _level_override
    if isinstance(level, str):
        level = InvariantCheckLevel.parse(level, source="override_level")
    level = InvariantCheckLevel(level)
    previous = _level_override
    _level_override = level
    try:
        yield level
    finally:
        _level_override = previous


def set_default_level(level: InvariantCheckLevel | None) -> None:
    """Pin the process-wide level (the engine does this from its config); None unpins it."""
    global _level_override
    _level_override = None if level is None else InvariantCheckLevel(level)


# --------------------------------------------------------------------------------------------
# Firings: what the host learns, and where it goes.


@dataclass(frozen=True)
class Firing:
    """One invariant firing as the host saw it (count path at a drain, or the crash path)."""

    name: str
    bucket: str
    level: str
    site: str
    msg: str
    new_hits: int
    total_hits: int
    crashed: bool
    slots: tuple[int, ...] = ()

    def to_dict(self) -> dict:
        return {
            "invariant": self.name,
            "bucket": self.bucket,
            "level": self.level,
            "site": self.site,
            "msg": self.msg,
            "new_hits": self.new_hits,
            "total_hits": self.total_hits,
            "crashed": self.crashed,
            "slots": list(self.slots),
        }


class InvariantViolation(RuntimeError):
    """Raised on the crash path where the device assert fires synchronously (CPU tensors)."""

    def __init__(self, firing: Firing) -> None:
        super().__init__(f"{_ASSERT_PREFIX} [{firing.name}]: {firing.msg}")
        self.firing = firing


_sink: Callable[[Firing], None] | None = None
# Host mirror of each counter at the last drain, so a drain reports only what is new.
_drained_totals: dict[str, int] = {}
# Count-path calls since the last drain that named slots: (invariant, ok, slots, msg). Only
# references are kept (no host read); a drain resolves which slots failed.
_pending_contexts: list[tuple[Invariant, torch.Tensor, torch.Tensor, str]] = []
_MAX_PENDING = 4096
_MAX_SLOTS_PER_FIRING = 64


def set_firing_sink(sink: Callable[[Firing], None] | None) -> None:
    """Register the callable that receives every `Firing` (None: firings are only returned)."""
    global _sink
    _sink = sink


def _emit(firing: Firing) -> None:
    if _sink is not None:
        _sink(firing)


def _failed_slots(ok: torch.Tensor, slots: torch.Tensor | None) -> tuple[int, ...]:
    # Host read: only on the crash path or at a drain, where the engine syncs anyway.
    if slots is None:
        return ()
    bad = slots.reshape(-1)[~ok.reshape(-1)] if slots.numel() == ok.numel() else slots.reshape(-1)
    return tuple(int(s) for s in bad[:_MAX_SLOTS_PER_FIRING].tolist())


def expect(
    inv: Invariant,
    value: torch.Tensor,
    msg: str = "",
    *,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Check `inv.prop` on `value` at the level in force, without a host synchronization.

    Args:
        inv: the registered invariant.
        value: the tensor the property is evaluated on (element-wise).
        msg: a short hint for whoever reads the firing ("caller wants free_full").
        slots: optional tensor shaped like `value` naming the slots each element is about; a
            firing then lists the slots that failed.

    Returns:
        `value`, passed through `inv.recover` when the invariant has one.

    Raises:
        InvariantViolation: on the crash path, when the device assert fires synchronously
            (CPU tensors). On CUDA the assert fires at the next synchronization instead.
    """
    level = resolve_level()
    if level != InvariantCheckLevel.OFF and value.numel() > 0:
        ok = inv.prop.ok(value)
        if crashes(inv.bucket, level):
            # The crash path counts only when the assert fires synchronously (CPU); on CUDA the
            # failure kills the process at the next sync, and the assert message names it.
            _assert_or_raise(inv, ok, msg, level, slots)
        else:
            inv._counter(ok.device).add_((~ok).sum())
            if (slots is not None or msg) and len(_pending_contexts) < _MAX_PENDING:
                _pending_contexts.append((inv, ok, slots, msg))
    if inv.recover is not None:
        value = inv.recover(value)
    return value


def _assert_or_raise(
    inv: Invariant,
    ok: torch.Tensor,
    msg: str,
    level: InvariantCheckLevel,
    slots: torch.Tensor | None,
) -> None:
    text = f"{_ASSERT_PREFIX} [{inv.name}]: {msg}"
    try:
        # Looked up at call time, so tests can patch torch._assert_async and read its predicate.
        torch._assert_async(ok.all(), text)
    except RuntimeError:
        # Synchronous failure (CPU): we are dying anyway, so host reads are fine here.
        counter = inv._counter(ok.device)
        counter.add_((~ok).sum())
        total = int(counter.item())
        previous = _drained_totals.get(inv.name, 0)
        _drained_totals[inv.name] = total
        firing = Firing(
            name=inv.name,
            bucket=inv.bucket.name,
            level=level.name,
            site=inv.site,
            msg=msg,
            new_hits=total - previous,
            total_hits=total,
            crashed=True,
            slots=_failed_slots(ok, slots),
        )
        _emit(firing)
        raise InvariantViolation(firing) from None


def hit_counts() -> dict[str, int]:
    """Total hits per registered invariant (a host read: call it where the engine syncs)."""
    counts = {}
    for inv in registered_invariants():
        counts[inv.name] = sum(int(c.item()) for c in inv._counters.values())
    return counts


def counter_snapshot() -> tuple[list[str], torch.Tensor | None]:
    """Every live counter stacked into one device tensor (no host read), with the names in order.

    The engine concatenates it with the step's sampled tokens, so that one device-to-host copy
    brings back both; `drain_firings(totals)` then needs no read of its own.
    """
    names, counters = [], []
    for inv in registered_invariants():
        for counter in inv._counters.values():
            names.append(inv.name)
            counters.append(counter)
    return names, (torch.stack(counters) if counters else None)


def drain_firings(totals: dict[str, int] | None = None) -> list[Firing]:
    """Turn each counter increase since the last drain into a `Firing`.

    Args:
        totals: host copies of the counters (from `counter_snapshot`, read back by the caller).
            None reads every counter here: a host read, for idle ticks and tests.

    Each firing goes to the sink and is returned. Resolving which slots failed reads the device,
    but only for an invariant that fired.
    """
    level = resolve_level()
    pending = list(_pending_contexts)
    _pending_contexts.clear()
    firings = []
    for name, total in (hit_counts() if totals is None else totals).items():
        previous = _drained_totals.get(name, 0)
        if total <= previous:
            continue
        _drained_totals[name] = total
        inv = _REGISTRY[name]
        slots: list[int] = []
        msgs: list[str] = []
        for pending_inv, ok, pending_slots, msg in pending:
            if pending_inv is not inv:
                continue
            bad = _failed_slots(ok, pending_slots)
            slots.extend(bad)
            failed = bool(bad) if pending_slots is not None else not bool(ok.all())
            if failed and msg and msg not in msgs:
                msgs.append(msg)
        firing = Firing(
            name=name,
            bucket=inv.bucket.name,
            level=level.name,
            site=inv.site,
            msg="; ".join(msgs),
            new_hits=total - previous,
            total_hits=total,
            crashed=False,
            slots=tuple(slots[:_MAX_SLOTS_PER_FIRING]),
        )
        _emit(firing)
        firings.append(firing)
    return firings


def firing_from_device_assert(exc: BaseException, *, level: InvariantCheckLevel | None = None) -> Firing | None:
    """The firing named by a device-assert error that surfaced at a later sync (CUDA), if any."""
    match = _ASSERT_PATTERN.search(str(exc))
    if match is None:
        return None
    name = match.group(1)
    inv = _REGISTRY.get(name)
    return Firing(
        name=name,
        bucket=inv.bucket.name if inv else "UNKNOWN",
        level=(level or resolve_level()).name,
        site=inv.site if inv else "",
        msg=str(exc).split("]: ", 1)[-1][:500],
        new_hits=1,
        total_hits=1,
        crashed=True,
    )


def reset_counters() -> None:
    """Zero every counter and forget pending firings (tests, and a fresh engine run)."""
    for inv in registered_invariants():
        for counter in inv._counters.values():
            counter.zero_()
    _drained_totals.clear()
    _pending_contexts.clear()
