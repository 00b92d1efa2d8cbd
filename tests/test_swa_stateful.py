"""Random legal call sequences against SWATokenToKVPoolAllocator, checked against a plain model.

Each machine runs at WARN so that any contract firing on a legal sequence is seen, and holds
one rule that double-frees on purpose: the drop must be counted and the slot never recycled.

The model keeps both free lists in order, with SGLang's `need_sort=False` semantics (the
engine's): a page_size 1 free joins the list's tail, a paged free puts its pages (sorted, once
each) at the head, and every alloc takes the head. So each alloc's exact ids are predicted, and a
freed slot comes back exactly when SGLang would hand it out again.
"""

from __future__ import annotations

from contextlib import ExitStack

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine_stub.invariants import hit_counts, override_level
from engine_stub.mem import SWATokenToKVPoolAllocator

SETTINGS = settings(max_examples=60, stateful_step_count=30, deadline=None)
CONTRACTS = (
    "swa.peer_mapped",
    "swa.peer_released",
    "alloc.pool_bound",
    "alloc.out_of_pool",
    "alloc.reserved_slot",
)


def _ids(slots: list[int]) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.int64)


def _allocated_pages(bitmap: torch.Tensor) -> set[int]:
    return set(bitmap.nonzero().flatten().tolist())


class _AllocatorMachine(RuleBasedStateMachine):
    """Shared set-up: a WARN-level allocator and the firing baseline it started from."""

    SIZE = SIZE_SWA = PAGE_SIZE = 0

    def __init__(self) -> None:
        super().__init__()
        self._stack = ExitStack()
        self._stack.enter_context(override_level("warn"))
        self.allocator = SWATokenToKVPoolAllocator(self.SIZE, self.SIZE_SWA, self.PAGE_SIZE)
        self.double_frees = 0
        self.baseline = hit_counts()

    def teardown(self) -> None:
        self._stack.close()

    def _double_free_full(self, slot: int) -> None:
        """Free a full slot whose page is already free, then fold staged frees (the idle tick)."""
        drops = self.allocator.drop_counts()["full"]["double_free"]
        self.allocator.free_full(_ids([slot]))
        self.double_frees += 1
        assert self.allocator.drop_counts()["full"]["double_free"] == drops + 1
        self.allocator.merge_and_sort_free()

    @invariant()
    def only_the_planted_double_frees_fired(self) -> None:
        counts = hit_counts()
        for name in CONTRACTS:
            assert counts[name] == self.baseline[name], name
        assert counts["alloc.double_free"] == self.baseline["alloc.double_free"] + self.double_frees
        assert self.allocator.drop_counts()["swa"] == {
            "double_free": 0,
            "out_of_pool": 0,
            "reserved": 0,
        }


