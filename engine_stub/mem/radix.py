"""A prefix cache over FULL slots with SWA tombstones (SGLang's `SWARadixCache`, simplified).

Each node holds the FULL slots of a run of tokens; a node's SWA KV lives behind the allocator's
mapping. A *tombstone* node has had its SWA KV freed (mapping 0) and keeps only its full KV.
Invariants kept here and checked by `sanity_check`:

- keys and values are page-aligned and of equal length; a leaf is never a tombstone;
- `full_lock_ref >= swa_lock_ref`; the root is never locked, freed or evicted;
- a live node's slots are mapped, a tombstone's are not; no slot is held twice;
- every node is on the full LRU list, every live node on the SWA LRU list, in recency order.

Eviction order is SGLang's: two LRU lists (full, SWA), and a touched path is ordered so that a
child is more recent than its parent. Under SWA pressure the oldest prefixes are tombstoned
first and the leaves (the last window of a cached sequence, the part a future match needs live)
are kept; the full phase deletes the least recently used unlocked leaves. `last_access` is a
logical clock stamped in full-list order, so eviction is deterministic across runs.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from engine_stub.mem.swa import SWATokenToKVPoolAllocator

__all__ = ["CachedPath", "LRUList", "LockHandle", "MatchResult", "SWARadixCache", "TreeNode",
           "UnfinishedResult"]

_node_ids = itertools.count()


@dataclass(eq=False)
class TreeNode:
    """One run of tokens and its FULL slots. Children are keyed by their first page."""

    key: list[int] = field(default_factory=list)
    value: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    parent: TreeNode | None = None
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict)
    full_lock_ref: int = 0
    swa_lock_ref: int = 0
    swa_tombstone: bool = False
    last_access: int = 0
    id: int = field(default_factory=lambda: next(_node_ids))

    @property
    def is_leaf(self) -> bool:
        return not self.children


@dataclass(frozen=True)
class MatchResult:
    slots: torch.Tensor  # int64 FULL slots of the accepted prefix
    last_node: TreeNode
    matched_len: int


@dataclass
class LockHandle:
    """What `inc_lock_ref` locked, so that `dec_lock_ref` undoes exactly that.

    The SWA lock is recorded as a token count, not a node list: a later split of a locked node
    copies its lock counts into the new parent, so the locked token range (and its length) stays
    the same while the nodes covering it change.
    """

    node: TreeNode
    swa_locked_tokens: int
    released: bool = False
    swa_released: bool = False  # `dec_swa_lock_only` gave the SWA part back early


@dataclass(frozen=True)
class UnfinishedResult:
    """What `cache_unfinished` hands back to a request that goes on running."""

    slots: torch.Tensor  # int64 FULL slots the tree holds for [0, protected_len): its row's new prefix
    lock: LockHandle  # the request's lock, now on the node that ends at protected_len
    protected_len: int  # the request's new cache_protected_len


@dataclass(frozen=True)
class CachedPath:
    """One root-to-leaf path, for the KV canary's sweep."""

    slots: torch.Tensor  # int64 FULL slots in position order
    token_ids: list[int]
    swa_live: torch.Tensor  # bool per position: False inside a tombstone


