"""Reachability: every damaged location is followed until something reads it or it dies unread.

Each `Damage` of a landing becomes one or more *locations* (a req_to_token entry, a mapping entry,
a KV row of a pool, a pool's accounting, a free-list entry, a request's frontier or its next
input token). The scheduler reports what it reads and what it overwrites or frees; the first read
of a location consumes its damage (`perturbation_consumed`: step and by what), and a damage all of
whose locations were killed first died unread (`perturbation_died`); a landing's damage of one kind
resolved at once is one event, with its `count`. What nothing read by the
time the engine stops died then. A scenario none of whose damage was consumed could not have been
detected: it is NOT_REACHED, not MISSED.

Readers: a forward (full layers read every position below seq_len, SWA layers the window before
each query: `q - window < key_pos <= q`, through the mapping), the KV canary (HEAD: positions and
chains, TAIL and SWEEP also the KV bytes), window eviction and release (they read req_to_token
rows and the frontier), `free_swa` (the mapping), `free_full` (the free list, and its guard the
mapping), the radix cache's tombstone recovery (the mapping), the idle check (pool accounting
and the held slots' mapping). Killers: a forward's KV writes, frees (a freed row's bytes are
garbage), an allocation re-pairing a slot, a row handed to a new request, a request finishing
(its next input token is never fed).

It exists only with a scenario loaded (the perturber owns it): without one the scheduler holds
no tracker and calls nothing. Observations read tensors back to the host (only in perturbed runs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine_stub.perturb.contract import Damage

__all__ = ["ReachTracker", "TrackingAllocator", "locations_of"]

Location = tuple


def locations_of(damage: Damage) -> tuple[Location, ...]:
    """The locations whose first read consumes `damage` (empty: consumed at once)."""
    kind = damage.kind
    if kind == "req_to_token":
        return (("table", damage.row, damage.position),)
    if kind == "mapping":
        return (("mapping", damage.slot),)
    if kind == "kv_bytes":
        return (("kv", damage.pool, damage.pool_row),)
    if kind == "free_list":
        if damage.detail == "freed_twice":
            return (("free", damage.pool, damage.slot),)
        if damage.detail == "freed_in_window":
            # The position lost its SWA peer: consumed when a reader goes through the mapping
            # for it (not by the free that did the damage).
            return (("swa_read", damage.slot),)
        # kept: the slots stay taken; accounting reads it (and for SWA peers, the mapping)
        extra = (("mapping", damage.slot),) if damage.pool == "swa" and damage.slot else ()
        return (("count", damage.pool), *extra)
    if kind == "frontier":
        return (("frontier", damage.request),)
    if kind == "sampled_token":
        return (("token", damage.request, damage.position),)
    if kind == "radix_node":
        # The tree says live where the mapping says released: whoever reads the mapping.
        return (("mapping", damage.slot),)
    return ()  # a switch: the code it flips runs at once


@dataclass
class _Tracked:
    index: int
    landing: int
    number: int  # its place in the landing's damage list
    kind: str
    locations: frozenset
    killed: set = field(default_factory=set)


def _ints(values: Any) -> list[int]:
    if isinstance(values, torch.Tensor):
        return [int(v) for v in values.reshape(-1).tolist()]
    return [int(v) for v in values]


def _first_index(wanted: list[int], values: list[int]) -> dict[int, int]:
    """{each wanted value found in `values`: the index of its first occurrence}."""
    if not wanted:
        return {}
    want = set(wanted)
    first: dict[int, int] = {}
    if len(want) <= 8:  # a few: list.index scans in C
        for v in want:
            try:
                first[v] = values.index(v)
            except ValueError:
                pass
        return first
    for i, v in enumerate(values):
        if v in want and v not in first:
            first[v] = i
    return first


class ReachTracker:
    """Follows the damage of one engine's landings.

    Args:
        write: the event sink, `write(kind, **fields)` (the engine's event log).
    """

    def __init__(self, write: Callable[..., None]) -> None:
        self._write = write
        self._tracked: dict[int, _Tracked] = {}
        self._by_location: dict[Location, set[int]] = {}
        self._next = 0
        self.window = 0
        self.page_size = 1
        self.has_full_layers = True
        self.has_swa_layers = True
        self.canary = False

    def configure(self, *, window: int, page_size: int, layer_pattern: str, canary: bool) -> None:
        self.window, self.page_size = window, page_size
        self.has_full_layers, self.has_swa_layers = "F" in layer_pattern, "S" in layer_pattern
        self.canary = canary

    @property
    def open(self) -> bool:
        """Whether any damage is still unresolved (observations cost nothing otherwise)."""
        return bool(self._tracked)

    def _wanted(self, tag: str) -> bool:
        return any(loc[0] == tag for loc in self._by_location)

    # ---- bookkeeping ---------------------------------------------------------------------------

    def track(self, index: int, landing: int, damage: Sequence[Damage]) -> None:
        at_once: list[_Tracked] = []
        for number, d in enumerate(damage):
            locations = locations_of(d)
            if not locations:
                at_once.append(_Tracked(index, landing, number, d.kind, frozenset()))
                continue
            key = self._next
            self._next += 1
            self._tracked[key] = _Tracked(index, landing, number, d.kind, frozenset(locations))
            for loc in locations:
                self._by_location.setdefault(loc, set()).add(key)
        self._emit("perturbation_consumed", at_once, "the landing itself")

    def _emit(self, event: str, items: list[_Tracked], by: str) -> None:
        """One event per (perturbation, landing, damage kind) among `items`, resolved together by
        `by`: `damage` is the first one's place in its landing's list, `count` (when above 1) how
        many. A pool read whole resolves a landing's every slot at once; an event each made a
        never-evict run on SGLang's server write 55,000 of them."""
        groups: dict[tuple[int, int, str], list[_Tracked]] = {}
        for item in items:
            groups.setdefault((item.index, item.landing, item.kind), []).append(item)
        for (index, landing, kind), group in groups.items():
            counted = {"count": len(group)} if len(group) > 1 else {}
            self._write(event, index=index, landing=landing, damage=group[0].number, damage_kind=kind, by=by,
                        **counted)

    def _forget(self, key: int) -> _Tracked:
        item = self._tracked.pop(key)
        for loc in item.locations:
            keys = self._by_location.get(loc)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_location[loc]
        return item

    def read(self, locations: Iterable[Location], by: str) -> None:
        """The first read of a tracked location consumes its damage."""
        consumed = [self._forget(key) for loc in locations for key in sorted(self._by_location.get(loc, ()))]
        self._emit("perturbation_consumed", consumed, by)

    def kill(self, locations: Iterable[Location], by: str) -> None:
        """Overwritten or freed before any read: a damage dies once all its locations have."""
        died: list[_Tracked] = []
        for loc in locations:
            for key in sorted(self._by_location.get(loc, ())):
                item = self._tracked[key]
                item.killed.add(loc)
                if item.killed >= item.locations:
                    died.append(self._forget(key))
        self._emit("perturbation_died", died, by)

    def read_tagged(self, tags: Iterable[str], by: str) -> None:
        """A reader of whole structures (a census of the pools, the free lists, the mapping):
        every tracked location whose tag is in `tags` is read."""
        wanted = set(tags)
        if self._tracked:
            self.read([loc for loc in self._by_location if loc[0] in wanted], by)

    def close(self, by: str = "the engine stopped before anything read it") -> None:
        self._emit("perturbation_died", [self._forget(key) for key in sorted(self._tracked)], by)

    # ---- observations ----------------------------------------------------------------------------

    def _rows_in(self, pool: str, rows: Iterable[int]) -> list[Location]:
        return [("kv", pool, r) for r in rows]

    def batch(self, phase: str, rows: Sequence[int], prefix_lens: Sequence[int], seq_lens: Sequence[int],
              table: torch.Tensor, mapping: torch.Tensor, rids: Sequence[str],
              out_slots: torch.Tensor | None = None) -> None:
        """A batch's reads: `phase` head (the canary before the forward), forward (its writes
        first, then its reads) or tail (the canary after it)."""
        if not self._tracked:
            return
        window, canary = self.window, self.canary
        if phase == "forward" and out_slots is not None:
            slots = _ints(out_slots)
            killed = self._rows_in("full", slots) + self._rows_in("swa", _ints(mapping[out_slots.to(torch.int64)]))
            self.kill(killed, "overwritten by a forward's KV write")
        if phase in ("head", "tail") and not canary:
            return
        by = {"head": "the KV canary (HEAD)", "forward": "a forward", "tail": "the KV canary (TAIL)"}[phase]
        # What the batch reads is every position of its rows; what is tracked is a few locations:
        # each tracked location is looked up in the rows' slots (a step with damage open costs
        # about what one without does), and read in the order a walk of the rows would meet it.
        tracked: dict[str, list[Location]] = {}
        for loc in self._by_location:
            tracked.setdefault(loc[0], []).append(loc)
        for row, rid, lo_new, seq in zip(rows, rids, prefix_lens, seq_lens, strict=True):
            upto = lo_new if phase == "head" else seq
            # Full group: every position below `upto`; SWA group: the window the reader covers.
            if phase == "forward":
                full_lo = 0 if self.has_full_layers else upto
                swa_lo = max(0, lo_new - window + 1) if self.has_swa_layers else upto
            else:
                full_lo, swa_lo = 0, max(0, upto - window)
            lo = min(full_lo, swa_lo)
            reads: list[Location] = sorted((loc for loc in tracked.get("table", ()) if loc[1] == row
                                            and lo <= loc[2] < upto), key=lambda loc: loc[2])
            if phase == "forward":
                reads.append(("token", rid, lo_new))
            kv = tracked.get("kv", ()) if phase != "head" else ()  # HEAD checks chains, not KV bytes
            peers = tracked.get("mapping", []) + tracked.get("swa_read", [])
            swa_slots = _ints(table[row, swa_lo:upto]) if swa_lo < upto and (kv or peers) else []
            if kv:
                full_slots = _ints(table[row, full_lo:upto]) if full_lo < upto else []
                swa_rows = (_ints(mapping[torch.tensor(swa_slots, dtype=torch.int64)]) if swa_slots else [])
                for pool, slots in (("full", full_slots), ("swa", swa_rows)):
                    first = _first_index([loc[2] for loc in kv if loc[1] == pool], slots)
                    reads += [("kv", pool, r) for r in sorted(first, key=first.__getitem__)]
            if peers:
                first = _first_index([loc[1] for loc in peers], swa_slots)
                reads += [loc for s in sorted(first, key=first.__getitem__) for loc in (("mapping", s), ("swa_read", s))]
            self.read(reads, by)

    def sweep(self, paths: Sequence[Any], mapping: torch.Tensor) -> None:
        if not self._tracked:
            return
        reads: list[Location] = []
        for path in paths:
            slots = _ints(path.slots)
            live = [s for s, ok in zip(slots, _ints(path.swa_live), strict=True) if ok]
            reads += self._rows_in("full", slots) + [loc for s in live for loc in (("mapping", s), ("swa_read", s))]
            if live:
                reads += self._rows_in("swa", _ints(mapping[torch.tensor(live, dtype=torch.int64)]))
        self.read(reads, "the KV canary (SWEEP)")

    def table_read(self, row: int, rid: str, lo: int, hi: int, by: str) -> None:
        if self._tracked:
            self.read([("table", row, p) for p in range(lo, hi)] + [("frontier", rid)], by)

    def table_written(self, row: int, lo: int, hi: int, by: str = "its row was handed to a new request") -> None:
        if self._tracked:
            self.kill([("table", row, p) for p in range(lo, hi)], by)

    def finished(self, rid: str) -> None:
        # A token still unfed at the finish is the request's last: the answer carries it to the
        # client, and the KV canary checks it there (write_token, phase FINISH).
        if self._tracked and self._wanted("token"):
            self.read([loc for loc in self._by_location if loc[0] == "token" and loc[1] == rid],
                      "the answer (its last token, checked at the finish)")

    def idle(self, held_slots: Sequence[int]) -> None:
        if self._tracked:
            self.read([("count", "full"), ("count", "swa")] + [("mapping", s) for s in held_slots],
                      "the idle check")


# SGLang 0.5.23's kv-row segment frees (its window eviction, a request's release, the tree's) and
# the sides each frees: wrapped only where the allocator has them (SGLang's tree asks `hasattr`).
_SEGMENT_FREES = {"free_segment": ("swa", "full"), "free_swa_segment": ("swa",), "free_full_segment": ("full",)}


class TrackingAllocator:
    """The scheduler's allocator, reporting to a `ReachTracker` what each call reads, frees and
    re-pairs; everything else is the allocator's own (attributes included)."""

    def __init__(self, inner: Any, tracker: ReachTracker) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_tracker", tracker)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)  # an allocator without it: AttributeError, as unwrapped
        sides = _SEGMENT_FREES.get(name)
        if sides is None:
            return value

        def segment_free(free_index: torch.Tensor, *, start_pos: int) -> None:
            if "swa" in sides:
                self._before_free_swa(free_index, f"{name} (its SWA side)" if len(sides) > 1 else name)
            if "full" in sides:
                self._before_free_full(free_index, f"{name} (its full side)" if len(sides) > 1 else name)
            value(free_index, start_pos=start_pos)

        return segment_free

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)

    def _pages(self, slots: torch.Tensor) -> list[int]:
        page = self._inner.page_size
        ids = _ints(slots)
        if page == 1:
            return ids
        return sorted({p // page * page + k for p in ids for k in range(page)})

    def _swa_rows(self, slots: list[int]) -> list[int]:
        if not slots:
            return []
        return _ints(self._inner.full_to_swa_index_mapping[torch.tensor(slots, dtype=torch.int64)])

    def _before_free_swa(self, slots: torch.Tensor, by: str) -> None:
        tracker = self._tracker
        if tracker.open and slots.numel():
            full = self._pages(slots)
            rows = [r for r in self._swa_rows(full) if r > 0]
            tracker.read([("mapping", s) for s in full] + [("free", "swa", s) for s in full], by)
            tracker.kill([("kv", "swa", r) for r in rows] + [("mapping", s) for s in full],
                         "its SWA row was freed")

    def _before_free_full(self, slots: torch.Tensor, by: str) -> None:
        tracker = self._tracker
        if tracker.open and slots.numel():
            full = _ints(slots)
            tracker.read([("mapping", s) for s in full] + [("free", "full", s) for s in full], by)
            tracker.kill([("kv", "full", s) for s in full] + [("swa_read", s) for s in full],
                         "its full slot was freed")

    def _allocated(self, full: torch.Tensor | None) -> torch.Tensor | None:
        tracker = self._tracker
        if tracker.open and full is not None and full.numel():
            slots = _ints(full)
            tracker.kill([("mapping", s) for s in slots] + [("kv", "full", s) for s in slots]
                         + [("swa_read", s) for s in slots]
                         + [("kv", "swa", r) for r in self._swa_rows(slots)], "reallocated")
        return full

    def free(self, free_index: torch.Tensor) -> None:
        self._before_free_swa(free_index, "free (its SWA side)")
        self._before_free_full(free_index, "free (its full side)")
        self._inner.free(free_index)

    def free_swa(self, free_index: torch.Tensor) -> None:
        self._before_free_swa(free_index, "free_swa")
        self._inner.free_swa(free_index)

    def free_full(self, free_index: torch.Tensor) -> None:
        self._before_free_full(free_index, "free_full")
        self._inner.free_full(free_index)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        return self._allocated(self._inner.alloc(need_size))

    def alloc_extend(self, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        return self._allocated(self._inner.alloc_extend(*args, **kwargs))

    def alloc_decode(self, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        return self._allocated(self._inner.alloc_decode(*args, **kwargs))

    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
        if self._tracker.open:
            self._tracker.read([("mapping", s) for s in _ints(kv_indices)], "the radix cache")
        return self._inner.translate_loc_from_full_to_swa(kv_indices)

    def set_full_to_swa_mapping(self, full_indices: torch.Tensor, swa_indices: torch.Tensor) -> None:
        if self._tracker.open:
            self._tracker.kill([("mapping", s) for s in _ints(full_indices)], "re-paired")
        self._inner.set_full_to_swa_mapping(full_indices, swa_indices)

    def clear_full_to_swa_mapping(self, full_indices: torch.Tensor) -> None:
        if self._tracker.open:
            self._tracker.kill([("mapping", s) for s in _ints(full_indices)], "cleared")
        self._inner.clear_full_to_swa_mapping(full_indices)
