"""Runtime invariants: named, bucketed, level-gated checks that never synchronize the device.

Mirrors SGLang's invariant framework. Every check has two layers:

- the data layer (`recover`): an unconditional, branchless sanitiser that runs at every level,
  including OFF;
- the signal layer: gated by `InvariantCheckLevel`. At a level that crashes for the invariant's
  bucket, `expect` hands `ok.all()` (`Property.all_ok`) to `torch._assert_async` (a device
  assert: on CUDA it surfaces at the next synchronization, on CPU it raises at once). Otherwise
  the count path adds the number of failing elements to the invariant's device counter, which only
  `counter_snapshot()`, `hit_counts()` and `drain_firings()` read back, at points where the
  engine synchronizes anyway.

Every firing the host learns about becomes a `Firing` handed to the registered sink (the engine
wires the sink to its durable event log), before a crash path raises.

The hot path is kept small: all counters of a device live in one int64 tensor, one row per
invariant (row 0 takes what a batched add routes nowhere), so a batched count is one
`index_add_`; each invariant has its crash decision per level and its assert messages
precomputed. Count-only invariants a call site reports together form a `CountGroup`: the caller
adds their counts in one op (`CountGroup.add`), possibly later, as long as it does so before the
next read (a *count source*, `register_count_source`, is flushed by every reader), and records
one context per report (`note_failures`) from which a drain resolves the failing slots.
"""

from __future__ import annotations

import contextlib
import enum
import os
import re
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine_stub.detectors import SCRATCH_PREFIX, detector

