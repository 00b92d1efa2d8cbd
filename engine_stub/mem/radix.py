"""A prefix cache over FULL slots with SWA tombstones (SGLang's `SWARadixCache`, simplified).

Each node holds the FULL slots of a run of tokens; a node's SWA KV lives behind the allocator's
mapping. A *tombstone* node has had its SWA KV freed (mapping 0) and keeps only its full KV.
Invariants kept here and checked by `sanity_check`:

- keys and values are page-aligned and of equal length; a leaf is never a tombstone;
- `full_lock_ref >= swa_lock_ref`; the root is never locked, freed or evicted;
- a live node's slots are mapped, a tombstone's are not; no slot is held twice.

`last_access` is a logical clock, so eviction order is deterministic across runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from engine_stub.mem.swa import SWATokenToKVPoolAllocator

__all__ = ["CachedPath", "LockHandle", "MatchResult", "SWARadixCache", "TreeNode"]

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


@dataclass(frozen=True)
class CachedPath:
    """One root-to-leaf path, for the KV canary's sweep."""

    slots: torch.Tensor  # int64 FULL slots in position order
    token_ids: list[int]
    swa_live: torch.Tensor  # bool per position: False inside a tombstone


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

    # ---- match ---------------------------------------------------------------------------------

    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        """Longest cached, page-aligned prefix of `token_ids` that a request may reuse.

        A prefix is acceptable when no tombstone lies on its path, or at least `window` live
        tokens follow the last one: otherwise the prefix's last window of SWA KV is gone. Splits
        the last node when the accepted prefix ends inside it, and touches the accepted path.
        """
        node, pos = self.root, 0
        since_tombstone: int | None = None  # live tokens after the last tombstone; None: none seen
        best_node, best_len = self.root, 0
        while pos < len(token_ids) and (child := node.children.get(self._page_key(token_ids, pos))):
            common = self._common_len(child.key, token_ids, pos)
            if child.swa_tombstone:
                since_tombstone = 0
            else:
                if since_tombstone is not None:
                    since_tombstone += common
                if since_tombstone is None or since_tombstone >= self.window:
                    if common < len(child.key):
                        child = self._split(child, common)
                    best_node, best_len = child, pos + common
            if common < len(child.key):
                break
            node, pos = child, pos + common
        accepted = self._path_to(best_node)
        self._touch(best_node)
        slots = torch.cat([n.value for n in accepted]) if accepted else self._empty()
        return MatchResult(slots, best_node, best_len)

    # ---- locks ---------------------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> LockHandle:
        """Lock `node`'s path: full KV up to the root, SWA KV for about one window.

        The SWA lock climbs over live nodes until `window` tokens are covered, and stops at a
        tombstone. Pass the returned handle to `dec_lock_ref`.
        """
        swa_tokens, swa_open = 0, True
        for n in self._up(node):
            n.full_lock_ref += 1
            swa_open = swa_open and not n.swa_tombstone
            if swa_open:
                n.swa_lock_ref += 1
                swa_tokens += len(n.key)
                swa_open = swa_tokens < self.window
        return LockHandle(node, swa_tokens)

    def dec_lock_ref(self, handle: LockHandle) -> None:
        """Release exactly what `inc_lock_ref` locked for `handle`."""
        if handle.released:
            raise RuntimeError(f"lock on node {handle.node.id} released twice")
        handle.released = True
        swa_left = handle.swa_locked_tokens
        for n in self._up(handle.node):
            n.full_lock_ref -= 1
            if swa_left > 0:
                n.swa_lock_ref -= 1
                swa_left -= len(n.key)
        assert swa_left == 0, "the SWA-locked range changed length while locked"

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

        Args:
            token_ids: page-aligned token ids.
            slots: int64 FULL slots, one per token.
            prev_prefix_len: positions below it are the tree's own slots (matched earlier).
            swa_evicted_seqlen: positions below it had their SWA peers released already.
        Returns:
            The length that was already cached. Incoming slots there are freed (duplicates).
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
            common = self._common_len(child.key, token_ids, pos)
            if common < len(child.key):
                child = self._split(child, common)
            node, pos = child, pos + common
        matched = pos
        if matched < prev_prefix_len:
            raise RuntimeError(f"the locked prefix [0,{prev_prefix_len}) left the tree ({matched})")
        # Duplicates [prev_prefix_len, matched): below the frontier only the full side is ours.
        frontier = min(max(prev_prefix_len, swa_evicted_seqlen), matched)
        self.allocator.free_full(slots[prev_prefix_len:frontier])
        self.allocator.free(slots[frontier:matched])
        if swa_evicted_seqlen >= n:
            # No node: it would be an all-tombstone leaf.
            self.allocator.free_full(slots[matched:])
        elif matched < n:
            split = max(matched, swa_evicted_seqlen)
            if split > matched:
                node = self._add_child(node, token_ids[matched:split], slots[matched:split])
                node.swa_tombstone = True
            node = self._add_child(node, token_ids[split:], slots[split:])
        self._touch(node)
        return matched

    # ---- evict ---------------------------------------------------------------------------------

    def evict(self, full_tokens: int, swa_tokens: int) -> tuple[int, int]:
        """Free cached KV until `full_tokens` full and `swa_tokens` SWA tokens are freed.

        Full phase: delete unlocked LRU leaves, then their parents that became childless
        tombstones. SWA phase: the LRU live node without an SWA lock is deleted if it is an
        unlocked leaf, else tombstoned. Stops early when nothing is evictable. The caller wraps
        this in a free group if it wants one.

        Returns:
            (full tokens freed, SWA tokens freed).
        """
        freed = [0, 0]
        while freed[0] < full_tokens:
            leaf = self._lru(lambda x: x.is_leaf and x.full_lock_ref == 0)
            if leaf is None:
                break
            self._delete_cascading(leaf, freed)
        while freed[1] < swa_tokens:
            victim = self._lru(lambda x: not x.swa_tombstone and x.swa_lock_ref == 0)
            if victim is None:
                break
            if victim.is_leaf and victim.full_lock_ref == 0:
                self._delete_cascading(victim, freed)
            else:
                # A full-locked leaf with no SWA lock (an early SWA release, which nothing here
                # does yet) becomes a tombstone leaf; the full phase frees it once unlocked.
                self.allocator.free_swa(victim.value)
                victim.swa_tombstone = True
                freed[1] += len(victim.key)
        return freed[0], freed[1]

    def _delete_cascading(self, leaf: TreeNode, freed: list[int]) -> None:
        node: TreeNode | None = leaf
        while (
            node is not None
            and node is not self.root
            and node.is_leaf
            and node.full_lock_ref == 0
            and (node is leaf or node.swa_tombstone)
        ):
            if node.swa_tombstone:  # its SWA side is gone already
                self.allocator.free_full(node.value)
            else:
                self.allocator.free(node.value)
                freed[1] += len(node.key)
            freed[0] += len(node.key)
            parent = node.parent
            assert parent is not None
            del parent.children[tuple(node.key[: self.page_size])]
            node.parent = None
            node = parent

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
            peers = mapping[node.value]
            if node.swa_tombstone and bool((peers != 0).any()):
                problems.append(f"{where} is a tombstone but its slots are still mapped")
            if not node.swa_tombstone and bool((peers <= 0).any()):
                problems.append(f"{where} is live but some slots have no SWA peer")
        for parent in [self.root, *self._nodes()]:
            for first_page, child in parent.children.items():
                if child.parent is not parent or first_page != tuple(child.key[: self.page_size]):
                    problems.append(f"node {child.id} is linked under the wrong parent or key")
        held = self.held_slots()
        unique, counts = torch.unique(held, return_counts=True)
        if bool((counts > 1).any()):
            problems.append(f"slots held twice: {unique[counts > 1].tolist()}")
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

    def _lru(self, pick: Callable[[TreeNode], bool]) -> TreeNode | None:
        return min((n for n in self._nodes() if pick(n)), key=lambda n: n.last_access, default=None)

    def _touch(self, node: TreeNode) -> None:
        # Leaf-first ticks: a parent is always more recent than its children, so LRU order
        # reaches leaves before the prefixes they hang from.
        for n in self._up(node):
            n.last_access = next(self._clock)

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Cut `child` at `at` (page-aligned); the new parent takes the head and copies the flags.

        `child` keeps its identity (and the tail), so lock handles naming it stay valid.
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
            last_access=child.last_access,
        )
        child.key, child.value = child.key[at:], child.value[at:].clone()
        head.children[tuple(child.key[: self.page_size])] = child
        parent.children[tuple(head.key[: self.page_size])] = head
        child.parent = head
        return head

    def _add_child(self, parent: TreeNode, key: list[int], value: torch.Tensor) -> TreeNode:
        # A clone: `value` is often a view of a req_to_token row that will be reused.
        node = TreeNode(key=list(key), value=value.clone(), parent=parent)
        parent.children[tuple(key[: self.page_size])] = node
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