class LRUList:
    """One of a tree's two recency lists (SGLang's `LRUList`), least recently used first.

    The full list holds every node and stamps `last_access` as it moves a node to the most
    recent end; the SWA list holds the live (non-tombstone) nodes only and leaves stamps alone,
    so both lists always agree with the stamp order.
    """

    def __init__(self, *, swa: bool, clock: Iterator[int]) -> None:
        self.swa = swa
        self._clock = clock
        self._order: OrderedDict[int, TreeNode] = OrderedDict()

    def __contains__(self, node: TreeNode) -> bool:
        return node.id in self._order

    def __len__(self) -> int:
        return len(self._order)

    def nodes(self) -> list[TreeNode]:
        """The listed nodes, least recently used first."""
        return list(self._order.values())

    def _lock(self, node: TreeNode) -> int:
        return node.swa_lock_ref if self.swa else node.full_lock_ref

    def _stamp(self, node: TreeNode) -> None:
        if not self.swa:
            node.last_access = next(self._clock)

    def insert_mru(self, node: TreeNode) -> None:
        """Add a node that is not listed yet as the most recently used."""
        assert node.id not in self._order, f"node {node.id} is already listed"
        assert not (self.swa and node.swa_tombstone), f"tombstone {node.id} on the SWA list"
        self._order[node.id] = node
        self._stamp(node)

    def reset_node_mru(self, node: TreeNode) -> None:
        """Move a listed node to the most recently used end."""
        self._order.move_to_end(node.id)
        self._stamp(node)

    def reset_node_and_parents_mru(self, node: TreeNode, root: TreeNode) -> None:
        """Move `node` and its ancestors to the most recent end, the child more recent than its
        parent (the SWA list skips tombstones): so the prefixes nearer the root go first."""
        path = []
        while node is not root:
            path.append(node)
            assert node.parent is not None, f"node {node.id} is detached from the tree"
            node = node.parent
        for n in reversed(path):
            if not (self.swa and n.swa_tombstone):
                self.reset_node_mru(n)

    def remove_node(self, node: TreeNode) -> None:
        del self._order[node.id]

    def lru_no_lock(self) -> TreeNode | None:
        """The least recently used node this list's lock does not hold."""
        return next((n for n in self._order.values() if self._lock(n) == 0), None)

    def lru_leaf_no_lock(self) -> TreeNode | None:
        """The least recently used unlocked leaf."""
        return next((n for n in self._order.values() if self._lock(n) == 0 and n.is_leaf), None)