__all__ = [
    "Bucket",
    "CountGroup",
    "CountSource",
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
    "note_failures",
    "override_level",
    "register_count_source",
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
    """An element-wise predicate: `ok(value)` returns a bool tensor shaped like `value`.

    `fails(value)` is its negation, `~ok(value)`, which the count path counts, and
    `all_ok(value)` the 0-dim `ok(value).all()` the crash path asserts; a property may compute
    either in fewer or cheaper ops (`value != 0` rather than `~(value == 0)`).
    """

    def ok(self, value: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def fails(self, value: torch.Tensor) -> torch.Tensor:
        return ~self.ok(value)

    def all_ok(self, value: torch.Tensor) -> torch.Tensor:
        return self.ok(value).all()

    def __repr__(self) -> str:
        return type(self).__name__ + "()"


class IsTrue(Property):
    """The value is the condition itself."""

    def ok(self, value: torch.Tensor) -> torch.Tensor:
        return value if value.dtype == torch.bool else value != 0

    def fails(self, value: torch.Tensor) -> torch.Tensor:
        return ~value if value.dtype == torch.bool else value == 0


class Positive(Property):
    """value > 0 (e.g. a mapped SWA peer: 0 is the padding slot)."""

    def ok(self, value: torch.Tensor) -> torch.Tensor:
        return value > 0

    def fails(self, value: torch.Tensor) -> torch.Tensor:
        # `<=` negates `>` except on NaN, which only a floating-point value holds.
        return ~(value > 0) if value.is_floating_point() else value <= 0

    def all_ok(self, value: torch.Tensor) -> torch.Tensor:
        # The minimum is > 0 iff every element is (a NaN makes the minimum NaN: not > 0).
        return value.min() > 0


class IsZero(Property):
    """value == 0 (e.g. a released SWA peer)."""

    def ok(self, value: torch.Tensor) -> torch.Tensor:
        return value == 0

    def fails(self, value: torch.Tensor) -> torch.Tensor:
        return value != 0  # (`!=` negates `==` on every value, NaN included)

    def all_ok(self, value: torch.Tensor) -> torch.Tensor:
        return torch.count_nonzero(value) == 0  # (NaN counts as nonzero, as `NaN == 0` fails)


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
# Counter rows: row 0 takes what a batched add routes nowhere (`CountGroup.index`); invariant
# number k (in registration order) counts in row k. One int64 tensor per device, created on
# first use and grown (copied) when registrations outrun it.
_PASS_ROW = 0
_ROWS: list[Invariant] = []  # by row - 1
_counters: dict[torch.device, torch.Tensor] = {}
_capacity = 64
# (names sorted, their rows) for `counter_snapshot`, and each device's index of those rows.
_order: tuple[list[str], list[int]] | None = None
_order_index: dict[torch.device, torch.Tensor] = {}


def _counters_on(device: torch.device) -> torch.Tensor:
    """The device's counter tensor (every invariant's row), created zeroed on first use."""
    counters = _counters.get(device)
    if counters is None:
        counters = torch.zeros(_capacity, dtype=torch.int64, device=device)
        _counters[device] = counters
    return counters


def _grow(rows: int) -> None:
    """Make room for `rows` counter rows (registration; host code, device copies only)."""
    global _capacity
    if rows <= _capacity:
        return
    capacity = _capacity
    while capacity < rows:
        capacity *= 2
    for device, old in list(_counters.items()):
        grown = torch.zeros(capacity, dtype=torch.int64, device=device)
        grown[: old.numel()].copy_(old)
        _counters[device] = grown
    _capacity = capacity
    for inv in _ROWS:
        inv._views.clear()  # they viewed the old tensors


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

    __slots__ = (
        "name", "bucket", "prop", "site", "description", "recover", "_row", "_crash_at", "_texts",
        "_views",
    )

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
        # The crash matrix row, indexed by level (OFF, WARN, STRICT).
        self._crash_at = tuple(crashes(bucket, level) for level in InvariantCheckLevel)
        # The device assert's message per `msg`, built once.
        self._texts: dict[str, str] = {}
        # This invariant's 0-dim view into each device's counter tensor.
        self._views: dict[torch.device, torch.Tensor] = {}
        global _order
        with _REGISTRY_LOCK:
            if name in _REGISTRY:
                raise KeyError(f"invariant {name!r} is already registered")
            _REGISTRY[name] = self
            _ROWS.append(self)
            self._row = len(_ROWS)
            _grow(self._row + 1)
            _order = None
            _order_index.clear()

    def __repr__(self) -> str:
        return f"Invariant({self.name!r}, {self.bucket.name}, {self.prop!r})"

    def _counter(self, device: torch.device) -> torch.Tensor:
        """This invariant's counter on `device`: a 0-dim view into the device's counter tensor."""
        view = self._views.get(device)
        if view is None:
            view = _counters_on(device)[self._row]
            self._views[device] = view
        return view

    def _text(self, msg: str) -> str:
        text = self._texts.get(msg)
        if text is None:
            text = f"{_ASSERT_PREFIX} [{self.name}]: {msg}"
            if len(self._texts) < 64:
                self._texts[msg] = text
        return text


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
    level = _level_override
    return (resolve_level() if level is None else level) != InvariantCheckLevel.OFF


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
# Count-path contexts since the last drain, for resolving which slots failed (no host read
# now; a drain resolves them, only for an invariant that fired). Two shapes:
#   (invariant, fails, slots, msg)   from `expect`;
#   (group, parts, covered)          from `note_failures`: it stands for one `expect` context
#                                    per group entry, of which the first `covered` were kept.
# `_pending_weight` counts the `expect`-shaped contexts they stand for, against `_MAX_PENDING`.
_pending_contexts: list[tuple] = []
_pending_weight = 0
_MAX_PENDING = 4096
_MAX_SLOTS_PER_FIRING = 64


def set_firing_sink(sink: Callable[[Firing], None] | None) -> None:
    """Register the callable that receives every `Firing` (None: firings are only returned)."""
    global _sink
    _sink = sink


def _emit(firing: Firing) -> None:
    if _sink is not None:
        _sink(firing)


def _failed_slots(fails: torch.Tensor, slots: torch.Tensor | None, limit: int = _MAX_SLOTS_PER_FIRING) -> list[int]:
    # Host read: only on the crash path or at a drain, where the engine syncs anyway.
    if slots is None or limit <= 0:
        return []
    flat = slots.reshape(-1)
    bad = flat[fails.reshape(-1)] if slots.numel() == fails.numel() else flat
    return [int(s) for s in bad[:limit].tolist()]


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
    global _pending_weight
    level = _level_override
    if level is None:
        level = resolve_level()
    if level and value.numel() > 0:  # (OFF is 0)
        if inv._crash_at[level]:
            _assert_or_raise(inv, value, msg, level, slots)
        else:
            fails = inv.prop.fails(value)
            count = torch.count_nonzero(fails) if fails.dtype == torch.bool else fails.sum()
            inv._counter(fails.device).add_(count)
            if (slots is not None or msg) and _pending_weight < _MAX_PENDING:
                _pending_contexts.append((inv, fails, slots, msg))
                _pending_weight += 1
    if inv.recover is not None:
        value = inv.recover(value)
    return value


def _assert_or_raise(
    inv: Invariant,
    value: torch.Tensor,
    msg: str,
    level: InvariantCheckLevel,
    slots: torch.Tensor | None,
) -> None:
    text = inv._text(msg)
    try:
        # Looked up at call time, so tests can patch torch._assert_async and read its predicate.
        torch._assert_async(inv.prop.all_ok(value), text)
    except RuntimeError as exc:
        if value.device.type != "cpu":
            # A device assert raised at its own launch (CUDA_LAUNCH_BLOCKING=1): the device
            # context is lost, nothing on it can be read back, but the firing is this check's.
            total = _drained_totals.get(inv.name, 0) + 1
            _drained_totals[inv.name] = total
            firing = Firing(name=inv.name, bucket=inv.bucket.name, level=level.name, site=inv.site,
                            msg=msg, new_hits=1, total_hits=total, crashed=True)
            _emit(firing)
            raise InvariantViolation(firing) from exc
        # Synchronous failure (CPU): we are dying anyway, so host reads are fine here.
        _flush_count_sources()
        # Whatever fired on the count path since the last drain goes on record before the
        # crash, so a crash never hides the firings that led to it (drops before a pool-bound
        # breach, idle ledgers before an admission stall).
        try:
            drain_firings()
        except RuntimeError:  # a device error already pending (CUDA): the crash still goes on record
            pass
        ok = inv.prop.ok(value)
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
            slots=tuple(_failed_slots(~ok, slots)),
        )
        _emit(firing)
        raise InvariantViolation(firing) from None


# --------------------------------------------------------------------------------------------
# Count groups: count-only invariants one call site reports together, counted in one op.


class CountGroup:
    """Invariants that one call site checks together on their count path only.

    Entry `i` is `(invariant, msg)`. A report of the group is equivalent to one
    `expect(invariant_i, ok_i, msg_i, slots=slots)` per entry, in entry order, under
    `override_level(WARN)` (so never a crash point: an invariant that would crash at WARN is
    refused), but its counts are added in one op and its context is one pending entry:

    - `add(counts, index)` adds `counts` into the counters `index` names, one `index_add_`; an
      index comes from `index(device, entries)`, built once by the caller;
    - `note_failures(group, parts)` records the report's context: per part a resolver that
      gives, at a drain and only if one of the group's invariants fired, each element's entry
      (or `len(group)` where it failed none), and the slots the elements are about.

    The caller may add the counts later than the report (batched over several reports), as long
    as every add happens before the counters are next read: register the caller as a count
    source (`register_count_source`), which every reader flushes first.
    """

    __slots__ = ("invariants", "msgs", "_entry_of", "_any_msg")

    def __init__(self, *entries: tuple[Invariant, str]) -> None:
        if not entries:
            raise ValueError("a CountGroup needs at least one (invariant, msg) entry")
        if len({inv for inv, _msg in entries}) != len(entries):
            raise ValueError("a CountGroup names each invariant once")
        for inv, _msg in entries:
            if inv._crash_at[InvariantCheckLevel.WARN]:
                raise ValueError(f"invariant {inv.name}: a {inv.bucket.name} check crashes at WARN, "
                                 "so it cannot be count-only")
        self.invariants = tuple(inv for inv, _msg in entries)
        self.msgs = tuple(msg for _inv, msg in entries)
        self._entry_of = {inv: i for i, inv in enumerate(self.invariants)}
        self._any_msg = any(self.msgs)

    def __len__(self) -> int:
        return len(self.invariants)

    def index(self, device: torch.device | str, entries: Sequence[int | None]) -> torch.Tensor:
        """An index for `add`: element `j` sends `counts[j]` to entry `entries[j]`'s counter, or
        nowhere where it is None (a row no reader sees)."""
        rows = [_PASS_ROW if entry is None else self.invariants[entry]._row for entry in entries]
        return torch.tensor(rows, dtype=torch.int64, device=device)

    def add(self, counts: torch.Tensor, index: torch.Tensor) -> None:
        """Add `counts` (int64, shaped like `index`) to the counters `index` names: one op, no
        sync. Ungated: the caller decided, when it checked, that these count."""
        _counters_on(counts.device).index_add_(0, index, counts)


def note_failures(
    group: CountGroup,
    parts: Sequence[tuple[Callable[[Any], torch.Tensor], Any, torch.Tensor | None]],
) -> None:
    """Record one report of `group` for the next drain: `parts` is `(resolve, data, slots)` per
    part, in order; `resolve(data)` gives each element's entry (`len(group)`: none failed).

    Equivalent, for the firings, to one `expect` per entry whose value and slots are the parts
    joined. Ungated, like `CountGroup.add`: the caller reports what it checked. Resolvers run
    at a drain only, so `data` must not change until then (a fresh tensor of the caller's);
    `parts` itself is kept (a tuple or a list the caller no longer touches).
    """
    global _pending_weight
    if not parts or (not group._any_msg and all(part[2] is None for part in parts)):
        return
    covered = len(group.invariants)
    if _pending_weight + covered > _MAX_PENDING:
        covered = _MAX_PENDING - _pending_weight
        if covered <= 0:
            return
    _pending_contexts.append((group, parts, covered))
    _pending_weight += covered


class CountSource(Protocol):
    def flush_counts(self) -> None: ...


_count_sources: weakref.WeakSet = weakref.WeakSet()


def register_count_source(source: CountSource) -> None:
    """Have every reader of the counters call `source.flush_counts()` first (held weakly).

    For a caller that adds a `CountGroup`'s counts later than its reports: the counts a reader
    sees are then exactly those of the reports made before it.
    """
    _count_sources.add(source)


def _flush_count_sources() -> None:
    for source in list(_count_sources):
        source.flush_counts()


# --------------------------------------------------------------------------------------------
# Reading the counters.


def hit_counts() -> dict[str, int]:
    """Total hits per registered invariant (a host read: call it where the engine syncs)."""
    _flush_count_sources()
    invariants = registered_invariants()
    counts = dict.fromkeys((inv.name for inv in invariants), 0)
    for counters in list(_counters.values()):
        values = counters.tolist()
        for inv in invariants:
            counts[inv.name] += values[inv._row]
    return counts


def _snapshot_order(device: torch.device) -> tuple[list[str], torch.Tensor]:
    global _order
    with _REGISTRY_LOCK:
        if _order is None:
            ranked = sorted(_ROWS, key=lambda inv: inv.name)
            _order = ([inv.name for inv in ranked], [inv._row for inv in ranked])
            _order_index.clear()
        names, rows = _order
        index = _order_index.get(device)
        if index is None:
            index = torch.tensor(rows, dtype=torch.int64, device=device)
            _order_index[device] = index
    return names, index


def counter_snapshot() -> tuple[list[str], torch.Tensor | None]:
    """Every counter copied into one device tensor (no host read), with the names in order.

    The names are the registered invariants sorted, once per device that has counters; a
    name's total is the sum of its entries. The engine concatenates the tensor with the step's
    sampled tokens, so that one device-to-host copy brings back both; `drain_firings(totals)`
    then needs no read of its own.
    """
    _flush_count_sources()
    names: list[str] = []
    parts = []
    for device, counters in list(_counters.items()):
        device_names, index = _snapshot_order(device)
        names.extend(device_names)
        parts.append(counters.index_select(0, index))
    if not parts:
        return names, None
    if len(parts) == 1:
        return names, parts[0]
    # Counters of host tensors beside a device's (a check over a CPU-side tensor on a CUDA
    # engine) join the device's snapshot: an async host-to-device copy, never a device sync.
    device = next((p.device for p in parts if p.device.type != "cpu"), parts[0].device)
    return names, torch.cat([p.to(device, non_blocking=True) for p in parts])


def _resolve_group(
    entry: tuple, inv: Invariant, resolved: dict[int, list[torch.Tensor]]
) -> tuple[bool, list[int]] | None:
    """Whether a `note_failures` context failed `inv`, and its failing slots; None: not covered."""
    group, parts, covered = entry
    position = group._entry_of.get(inv)
    if position is None or position >= covered:
        return None
    codes = resolved.get(id(entry))
    if codes is None:
        codes = [resolve(data) for resolve, data, _slots in parts]
        resolved[id(entry)] = codes
    bad: list[int] = []
    failed = False
    for part_codes, (_resolve, _data, slots) in zip(codes, parts, strict=True):
        fails = part_codes == position
        if slots is None:
            failed = failed or bool(fails.any())
        else:
            bad.extend(_failed_slots(fails, slots, _MAX_SLOTS_PER_FIRING - len(bad)))
    return failed or bool(bad), bad


def drain_firings(totals: dict[str, int] | None = None) -> list[Firing]:
    """Turn each counter increase since the last drain into a `Firing`.

    Args:
        totals: host copies of the counters (from `counter_snapshot`, read back by the caller).
            None reads every counter here: a host read, for idle ticks and tests.

    Each firing goes to the sink and is returned. Resolving which slots failed reads the device,
    but only for an invariant that fired.
    """
    global _pending_weight
    level = resolve_level()
    pending = list(_pending_contexts)
    _pending_contexts.clear()
    _pending_weight = 0
    firings = []
    resolved: dict[int, list[torch.Tensor]] = {}
    for name, total in (hit_counts() if totals is None else totals).items():
        previous = _drained_totals.get(name, 0)
        if total <= previous:
            continue
        _drained_totals[name] = total
        inv = _REGISTRY[name]
        slots: list[int] = []
        msgs: list[str] = []
        for entry in pending:
            if len(entry) == 4:
                pending_inv, fails, pending_slots, msg = entry
                if pending_inv is not inv:
                    continue
                bad = _failed_slots(fails, pending_slots)
                failed = bool(bad) if pending_slots is not None else bool(fails.any())
            else:
                outcome = _resolve_group(entry, inv, resolved)
                if outcome is None:
                    continue
                failed, bad = outcome
                msg = entry[0].msgs[entry[0]._entry_of[inv]]
            slots.extend(bad)
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
    global _pending_weight
    _flush_count_sources()  # counts a source still owes belong to the run being forgotten
    for counters in _counters.values():
        counters.zero_()
    _drained_totals.clear()
    _pending_contexts.clear()
    _pending_weight = 0