class SWAPage1Machine(_AllocatorMachine):
    """page_size 1: slots are allocated, window-evicted, freed and grouped at random."""

    SIZE, SIZE_SWA, PAGE_SIZE = 24, 12, 1

    def __init__(self) -> None:
        super().__init__()
        self.peers: dict[int, int] = {}  # held full slot -> its SWA peer, 0 once released
        self.freed: set[int] = set()  # full slots handed out before and free now
        self.full_list = list(range(1, self.SIZE + 1))  # the free lists, next handed out first
        self.swa_list = list(range(1, self.SIZE_SWA + 1))

    def _live(self) -> list[int]:
        return sorted(s for s, peer in self.peers.items() if peer)

    def _released(self) -> list[int]:
        return sorted(s for s, peer in self.peers.items() if not peer)

    def _pick(self, data: st.DataObject, slots: list[int]) -> list[int]:
        return data.draw(st.lists(st.sampled_from(slots), min_size=1, max_size=6, unique=True))

    @rule(n=st.integers(1, 6))
    def alloc(self, n: int) -> None:
        live_peers = set(self.peers.values()) - {0}
        fits = n <= self.SIZE - len(self.peers) and n <= self.SIZE_SWA - len(live_peers)
        out = self.allocator.alloc(n)
        if not fits:
            assert out is None
            return
        assert out is not None
        slots = out.tolist()
        peers = self.allocator.translate_loc_from_full_to_swa(out).tolist()
        assert len(set(slots)) == n and not set(slots) & self.peers.keys()
        assert len(set(peers)) == n and min(peers) > 0 and not set(peers) & live_peers
        assert (slots, peers) == (self.full_list[:n], self.swa_list[:n])
        del self.full_list[:n], self.swa_list[:n]
        self.peers.update(zip(slots, peers, strict=True))
        self.freed -= set(slots)

    @rule()
    def read_back(self) -> None:
        """The step's read-back of the drop counters: a clean one marks the free lists verified."""
        self.allocator.note_drop_totals(self.allocator.drop_counter().tolist())

    @precondition(lambda self: any(self.peers.values()))
    @rule(data=st.data())
    def free_swa(self, data: st.DataObject) -> None:
        slots = self._pick(data, self._live())
        self.allocator.free_swa(_ids(slots))
        self.swa_list += [self.peers[s] for s in slots]
        self.peers.update(dict.fromkeys(slots, 0))

    @precondition(lambda self: not all(self.peers.values()))
    @rule(data=st.data())
    def free_full(self, data: st.DataObject) -> None:
        slots = self._pick(data, self._released())
        self.allocator.free_full(_ids(slots))
        self.full_list += slots
        self._forget(slots)

    @precondition(lambda self: any(self.peers.values()))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        slots = self._pick(data, self._live())
        self.allocator.free(_ids(slots))
        self.swa_list += [self.peers[s] for s in slots]
        self.full_list += slots
        self._forget(slots)

    @precondition(lambda self: self.peers)
    @rule(data=st.data())
    def free_group(self, data: st.DataObject) -> None:
        # Every held slot gets a legal fate; the calls run in a random order inside one group,
        # except that a slot's free_full follows its own free_swa.
        live, released = self._live(), self._released()
        fates = {
            s: data.draw(st.sampled_from(["keep", "free_swa", "free", "free_swa+free_full"]))
            for s in live
        }
        fates.update({s: data.draw(st.sampled_from(["keep", "free_full"])) for s in released})
        first = [
            ("free_swa", [s for s, f in fates.items() if f in ("free_swa", "free_swa+free_full")]),
            ("free", [s for s, f in fates.items() if f == "free"]),
            ("free_full", [s for s, f in fates.items() if f == "free_full"]),
        ]
        calls = data.draw(st.permutations(first))
        calls.append(("free_full", [s for s, f in fates.items() if f == "free_swa+free_full"]))
        sizes = self.allocator.full_available_size(), self.allocator.swa_available_size()
        self.allocator.free_group_begin()
        swa_group, full_group = [], []
        for op, slots in calls:
            getattr(self.allocator, op)(_ids(slots))
            if op in ("free_swa", "free"):
                swa_group += [self.peers[s] for s in slots]
            if op in ("free_full", "free"):
                full_group += slots
        # Both sides defer to the group end; the mapping is cleared at enqueue.
        assert (self.allocator.full_available_size(), self.allocator.swa_available_size()) == sizes
        gone = [s for s, f in fates.items() if f in ("free_swa", "free", "free_swa+free_full")]
        assert self.allocator.translate_loc_from_full_to_swa(_ids(gone)).tolist() == [0] * len(gone)
        self.allocator.free_group_end()
        # The group end releases the SWA ids, then the full ids, each in enqueue order.
        self.swa_list += swa_group
        self.full_list += full_group
        self.peers.update(dict.fromkeys(gone, 0))
        self._forget(
            [s for s, f in fates.items() if f in ("free", "free_full", "free_swa+free_full")]
        )

    @precondition(lambda self: self.freed)
    @rule(data=st.data())
    def double_free_full(self, data: st.DataObject) -> None:
        self._double_free_full(data.draw(st.sampled_from(sorted(self.freed))))

    def _forget(self, slots: list[int]) -> None:
        for slot in slots:
            del self.peers[slot]
        self.freed |= set(slots)

    @invariant()
    def sizes_add_up(self) -> None:
        live = self._live()
        assert self.allocator.full_available_size() + len(self.peers) == self.SIZE
        assert self.allocator.swa_available_size() + len(live) == self.SIZE_SWA

    @invariant()
    def no_slot_is_held_twice(self) -> None:
        live = self._live()
        held = sorted(self.peers)
        assert self.allocator.translate_loc_from_full_to_swa(_ids(held)).tolist() == [
            self.peers[s] for s in held
        ]
        live_peers = [self.peers[s] for s in live]
        assert len(set(live_peers)) == len(live_peers)
        assert _allocated_pages(self.allocator.full_attn_allocator.page_allocated) == set(held)
        assert _allocated_pages(self.allocator.swa_attn_allocator.page_allocated) == set(live_peers)