class SWARadixCache:
    """Prefix cache whose values are FULL slots of `allocator`; see the module docstring."""

    def __init__(self, allocator: SWATokenToKVPoolAllocator, page_size: int, window: int) -> None:
        if page_size < 1 or window < 1:
            raise ValueError(f"page_size and window must be >= 1, got {page_size}, {window}")
        self.allocator = allocator
        self.page_size = page_size
        self.window = window
        self._clock = itertools.count(1)
        self.root = TreeNode()
        self.full_lru_list = LRUList(swa=False, clock=self._clock)
        self.swa_lru_list = LRUList(swa=True, clock=self._clock)

    # ---- match ---------------------------------------------------------------------------------

    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        """Longest cached, page-aligned prefix of `token_ids` that a request may reuse.

        A prefix is acceptable when no tombstone lies on its path, or at least `window` live
        tokens follow the last one: otherwise the prefix's last window of SWA KV is gone. As in
        SGLang, the last node the walk reaches is split where the match ends (accepted or not),
        and the accepted path is touched, its deepest node the most recent.
        """
        node, pos = self.root, 0
        since_tombstone = float("inf")  # live tokens after the last tombstone on the path
        best_node, best_len = self.root, 0
        while pos < len(token_ids) and (child := node.children.get(self._page_key(token_ids, pos))):
            if child.swa_tombstone:
                if since_tombstone >= self.window:
                    best_node, best_len = node, pos
                since_tombstone = 0
            common = self._common_len(child.key, token_ids, pos)
            partial = common < len(child.key)
            if partial:
                child = self._split(child, common)
            if not child.swa_tombstone:
                since_tombstone += common
            node, pos = child, pos + common
            if partial:
                break
        if since_tombstone >= self.window:
            best_node, best_len = node, pos
        self.full_lru_list.reset_node_and_parents_mru(best_node, self.root)
        self.swa_lru_list.reset_node_and_parents_mru(best_node, self.root)
        accepted = self._path_to(best_node)
        slots = torch.cat([n.value for n in accepted]) if accepted else self._empty()
        return MatchResult(slots, best_node, best_len)

    # ---- locks ---------------------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> LockHandle:
        """Lock `node`'s path: full KV up to the root, SWA KV for about one window.

        The SWA lock climbs over live nodes until `window` tokens are covered (the last node it
        takes is split so that only the pages the window reads are locked), and stops at a
        tombstone. Pass the returned handle to `dec_lock_ref`.
        """
        swa_tokens, swa_open = 0, True
        n = node
        while n is not self.root:
            swa_open = swa_open and not n.swa_tombstone
            if swa_open:
                # Lock only the tail of the node the window reads (whole pages): a whole node
                # could hold up to a chunk more live SWA than the window, which admission never
                # reserved (SGLang locks whole nodes; see docs/architecture.md).
                need = self.window - swa_tokens
                at = len(n.key) - -(-need // self.page_size) * self.page_size
                if at > 0:
                    self._split(n, at)  # n keeps the tail; its new parent, the head, n's old locks
            n.full_lock_ref += 1
            if swa_open:
                n.swa_lock_ref += 1
                swa_tokens += len(n.key)
                swa_open = swa_tokens < self.window
            assert n.parent is not None
            n = n.parent
        return LockHandle(node, swa_tokens)

    def dec_lock_ref(self, handle: LockHandle) -> None:
        """Release exactly what `inc_lock_ref` locked for `handle`."""
        if handle.released:
            raise RuntimeError(f"lock on node {handle.node.id} released twice")
        handle.released = True
        swa_left = 0 if handle.swa_released else handle.swa_locked_tokens
        for n in self._up(handle.node):
            n.full_lock_ref -= 1
            if swa_left > 0:
                n.swa_lock_ref -= 1
                swa_left -= len(n.key)
        assert swa_left == 0, "the SWA-locked range changed length while locked"

    def dec_swa_lock_only(self, handle: LockHandle) -> None:
        """Give back the SWA part of `handle`'s lock early, keeping the full part (SGLang's
        `dec_swa_lock_only`, which its scheduler calls once a request has decoded a window past
        its prefix): the prefix's SWA KV turns evictable, and the tree's SWA eviction may
        tombstone it, where SGLang tombstones a leaf at once. `dec_lock_ref` then releases the
        full part only."""
        if handle.released or handle.swa_released:
            raise RuntimeError(f"SWA lock on node {handle.node.id} released twice")
        handle.swa_released = True
        swa_left = handle.swa_locked_tokens
        for n in self._up(handle.node):
            if swa_left <= 0:
                break
            n.swa_lock_ref -= 1
            swa_left -= len(n.key)
        assert swa_left <= 0, "the SWA-locked range changed length while locked"

    # ---- insert --------------------------------------------------------------------------------

    def insert(
        self,
        token_ids: list[int],
        slots: torch.Tensor,
        *,
        prev_prefix_len: int,
        swa_evicted_seqlen: int,
    ) -> int:
        """Cache a request's tokens; the tree takes ownership of `slots`.

        Walking the cached part, each node is touched (root side first, so a child ends up more
        recent than its parent). Where the incoming tokens are already cached, past
        `prev_prefix_len` (below it the slots are the tree's own), the incoming copy is freed,
        except over a tombstone, whose SWA KV the incoming copy can bring back (see
        `_recover_tombstone`). The rest becomes new nodes: a tombstone for the window-evicted
        part, then a live leaf.

        Args:
            token_ids: page-aligned token ids.
            slots: int64 FULL slots, one per token.
            prev_prefix_len: positions below it are the tree's own slots (matched earlier).
            swa_evicted_seqlen: positions below it had their SWA peers released already.
        Returns:
            The length that was already cached.
        """
        n, page = len(token_ids), self.page_size
        if len(slots) != n or n % page or prev_prefix_len % page or swa_evicted_seqlen % page:
            raise ValueError(
                f"insert needs page-aligned lengths (page_size={page}): tokens={n}, slots="
                f"{len(slots)}, prev_prefix_len={prev_prefix_len}, swa_evicted={swa_evicted_seqlen}"
            )
        slots = slots.to(torch.int64)
        node, pos = self.root, 0
        while pos < n and (child := node.children.get(self._page_key(token_ids, pos))):
            self._touch_one(child)
            common = self._common_len(child.key, token_ids, pos)
            if common < len(child.key):
                child = self._split(child, common)
            end = pos + common
            if prev_prefix_len < end:
                if pos < prev_prefix_len:
                    # Keep the tree's own part (below prev_prefix_len) out of reach.
                    self._split(child, prev_prefix_len - pos)
                    pos = prev_prefix_len
                self._take_duplicate(child, slots, pos, end, swa_evicted_seqlen)
            node, pos = child, end
        matched = pos
        if matched < prev_prefix_len:
            raise RuntimeError(f"the locked prefix [0,{prev_prefix_len}) left the tree ({matched})")
        if swa_evicted_seqlen >= n:
            # No node: it would be an all-tombstone leaf.
            self.allocator.free_full(slots[matched:])
        elif matched < n:
            split = max(matched, swa_evicted_seqlen)
            if split > matched:
                node = self._add_child(node, token_ids[matched:split], slots[matched:split], tombstone=True)
            self._add_child(node, token_ids[split:], slots[split:], tombstone=False)
        return matched

    def cache_unfinished(
        self,
        token_ids: list[int],
        slots: torch.Tensor,
        *,
        prev_prefix_len: int,
        swa_evicted_seqlen: int,
        lock: LockHandle | None,
    ) -> UnfinishedResult:
        """Cache the processed part of a request that goes on running (SGLang's
        `cache_unfinished_req`, called between the chunks of a chunked prefill).

        Inserts `token_ids` (page-aligned) with the request's slots, the part below
        `swa_evicted_seqlen` as a tombstone, then matches them again: where the tree already
        held some of these tokens the insert freed the incoming copy, so the request must read
        the tree's slots from now on. The request's lock moves from its old node to the node
        the match ends at (SGLang releases the old lock first, then takes the new one).
        """
        self.insert(token_ids, slots, prev_prefix_len=prev_prefix_len, swa_evicted_seqlen=swa_evicted_seqlen)
        match = self.match_prefix(token_ids)
        # SGLang asserts the same: the match covers what the request held before.
        assert prev_prefix_len <= match.matched_len, (prev_prefix_len, match.matched_len)
        if lock is not None:
            self.dec_lock_ref(lock)
        return UnfinishedResult(match.slots, self.inc_lock_ref(match.last_node), match.matched_len)

    def _take_duplicate(self, node: TreeNode, slots: torch.Tensor, lo: int, hi: int, evicted: int) -> None:
        """The incoming copy `slots[lo:hi]` of the tokens `node` already holds (`node` is exactly
        `[lo, hi)`). Below `evicted` the incoming SWA peers are gone already."""
        if not node.swa_tombstone:
            cut = min(max(evicted, lo), hi)
            self.allocator.free_full(slots[lo:cut])
            self.allocator.free(slots[cut:hi])
        elif evicted <= lo:
            self._recover_tombstone(node, slots[lo:hi])
        elif evicted < hi:
            # Partly live: the tombstone keeps the evicted head; the live tail is brought back.
            self._split(node, evicted - lo)
            self.allocator.free_full(slots[lo:evicted])
            self._recover_tombstone(node, slots[evicted:hi])
        else:
            self.allocator.free_full(slots[lo:hi])

    def _recover_tombstone(self, node: TreeNode, incoming: torch.Tensor) -> None:
        """Bring a tombstone's SWA KV back from an incoming copy whose SWA peers are all live.

        Unlocked, the tree adopts the incoming slots and frees its own full slots (their SWA
        side is long gone). If a running request holds the node's full KV, those slots stay:
        they are re-paired with the incoming SWA peers, and only the incoming full slots go.
        Either way the frees join an open free group, whose full-side guard (`swa.peer_released`)
        is evaluated here, at enqueue, after the mapping was cleared: the re-paired slots are
        not this call's to judge.
        """
        if node.full_lock_ref > 0:
            peers = self.allocator.translate_loc_from_full_to_swa(incoming)
            self.allocator.set_full_to_swa_mapping(node.value, peers)
            self.allocator.clear_full_to_swa_mapping(incoming)
            self.allocator.free_full(incoming)
        else:
            self.allocator.free_full(node.value)
            node.value = incoming.clone()
        node.swa_tombstone = False
        self.swa_lru_list.insert_mru(node)

    # ---- evict ---------------------------------------------------------------------------------

    def evict(self, full_tokens: int, swa_tokens: int) -> tuple[int, int]:
        """Free cached KV until `full_tokens` full and `swa_tokens` SWA tokens are freed.

        Full phase: delete the least recently used unlocked leaves, then their parents that
        became childless tombstones. SWA phase (if the full phase freed too little SWA): the least
        recently used live node without an SWA lock is tombstoned if it has children or a full
        lock, else deleted with its full KV. Since a child is more recent than its parent, the
        SWA phase tombstones old prefixes before it reaches a leaf. Stops early when nothing is
        evictable. The caller wraps this in a free group if it wants one.

        Returns:
            (full tokens freed, SWA tokens freed), counted as SGLang counts them.
        """
        freed = [0, 0]
        while freed[0] < full_tokens:
            leaf = self.full_lru_list.lru_leaf_no_lock()
            if leaf is None:
                break
            cascaded = self._delete_cascading(leaf, freed)  # counts the leaf itself in `freed`
            freed[0] += cascaded
        while freed[1] < swa_tokens:
            victim = self.swa_lru_list.lru_no_lock()
            if victim is None:
                break
            if victim.is_leaf and victim.full_lock_ref == 0:
                self._delete_cascading(victim, freed)
            else:
                # An internal node, or a leaf a running request still holds in full (which
                # nothing here makes yet): only its SWA side goes.
                self.allocator.free_swa(victim.value)
                self.swa_lru_list.remove_node(victim)
                victim.swa_tombstone = True
                freed[1] += len(victim.key)
        return freed[0], freed[1]

    def _delete_cascading(self, leaf: TreeNode, freed: list[int]) -> int:
        """Delete `leaf`, then each parent left a childless, unlocked tombstone.

        Counts the leaf in `freed`; returns the full tokens the cascade freed beyond it.
        """
        node = self._delete_leaf(leaf, freed)
        cascaded = 0
        while (
            node is not None
            and node is not self.root
            and node.is_leaf
            and node.swa_tombstone
            and node.full_lock_ref == 0
        ):
            cascaded += len(node.key)
            node = self._delete_leaf(node, None)
        return cascaded

    def _delete_leaf(self, node: TreeNode, freed: list[int] | None) -> TreeNode:
        """Free a leaf's KV, unlist and unlink it; returns its former parent."""
        if node.swa_tombstone:  # its SWA side is gone already
            self.allocator.free_full(node.value)
        else:
            self.allocator.free(node.value)
            self.swa_lru_list.remove_node(node)
            if freed is not None:
                freed[1] += len(node.key)
        if freed is not None:
            freed[0] += len(node.key)
        self.full_lru_list.remove_node(node)
        parent = node.parent
        assert parent is not None
        del parent.children[tuple(node.key[: self.page_size])]
        node.parent = None
        return parent

    def reset(self) -> None:
        """Free every cached slot and empty the tree. Refuses while any node is locked."""
        if any(n.full_lock_ref or n.swa_lock_ref for n in self._nodes()):
            raise RuntimeError("reset with locked nodes")
        self.evict(self.total_size(), 0)
        assert not self.root.children, "evict left nodes behind"

    # ---- sizes and views -----------------------------------------------------------------------

    def full_evictable_size(self) -> int:
        return sum(len(n.key) for n in self._nodes() if n.full_lock_ref == 0)

    def full_protected_size(self) -> int:
        return sum(len(n.key) for n in self._nodes() if n.full_lock_ref > 0)

    def swa_evictable_size(self) -> int:
        return sum(len(n.key) for n in self._nodes() if not n.swa_tombstone and n.swa_lock_ref == 0)

    def swa_protected_size(self) -> int:
        return sum(len(n.key) for n in self._nodes() if not n.swa_tombstone and n.swa_lock_ref > 0)

    def total_size(self) -> int:
        """Tokens cached (full side), tombstones included."""
        return sum(len(n.key) for n in self._nodes())

    def held_slots(self) -> torch.Tensor:
        """Every FULL slot the tree holds, int64 (for leak checks)."""
        values = [n.value for n in self._nodes()]
        return torch.cat(values) if values else self._empty()

    def locked_slots(self, handle: LockHandle) -> torch.Tensor:
        """The FULL slots of the prefix `handle` locks (root to its node), int64."""
        values = [n.value for n in self._path_to(handle.node)]
        return torch.cat(values) if values else self._empty()

    def held_swa_slots(self) -> torch.Tensor:
        """The SWA peers of every live (non-tombstone) node's slots, int64 (unmapped ones read 0)."""
        mapping = self.allocator.full_to_swa_index_mapping
        values = [mapping[n.value].to(torch.int64) for n in self._nodes() if not n.swa_tombstone]
        return torch.cat(values) if values else self._empty()

    def cached_paths(self) -> list[CachedPath]:
        """One `CachedPath` per leaf, in depth-first order."""
        paths = []
        for leaf in self._nodes():
            if not leaf.is_leaf:
                continue
            chain = self._path_to(leaf)
            paths.append(
                CachedPath(
                    slots=torch.cat([n.value for n in chain]),
                    token_ids=[t for n in chain for t in n.key],
                    swa_live=torch.tensor(
                        [not n.swa_tombstone for n in chain for _ in n.key], dtype=torch.bool
                    ),
                )
            )
        return paths

    def sanity_check(self) -> list[str]:
        """Problems found in the tree (an empty list when sane). Run it at idle: locks count."""
        problems = []
        mapping = self.allocator.full_to_swa_index_mapping
        for node, start in self._nodes_with_start():
            where = f"node {node.id} [{start},{start + len(node.key)})"
            if node.full_lock_ref or node.swa_lock_ref:
                locks = f"full={node.full_lock_ref}, swa={node.swa_lock_ref}"
                problems.append(f"{where} is locked at idle ({locks})")
            if node.full_lock_ref < node.swa_lock_ref:
                problems.append(f"{where} has full_lock_ref < swa_lock_ref")
            if node.is_leaf and node.swa_tombstone:
                problems.append(f"{where} is a tombstone leaf")
            if len(node.key) != len(node.value) or not node.key or len(node.key) % self.page_size:
                problems.append(f"{where} has key/value lengths {len(node.key)}/{len(node.value)}")
                continue
            # The padding page (slots below page_size: what a zeroed req_to_token entry names)
            # is never handed out, so a node that holds it caches KV nobody wrote.
            if bool((node.value < self.page_size).any()):
                problems.append(f"{where} holds the padding page's slots")
            peers = mapping[node.value]
            if node.swa_tombstone and bool((peers != 0).any()):
                problems.append(f"{where} is a tombstone but its slots are still mapped")
            if not node.swa_tombstone and bool((peers <= 0).any()):
                problems.append(f"{where} is live but some slots have no SWA peer")
        for parent in [self.root, *self._nodes()]:
            for first_page, child in parent.children.items():
                if child.parent is not parent or first_page != tuple(child.key[: self.page_size]):
                    problems.append(f"node {child.id} is linked under the wrong parent or key")
        problems += self._lru_problems()
        held = self.held_slots()
        unique, counts = torch.unique(held, return_counts=True)
        if bool((counts > 1).any()):
            problems.append(f"slots held twice: {unique[counts > 1].tolist()}")
        return problems

    def _lru_problems(self) -> list[str]:
        """The LRU lists hold exactly the right nodes (all; the live ones), in stamp order."""
        problems = []
        nodes = list(self._nodes())
        for lru, expected, name in (
            (self.full_lru_list, {n.id for n in nodes}, "full"),
            (self.swa_lru_list, {n.id for n in nodes if not n.swa_tombstone}, "SWA"),
        ):
            listed = lru.nodes()
            ids = {n.id for n in listed}
            if ids != expected:
                problems.append(f"{name} LRU list holds nodes {sorted(ids - expected)} it should not "
                                f"and misses {sorted(expected - ids)}")
            stamps = [n.last_access for n in listed]
            if stamps != sorted(stamps):
                problems.append(f"{name} LRU list is out of recency order")
        return problems

    # ---- internals ---------------------------------------------------------------------------

    def _nodes(self) -> Iterator[TreeNode]:
        return (node for node, _ in self._nodes_with_start())

    def _nodes_with_start(self) -> Iterator[tuple[TreeNode, int]]:
        """Every node but the root, depth-first, with the position its key starts at."""
        stack = [(child, 0) for child in reversed(self.root.children.values())]
        while stack:
            node, start = stack.pop()
            yield node, start
            end = start + len(node.key)
            stack.extend((child, end) for child in reversed(node.children.values()))

    def _up(self, node: TreeNode) -> Iterator[TreeNode]:
        """`node` and its ancestors, the root excluded."""
        while node is not self.root:
            yield node
            assert node.parent is not None, f"node {node.id} is detached from the tree"
            node = node.parent

    def _path_to(self, node: TreeNode) -> list[TreeNode]:
        return list(self._up(node))[::-1]

    def _touch_one(self, node: TreeNode) -> None:
        """Make `node` (alone) the most recently used, on the SWA list too if it is live."""
        self.full_lru_list.reset_node_mru(node)
        if not node.swa_tombstone:
            self.swa_lru_list.reset_node_mru(node)

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Cut `child` at `at` (page-aligned); the new parent takes the head and copies the flags.

        `child` keeps its identity (and the tail), so lock handles naming it stay valid. As in
        SGLang both re-enter the LRU lists as the most recent, the tail after the head.
        """
        parent = child.parent
        assert parent is not None and 0 < at < len(child.key) and at % self.page_size == 0
        head = TreeNode(
            key=child.key[:at],
            value=child.value[:at].clone(),
            parent=parent,
            full_lock_ref=child.full_lock_ref,
            swa_lock_ref=child.swa_lock_ref,
            swa_tombstone=child.swa_tombstone,
        )
        child.key, child.value = child.key[at:], child.value[at:].clone()
        head.children[tuple(child.key[: self.page_size])] = child
        parent.children[tuple(head.key[: self.page_size])] = head
        child.parent = head
        self.full_lru_list.remove_node(child)
        self.full_lru_list.insert_mru(head)
        self.full_lru_list.insert_mru(child)
        if not child.swa_tombstone:
            self.swa_lru_list.remove_node(child)
            self.swa_lru_list.insert_mru(head)
            self.swa_lru_list.insert_mru(child)
        return head

    def _add_child(self, parent: TreeNode, key: list[int], value: torch.Tensor, *, tombstone: bool) -> TreeNode:
        # A clone: `value` is often a view of a req_to_token row that will be reused.
        node = TreeNode(key=list(key), value=value.clone(), parent=parent, swa_tombstone=tombstone)
        parent.children[tuple(key[: self.page_size])] = node
        self.full_lru_list.insert_mru(node)
        if not tombstone:
            self.swa_lru_list.insert_mru(node)
        return node

    def _page_key(self, token_ids: list[int], pos: int) -> tuple[int, ...]:
        return tuple(token_ids[pos : pos + self.page_size])

    def _common_len(self, key: list[int], token_ids: list[int], pos: int) -> int:
        """Length of the common prefix of `key` and `token_ids[pos:]`, floored to whole pages."""
        limit = min(len(key), len(token_ids) - pos)
        common = 0
        while common < limit and key[common] == token_ids[pos + common]:
            common += 1
        return common - common % self.page_size

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.allocator.device)