class _Request:
    """One request: FULL slot and SWA peer per position, and how many SWA pages slid out."""

    def __init__(self, slots: list[int], peers: list[int]) -> None:
        self.slots = slots
        self.peers = peers
        self.evicted_pages = 0


class SWAPage4Machine(_AllocatorMachine):
    """page_size 4: requests extend, decode, slide their window and finish, alone or in groups."""

    SIZE, SIZE_SWA, PAGE_SIZE = 48, 24, 4

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[_Request] = []
        self.freed_pages: set[int] = set()  # full pages handed out before and free now
        page = self.PAGE_SIZE
        self.full_list = list(range(1, self.SIZE // page + 1))  # free pages, next handed out first
        self.swa_list = list(range(1, self.SIZE_SWA // page + 1))

    def _give_back(self, free_list: list[int], pages: set[int]) -> None:
        """A paged free: its pages, sorted and once each, go to the head of the free list."""
        free_list[:0] = sorted(pages)

    def _pages(self, slots: list[int]) -> set[int]:
        return {s // self.PAGE_SIZE for s in slots}

    def _held_full_pages(self) -> set[int]:
        return set().union(*(self._pages(r.slots) for r in self.requests))

    def _live_swa_pages(self) -> set[int]:
        page = self.PAGE_SIZE
        return set().union(*(self._pages(r.peers[r.evicted_pages * page :]) for r in self.requests))

    def _grow(self, request: _Request | None, new_tokens: int, decode: bool) -> None:
        page = self.PAGE_SIZE
        prefix = len(request.slots) if request else 0
        seq = prefix + new_tokens
        need = -(-seq // page) - -(-prefix // page)
        held, live = self._held_full_pages(), self._live_swa_pages()
        fits = need <= self.SIZE // page - len(held) and need <= self.SIZE_SWA // page - len(live)
        last_loc = _ids([request.slots[-1] if request else -1])
        if decode:
            out = self.allocator.alloc_decode([seq], last_loc)
        else:
            out = self.allocator.alloc_extend([prefix], [seq], last_loc, new_tokens)
        if not fits:
            assert out is None
            return
        assert out is not None and out.numel() == new_tokens
        slots = out.tolist()
        peers = self.allocator.translate_loc_from_full_to_swa(out).tolist()
        assert min(peers) > 0
        # Positions left in the prefix's last page continue it, on both sides; the rest take
        # pages nobody holds.
        cut = min(-(-prefix // page) * page - prefix, new_tokens)
        if request is not None:
            assert self._pages(slots[:cut]) <= {request.slots[-1] // page}
            assert self._pages(peers[:cut]) <= {request.peers[-1] // page}
        assert not self._pages(slots[cut:]) & held
        assert not self._pages(peers[cut:]) & live
        # New pages come off the heads of the free lists, in order.
        page = self.PAGE_SIZE
        drawn = list(dict.fromkeys(s // page for s in slots[cut:]))
        drawn_swa = list(dict.fromkeys(s // page for s in peers[cut:]))
        assert (drawn, drawn_swa) == (self.full_list[:need], self.swa_list[:need])
        del self.full_list[:need], self.swa_list[:need]
        if request is None:
            self.requests.append(_Request(slots, peers))
        else:
            request.slots += slots
            request.peers += peers
        self.freed_pages -= self._pages(slots)

    @rule(length=st.integers(1, 10))
    def new_request(self, length: int) -> None:
        self._grow(None, length, decode=False)

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), new_tokens=st.integers(1, 6))
    def extend(self, data: st.DataObject, new_tokens: int) -> None:
        self._grow(data.draw(st.sampled_from(self.requests)), new_tokens, decode=False)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        self._grow(data.draw(st.sampled_from(self.requests)), 1, decode=True)

    @precondition(lambda self: any(self._evictable(r) for r in self.requests))
    @rule(data=st.data())
    def slide_window(self, data: st.DataObject) -> None:
        # free_swa of one slot per page releases the whole page; the last page stays, since
        # the next extend continues it through the mapping.
        request = data.draw(st.sampled_from([r for r in self.requests if self._evictable(r)]))
        upto = data.draw(st.integers(request.evicted_pages + 1, self._last_page(request)))
        page = self.PAGE_SIZE
        slots = [
            request.slots[p * page + data.draw(st.integers(0, page - 1))]
            for p in range(request.evicted_pages, upto)
        ]
        self.allocator.free_swa(_ids(slots))
        self._give_back(self.swa_list, self._pages(request.peers[request.evicted_pages * page : upto * page]))
        request.evicted_pages = upto

    def _last_page(self, request: _Request) -> int:
        return (len(request.slots) - 1) // self.PAGE_SIZE

    def _evictable(self, request: _Request) -> bool:
        return request.evicted_pages < self._last_page(request)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.requests))
        self.allocator.free(_ids(request.slots))
        self._give_back(self.swa_list, self._live_pages_of(request))
        self._give_back(self.full_list, self._pages(request.slots))
        self._forget([request])

    def _live_pages_of(self, request: _Request) -> set[int]:
        return self._pages(request.peers[request.evicted_pages * self.PAGE_SIZE :])

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish_in_group(self, data: st.DataObject) -> None:
        done = data.draw(st.lists(st.sampled_from(self.requests), min_size=1, unique_by=id))
        self.allocator.free_group_begin()
        for request in done:
            if data.draw(st.booleans()):
                self.allocator.free(_ids(request.slots))
            else:
                self.allocator.free_swa(_ids(request.slots))
                self.allocator.free_full(_ids(request.slots))
        self.allocator.free_group_end()
        # One release per side at the group end: all the group's pages, sorted, at the head.
        self._give_back(self.swa_list, set().union(*(self._live_pages_of(r) for r in done)))
        self._give_back(self.full_list, set().union(*(self._pages(r.slots) for r in done)))
        self._forget(done)

    @precondition(lambda self: self.freed_pages)
    @rule(data=st.data())
    def double_free_full(self, data: st.DataObject) -> None:
        page = data.draw(st.sampled_from(sorted(self.freed_pages)))
        self._double_free_full(
            page * self.PAGE_SIZE + data.draw(st.integers(0, self.PAGE_SIZE - 1))
        )

    def _forget(self, done: list[_Request]) -> None:
        for request in done:
            self.requests.remove(request)
            self.freed_pages |= self._pages(request.slots)

    @invariant()
    def sizes_add_up(self) -> None:
        page = self.PAGE_SIZE
        assert (
            self.allocator.full_available_size() + page * len(self._held_full_pages()) == self.SIZE
        )
        assert (
            self.allocator.swa_available_size() + page * len(self._live_swa_pages())
            == self.SIZE_SWA
        )

    @invariant()
    def no_page_is_held_twice(self) -> None:
        page = self.PAGE_SIZE
        full_pages = [self._pages(r.slots) for r in self.requests]
        assert sum(map(len, full_pages)) == len(self._held_full_pages())
        swa_pages = [self._pages(r.peers[r.evicted_pages * page :]) for r in self.requests]
        assert sum(map(len, swa_pages)) == len(self._live_swa_pages())
        assert (
            _allocated_pages(self.allocator.full_attn_allocator.page_allocated)
            == self._held_full_pages()
        )
        assert (
            _allocated_pages(self.allocator.swa_attn_allocator.page_allocated)
            == self._live_swa_pages()
        )
        for request in self.requests:
            kept = request.evicted_pages * page
            mapped = self.allocator.translate_loc_from_full_to_swa(_ids(request.slots)).tolist()
            assert mapped == [0] * kept + request.peers[kept:]


SWAPage1Machine.TestCase.settings = SETTINGS
SWAPage4Machine.TestCase.settings = SETTINGS
TestSWAPage1 = SWAPage1Machine.TestCase
TestSWAPage4 = SWAPage4Machine.TestCase
