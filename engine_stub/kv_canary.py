"""KV canary: per-slot shadow records that prove every slot a forward reads holds what it should.

For each pool (FULL, SWA) a record per slot row: (token, position, prev_hash, kv_hash), kept
with the inputs of its hashes (below).
`prev_hash` chains every position to the one before it (over token and position only, so two
requests that computed the same prefix in different batches, whose KV may differ in the last bit,
still chain identically after the radix cache keeps one copy), `kv_hash` folds the real K/V bytes of the
group's layers. A forward is bracketed by a HEAD verify (chain + position of every prefix slot
the batch will read; SWA group: last window only) and a TAIL verify (the same plus the real-KV
hash, after the new records were written). Every `sweep_interval` steps a SWEEP verifies every
slot the radix cache holds. A token oracle (the sampled token, noted before anything can touch
it) catches a write whose input token differs (`write_token`).

Verification never reads the device: failures accumulate in device masks, `pending_counts()`
stacks their sums, the scheduler reads them back with the step's sampled tokens (one copy), and
`collect()` reads a mask only for a verification that failed.

The hot path is batched. A verification is one pass over the elements of both groups (FULL then
SWA): per group a `[requests, width]` grid of positions, built on the device from a few ints per
request against index tensors cached per batch (the FULL grid's width grows in steps, so they
last many decode steps), with padding masked out. A decode's HEAD reuses the last step's TAIL
plan. A write records every new position of every request and group at once (the chain is
sequential along positions, so a prefill of J new tokens per request runs J-1 batched chain
steps; a decode none); `write_and_verify_tail` shares the TAIL's reads of req_to_token, the
mapping and the KV bytes with the write it follows. No numpy on a decode step's hot path: after
the forward its code runs cold and costs several times what torch's (warm) ops do.

Both hashes end in splitmix64, a bijection on 64-bit words, so a record also keeps the *inputs*
of its splitmixes: `prev_in` (`prev_hash == splitmix(prev_in)`) and `kv_sum` (`kv_hash ==
splitmix(kv_sum)`, which is all the record keeps of it), and `next_in`, the input it hands on to
the position after it (`_chain`'s, from its token, position and prev_hash). A write keeps these
in step; a verification compares inputs (an element's prev_in with its predecessor's next_in),
which fail exactly where the hashes would, and needs no hashing of its own; `collect()` applies
splitmix on the host to the few values it reports. An unwritten (zero) record holds splitmix's
preimage of 0 as prev_in and kv_sum, so it reads as the all-zero record it replaces.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine_stub.mem.kv_pool import HybridKVPool

__all__ = ["CanaryViolation", "KVCanary", "REASONS", "CanaryRequest"]

REASONS = ("verify_chain_hash", "verify_position", "verify_real_kv_hash", "write_token")
GROUPS = ("FULL", "SWA")

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_CHAIN_SEED = _signed(0xC0FFEE1234567890)
_MIX_MULTIPLIERS = [_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD6E8FEB86659FD93)]
_M0, _M1, _M2, _M3 = _MIX_MULTIPLIERS

# Record columns: token, prev_hash, position, prev_in, kv_sum, next_in.
_TOKEN, _PREV_HASH, _POSITION, _PREV_IN, _KV_SUM, _NEXT_IN = range(6)
_RECORD_WIDTH = 6
# A pass's FULL grid is this many columns wider at a time (see `KVCanary._pass_spec`).
_FULL_WIDTH_STEP = 32
# A pass compares the record's columns [position, prev_in, kv_sum] with what they must be. Per
# failure column (in report order): the reason, the column, the stored column reported, and
# whether the stored and the expected value are reported through splitmix (inputs) or as they are.
_COLUMNS = (("verify_chain_hash", 1, _PREV_HASH, False, True), ("verify_position", 0, _POSITION, False, False),
            ("verify_real_kv_hash", 2, _KV_SUM, True, True))


def _splitmix_int(x: int) -> int:
    """`_splitmix` of one (signed) int64, on the host."""
    x = (x + _M0) & _MASK64
    x = ((x ^ (x >> 30)) * _M1) & _MASK64
    x = ((x ^ (x >> 27)) * _M2) & _MASK64
    return _signed(x ^ (x >> 31))


def _unsplitmix_int(y: int) -> int:
    """The int64 whose `_splitmix` is `y` (splitmix64 is a bijection)."""

    def unxorshift(v: int, bits: int) -> int:
        x = v
        for _ in range(64 // bits + 1):
            x = v ^ (x >> bits)
        return x

    x = unxorshift(y & _MASK64, 31)
    x = unxorshift((x * pow(_M2 & _MASK64, -1, 1 << 64)) & _MASK64, 27)
    x = unxorshift((x * pow(_M1 & _MASK64, -1, 1 << 64)) & _MASK64, 30)
    return _signed(x - _M0)


_SEED_IN = _unsplitmix_int(_CHAIN_SEED)  # prev_in of position 0
_ZERO_IN = _unsplitmix_int(0)  # prev_in and kv_sum of an unwritten record
_NO_POSITION = -1  # what the padding slot's record reads as: no position is ever its own


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    # Logical shift on int64 (torch's >> is arithmetic).
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    x = x + _MIX_MULTIPLIERS[0]
    x = (x ^ _shr(x, 30)) * _MIX_MULTIPLIERS[1]
    x = (x ^ _shr(x, 27)) * _MIX_MULTIPLIERS[2]
    return x ^ _shr(x, 31)


def _chain(prev: torch.Tensor, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    # The real-KV hash stays out of the chain: it is verified on its own (verify_real_kv_hash),
    # and KV bits depend on batch composition, which a deduplicated radix prefix does not keep.
    return _splitmix(prev * _MIX_MULTIPLIERS[0] + token * _MIX_MULTIPLIERS[1] + position * _MIX_MULTIPLIERS[2])


def _mix(x: torch.Tensor) -> torch.Tensor:
    """`_splitmix(x)` in fewer ops: a new tensor, then in place on it."""
    x = x + _M0
    t = x >> 30
    t &= (1 << 34) - 1
    x ^= t
    x *= _M1
    t = x >> 27
    t &= (1 << 37) - 1
    x ^= t
    x *= _M2
    t = x >> 31
    t &= (1 << 33) - 1
    x ^= t
    return x


def _spans(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every `range(lo[i], hi[i])` concatenated: (owner index i, value) per element."""
    lens = hi - lo
    owner = np.repeat(np.arange(lens.size), lens)
    values = np.arange(int(lens.sum()), dtype=np.int64) + np.repeat(lo - (np.cumsum(lens) - lens), lens)
    return owner, values


@dataclass(frozen=True)
class CanaryRequest:
    """What the canary needs of one request in a batch."""

    rid: str
    row: int  # req_to_token row
    prefix_len: int  # positions whose KV existed before this step
    seq_len: int  # positions with KV after this step
    new_token_ids: list[int]  # input ids of positions [prefix_len, seq_len)


@dataclass(frozen=True)
class CanaryViolation:
    reason: str
    group: str
    phase: str
    slot: int  # FULL slot (what req_to_token holds)
    pool_row: int  # row in the group's pool (the SWA slot for the SWA group)
    position: int
    request: str
    stored: int
    expected: int
    step: int

    @property
    def launch_tag(self) -> str:
        return f"{self.phase}_{self.group}"

    def log_line(self) -> str:
        """The frozen one-line format reports and greps rely on."""
        return (
            f"kv_canary violation: launch_tag={self.launch_tag} fail_reason={self.reason} "
            f"slot_idx={self.slot} pool_row={self.pool_row} position={self.position} "
            f"request={self.request or '-'} stored={self.stored:#x} expected={self.expected:#x} "
            f"step={self.step}"
        )

    def to_dict(self) -> dict:
        return {
            "reason": self.reason, "group": self.group, "phase": self.phase, "slot": self.slot,
            "pool_row": self.pool_row, "position": self.position, "request": self.request,
            "stored": self.stored, "expected": self.expected, "step": self.step,
        }


@dataclass
class _Pending:
    """One verification pass (both groups) kept as device tensors until `collect()`.

    Elements are the FULL group's then the SWA group's (`segments`: group and count, in order).
    `expected` columns: position, prev_in, kv_sum (absent without the KV check), compared with
    the record's columns of the same names; `fails` is `expected`-shaped, True where a checked
    element differs.
    """

    phase: str
    segments: list[tuple[str, int]]
    count: torch.Tensor  # 0-dim: failures in `fails`
    fails: torch.Tensor  # bool [n, k]
    stored: torch.Tensor  # int64 [n, _RECORD_WIDTH]: the records read
    expected: torch.Tensor  # int64 [n, k]
    slots: torch.Tensor
    rows: list[torch.Tensor]  # per segment: the group's pool rows of its elements
    rids: list[str]  # per request of the verification (empty for a sweep)
    request_of: Callable[[], np.ndarray] | None  # per element: its index into `rids`


@dataclass
class _PassPlan:
    """The elements of a HEAD or TAIL pass: per group (FULL, then SWA) a `[requests, width]`
    grid, row i the positions `from_i, from_i + 1, ...` of request i (flattened, row-major);
    elements past a request's last position are padding, which `valid` leaves unchecked."""

    segments: list[tuple[str, int]]  # group, grid elements
    counts: list[tuple[str, int]]  # group, real elements (the verify_full / verify_swa stats)
    elements: torch.Tensor  # int64 [n]: flat req_to_token index (row * columns + position)
    positions: torch.Tensor  # int64 [n]
    # int64 [n]: where its predecessor's next_in sits in the pass's records read (flattened, the
    # seed's record last): element k - 1's, or the seed's in a grid's column 0.
    predecessor: torch.Tensor
    valid: torch.Tensor  # bool [n]: a real element (all three checks)
    chain_ok: torch.Tensor | None  # bool [n]: its chain is checked too (None: wherever valid)
    grids: list[tuple[str, int, list[int]]]  # group, width, from (per request)

    def request_of(self) -> np.ndarray:
        """Per element: its request's index in the batch."""
        return np.concatenate([np.repeat(np.arange(len(lo)), width) for _, width, lo in self.grids])


@dataclass
class _WritePlan:
    """The new positions of a write, offset-major (see `write`)."""

    n_reqs: int
    total: int
    max_extend: int
    index: torch.Tensor  # int64 [n_reqs + total]: flat req_to_token index, seed slots then new
    tokens: torch.Tensor  # int64 [total]
    positions: torch.Tensor  # int64 [total]
    has_prefix: torch.Tensor  # bool [n_reqs]: a seed record to chain from (else the chain seed)
    step_in: torch.Tensor  # int64 [max_extend, n_reqs]: tok * M1 + pos * M2 of chain step j
    lane: torch.Tensor | None  # int64 [total]: where each new position's chain values sit
    # int64 [groups, n_reqs + total]: where the seed and the new positions sit among each
    # group's TAIL elements, when every one of them is a TAIL element (else None).
    in_tail: torch.Tensor | None = None
    all_prefixed: bool = False  # every request has a seed record (prefix_len > 0)


@dataclass
class _StepPlan:
    """Every index a step's HEAD, write and TAIL need, built in one go (per-request values sent
    to the device as one tensor). Indices only: what they point at is read when each phase runs."""

    reqs: list[CanaryRequest]
    columns: int
    head: _PassPlan | None
    tail: _PassPlan | None
    write: _WritePlan | None


class KVCanary:
    """Shadow records for the FULL and SWA pools of `kv_pool`.

    Args:
        mode: off | log | raise. `off` makes every method a no-op.
        kv_pool: the pools whose real K/V bytes are hashed.
        window: the SWA layers' window (the SWA group verifies only the last window).
        sweep_interval: steps between radix sweeps (0: never).
    """

    def __init__(self, mode: str, kv_pool: HybridKVPool, window: int, sweep_interval: int) -> None:
        if mode not in ("off", "log", "raise"):
            raise ValueError(f"kv_canary mode must be off|log|raise, got {mode!r}")
        self.mode = mode
        self.enabled = mode != "off"
        self.kv_pool = kv_pool
        self.window = window
        self.sweep_interval = sweep_interval
        device = kv_pool.full_to_swa_index_mapping.device
        self.device = device
        self.group_layers = {"FULL": kv_pool.group_layers(False), "SWA": kv_pool.group_layers(True)}
        self.groups = [g for g in GROUPS if self.group_layers[g]]
        rows = {"FULL": kv_pool.full_rows, "SWA": kv_pool.swa_rows}
        # [rows, 6] int64: token, prev_hash, position, prev_in, kv_sum, next_in (see the module
        # docstring); the zero record's next_in is `_chain`'s input of zeros, 0.
        self.records = {}
        for g in self.groups:
            records = torch.zeros(rows[g], _RECORD_WIDTH, dtype=torch.int64, device=device)
            records[:, _PREV_IN:_NEXT_IN].fill_(_ZERO_IN)
            self.records[g] = records
        self._next_in = {g: self.records[g][:, _NEXT_IN] for g in self.groups}  # column views
        self._row_ids = {g: torch.arange(rows[g], dtype=torch.int64, device=device) for g in self.groups}
        # A slot's K/V bytes of every layer of a group are one row of the group's buffer, read as
        # int64 words and folded with odd weights (the order: layer, then K before V).
        self._kv_words = {}
        for g in self.groups:
            buf = kv_pool.group_kv(g == "SWA")
            self._kv_words[g] = buf.view(buf.shape[0], -1).view(torch.int64)  # a view: live bytes
        self._kv_weights = {
            g: (torch.arange(self._kv_words[g].shape[1], dtype=torch.int64, device=device) * 2 + 1) * _M3
            for g in self.groups
        }
        # A record whose next_in is the chain seed's: the predecessor of every position 0.
        self._seed_record = torch.zeros(1, _RECORD_WIDTH, dtype=torch.int64, device=device)
        self._seed_record[0, _NEXT_IN] = _SEED_IN
        self._plan: _StepPlan | None = None
        self._tail_memo: tuple[tuple, _PassPlan | None] | None = None
        self._static_grids: dict[tuple, tuple] = {}
        self._pending: list[_Pending] = []
        self._oracle: dict[str, int] = {}
        self._host_violations: list[CanaryViolation] = []
        self.stats = {"verify_full": 0, "verify_swa": 0, "sweep_passes": 0, "writes": 0, "violations": 0}

    # ---- helpers ----------------------------------------------------------------------------

    def _rows(self, group: str, slots: torch.Tensor) -> torch.Tensor:
        # torch.take reads a 1-D tensor as `tensor[index]` does (negative from the end, out of
        # range raises), in fewer microseconds.
        if group == "SWA":
            return torch.take(self.kv_pool.full_to_swa_index_mapping, slots)
        return slots

    def _kv_sum(self, group: str, rows: torch.Tensor) -> torch.Tensor:
        """The real-KV fold of pool rows `rows` (as `_index_rows` returns them), before its
        splitmix: any change to one word changes it."""
        return self._kv_words[group].index_select(0, rows).mul_(self._kv_weights[group]).sum(dim=1)

    def _index_rows(self, group: str, rows: torch.Tensor) -> torch.Tensor:
        """`rows` for `index_select` on the group's records and KV words (both one row per pool
        row), through the identity table of the pool's rows: a negative row counts from the end,
        as `tensor[rows]` would read it (an unmapped SWA peer, -1, reads the last row), and one
        outside the pool raises as it would. `index_select` copies whole rows; `tensor[rows]` is
        several times slower on wide ones."""
        return torch.take(self._row_ids[group], rows)

    def _to_device(self, host: np.ndarray | torch.Tensor) -> torch.Tensor:
        """A host array or CPU tensor on the canary's device. On CUDA through pinned memory and
        a non-blocking copy: a copy from pageable memory would synchronize the stream."""
        tensor = torch.from_numpy(host) if isinstance(host, np.ndarray) else host
        if self.device.type == "cpu":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    # ---- the step's plan ------------------------------------------------------------------------

    def _step_plan(self, reqs: list[CanaryRequest], req_to_token: torch.Tensor) -> _StepPlan:
        """The plan of the step whose batch is `reqs` (the same list for HEAD, write and TAIL)."""
        columns = req_to_token.shape[1]
        plan = self._plan
        if plan is None or plan.reqs is not reqs or plan.columns != columns:
            plan = self._plan = self._build_plan(reqs, columns)
        return plan

    def _build_plan(self, reqs: list[CanaryRequest], columns: int) -> _StepPlan:
        """The step's plan: per-request values on the host (Python ints: a batch is a few
        requests), one small tensor of them to the device, the element grids built there.

        A decode's HEAD is the last step's TAIL (same rows, each prefix_len the last seq_len):
        its plan is reused.
        """
        rows = [r.row for r in reqs]
        prefix = [r.prefix_len for r in reqs]
        seq = [r.seq_len for r in reqs]
        memo = self._tail_memo
        head = memo[1] if memo is not None and memo[0] == (columns, rows, prefix) else None
        head_spec = None if head is not None else self._pass_spec(prefix, columns)
        tail_spec = self._pass_spec(seq, columns)
        write_ints, write_other = self._write_spec(reqs, rows, prefix, seq, columns, tail_spec)
        ints = [*(head_spec[0] if head_spec else ()), *(tail_spec[0] if tail_spec else ()), *write_ints]
        host = self._to_device(torch.tensor(ints, dtype=torch.int64)) if ints else None
        at = 0
        if head_spec is not None:
            head = self._pass_plan(head_spec, host[at:at + len(head_spec[0])], rows, columns)
            at += len(head_spec[0])
        tail = None
        if tail_spec is not None:
            tail = self._pass_plan(tail_spec, host[at:at + len(tail_spec[0])], rows, columns)
            at += len(tail_spec[0])
        self._tail_memo = ((columns, rows, seq), tail)
        write = None if write_other is None else self._write_plan(write_other, host[at:] if write_ints else None)
        return _StepPlan(reqs, columns, head, tail, write)

    def _pass_spec(self, upto: list[int], columns: int):
        """A pass over positions < `upto` (FULL all, SWA the last window), per group: (the ints
        its grids are built from, counts, widths, froms), or None if it has no element.

        The FULL grid's width is rounded up to `_FULL_WIDTH_STEP` columns: its element indices,
        positions and predecessors then stay the same over many decode steps of one batch."""
        window = self.window
        meta, counts, widths, lows = [], [], {}, {}
        for group in self.groups:
            if group == "FULL":
                lo, lens = [0] * len(upto), upto
                width = min(-(-max(lens) // _FULL_WIDTH_STEP) * _FULL_WIDTH_STEP, columns)
            else:
                lo = [u - window if u > window else 0 for u in upto]
                lens = [u - low for u, low in zip(upto, lo, strict=True)]
                width = max(lens)
            count = sum(lens)
            if count:
                meta += lens
                counts.append((group, count))
                widths[group], lows[group] = width, lo
        if not counts:
            return None
        if "SWA" in widths:
            meta += lows["SWA"]
        meta.append(0)  # the FULL grid's from
        return meta, counts, widths, lows

    def _pass_plan(self, spec, meta: torch.Tensor, rows: list[int], columns: int) -> _PassPlan:
        """A pass's grids on the device from its spec's ints (lens per group, then SWA's froms):
        one gather of each per-request value onto the elements, against the static grid."""
        _, counts, widths, lows = spec
        n_reqs = len(rows)
        present = [g for g, _ in counts]
        shape = tuple((g, widths[g]) for g in present)
        static = self._static_grid(rows, columns, shape)
        cols, lens_at, lo_at, row_base, col_past_0, predecessor = static
        valid = cols < meta.index_select(0, lens_at)
        lo = meta.index_select(0, lo_at)
        positions = cols + lo
        # Padding past the end of a row reads its last entry (never checked).
        clipped = positions.clamp(max=columns - 1) if max(lows.get("SWA", [0])) + widths.get("SWA", 0) > columns \
            else positions
        elements = row_base + clipped
        # A position's chain is checked against its predecessor when that is in range too: not in
        # a grid's column 0 unless that is position 0 (checked against the seed).
        chain_ok = (col_past_0 | (lo == 0)) if "SWA" in widths else None
        segments = [(g, n_reqs * widths[g]) for g in present]
        return _PassPlan(segments, counts, elements, positions, predecessor, valid, chain_ok,
                         [(g, widths[g], lows[g]) for g in present])

    def _static_grid(self, rows: list[int], columns: int, shape: tuple):
        """What a batch's passes of one grid shape share, per element (device tensors): its
        column, where its request's length and from sit in the pass's ints, its row's first
        flat req_to_token index, whether its column is past 0, and where its predecessor's
        next_in sits in the pass's records read (the element before it, or the seed's record,
        last, in a grid's column 0)."""
        key = (tuple(rows), columns, shape)
        cached = self._static_grids.get(key)
        if cached is not None:
            return cached
        if len(self._static_grids) > 64:
            self._static_grids.clear()
        n_reqs = len(rows)
        cols, lens_at, lo_at, row_base, predecessor = [], [], [], [], []
        n_meta = n_reqs * len(shape) + (n_reqs if dict(shape).get("SWA") is not None else 0)  # the 0
        start = 0
        for g, (group, width) in enumerate(shape):
            k = np.arange(width, dtype=np.int64)
            cols.append(np.tile(k, n_reqs))
            lens_at.append(np.repeat(np.arange(n_reqs, dtype=np.int64) + g * n_reqs, width))
            lo_at.append(np.repeat(np.arange(n_reqs, dtype=np.int64) + n_reqs * len(shape), width) if group == "SWA"
                         else np.full(n_reqs * width, n_meta, dtype=np.int64))  # the appended 0
            row_base.append(np.repeat(np.array(rows, dtype=np.int64) * columns, width))
            pred = np.arange(start, start + n_reqs * width, dtype=np.int64) - 1
            pred[::width] = -1
            predecessor.append(pred)
            start += n_reqs * width
        cols, lens_at, lo_at, row_base, predecessor = (np.concatenate(v) for v in (cols, lens_at, lo_at, row_base,
                                                                                   predecessor))
        predecessor[predecessor < 0] = start  # column 0: the seed
        predecessor = predecessor * _RECORD_WIDTH + _NEXT_IN
        cached = tuple(self._to_device(v) for v in (cols, lens_at, lo_at, row_base))
        cols_t = cached[0]
        cached = (*cached, cols_t > 0, self._to_device(predecessor))
        self._static_grids[key] = cached
        return cached

    def _write_spec(self, reqs: list[CanaryRequest], rows: list[int], prefix: list[int], seq: list[int],
                    columns: int, tail_spec):
        """A write's new positions, offset-major: (ints for the step's tensor, the rest), or
        ([], None) with nothing to write. A decode's indices are all ints; a longer extend's
        are numpy arrays (in the rest)."""
        n_reqs = len(rows)
        extend = [s - p for s, p in zip(seq, prefix, strict=True)]
        total = sum(extend)
        if total <= 0:
            return [], None
        max_extend = max(extend)
        m1, m2 = _M1 & _MASK64, _M2 & _MASK64
        seeds = [p - 1 if p > 0 else 0 for p in prefix]
        decode = max_extend == 1 and total == n_reqs
        if decode:
            owner, positions = range(n_reqs), prefix
        else:
            prefix_np = np.array(prefix, dtype=np.int64)
            tokens = np.fromiter((t for r in reqs for t in r.new_token_ids[: r.seq_len - r.prefix_len]),
                                 np.int64, total)
            owner, offset = _spans(np.zeros(n_reqs, dtype=np.int64), np.array(extend, dtype=np.int64))
            # Offset-major: the order in which one position at a time would write.
            order = np.lexsort((owner, offset))
            owner, offset, tokens = owner[order], offset[order], tokens[order]
            positions = prefix_np[owner] + offset
        # Where the seeds and the new positions sit among each group's TAIL elements (the fused
        # write + TAIL reads them there), if every one of them does. TAIL grid rows end at
        # seq_len, past every new position: the seed decides.
        in_tail = None
        if tail_spec is not None and len(tail_spec[1]) == len(self.groups):
            _, _, widths, lows = tail_spec
            if all(seed >= low for seed, low in zip(seeds, lows.get("SWA", seeds), strict=True)):
                in_tail = []
                for group in self.groups:
                    start = [i * widths[group] - low for i, low in enumerate(lows[group])]
                    in_tail.append([s + seed for s, seed in zip(start, seeds, strict=True)]
                                   + ([start[i] + p for i, p in zip(owner, positions, strict=True)] if decode
                                      else (np.array(start, dtype=np.int64)[owner] + positions).tolist()))
        if decode:
            tokens = [r.new_token_ids[0] for r in reqs]
            # What a record hands on adds tok * M1 + pos * M2 (mod 2**64) to its prev_hash * M0.
            ints = [r * columns + p for r, p in zip(rows, seeds, strict=True)]
            ints += [r * columns + p for r, p in zip(rows, prefix, strict=True)]
            ints += tokens + prefix + prefix + [_signed(t * m1 + p * m2) for t, p in zip(tokens, prefix, strict=True)]
            if in_tail is not None:
                ints += [i for part in in_tail for i in part]
            return ints, (n_reqs, total, 1, in_tail is not None, min(prefix) > 0, None)
        # Lane i of chain step j is request i at position prefix + j (padded lanes compute values
        # nothing reads).
        pad_tok = np.zeros((max_extend, n_reqs), dtype=np.int64)
        pad_tok[offset, owner] = tokens
        pad_pos = prefix_np[None, :] + np.arange(max_extend, dtype=np.int64)[:, None]
        step = (pad_tok.astype(np.uint64) * np.uint64(m1) + pad_pos.astype(np.uint64) * np.uint64(m2)).view(np.int64)
        rows_np = np.array(rows, dtype=np.int64)
        index = np.concatenate([rows_np * columns + np.array(seeds, dtype=np.int64), rows_np[owner] * columns + positions])
        lane = offset * n_reqs + owner if max_extend > 1 else (owner if total != n_reqs else None)
        arrays = (index, tokens, positions, prefix_np, step, lane, None if in_tail is None else np.array(in_tail))
        return [], (n_reqs, total, max_extend, in_tail is not None, min(prefix) > 0, arrays)

    def _write_plan(self, spec, ints: torch.Tensor | None) -> _WritePlan:
        n_reqs, total, max_extend, fused, all_prefixed, arrays = spec
        n_groups = len(self.groups)
        if arrays is None:  # a decode: the step's ints
            sizes = [2 * n_reqs, n_reqs, n_reqs, n_reqs, n_reqs] + ([n_groups * 2 * n_reqs] if fused else [])
            index, tokens, positions, prefix, step, *rest = ints.split(sizes)
            return _WritePlan(n_reqs, total, 1, index, tokens, positions, prefix > 0, step.view(1, n_reqs), None,
                              rest[0].view(n_groups, 2 * n_reqs) if fused else None, all_prefixed)
        index, tokens, positions, prefix, step, lane, in_tail = (
            None if a is None else self._to_device(np.ascontiguousarray(a, dtype=np.int64))
            for a in arrays)
        return _WritePlan(n_reqs, total, max_extend, index, tokens, positions, prefix > 0, step, lane, in_tail,
                          all_prefixed)

    # ---- write ------------------------------------------------------------------------------

    def note_sampled(self, rid: str, token_id: int) -> None:
        """The token oracle: what request `rid` must write next (noted at the sampler exit)."""
        if self.enabled:
            self._oracle[rid] = token_id

    def forget(self, rid: str, last_token: int | None = None, position: int = -1, step: int = 0) -> None:
        """Drop `rid`'s token oracle at its finish. Its last sampled token is never written to
        KV, so `write` never checks it: `last_token` (what the request answers with) is checked
        here instead (`write_token`, phase FINISH; no slot: -1)."""
        expected = self._oracle.pop(rid, None)
        if expected is not None and last_token is not None and last_token != expected:
            self._host_violations.append(
                CanaryViolation("write_token", "FULL", "FINISH", -1, -1, position, rid, last_token,
                                expected, step))

    def write(self, reqs: list[CanaryRequest], req_to_token: torch.Tensor, step: int) -> None:
        """Record the new positions of every request (after the forward wrote their KV).

        Each record's prev_hash is the running chain from the record at prefix_len - 1 (the seed
        slot), read before anything is written; its kv_sum folds the slot's bytes as they are
        now. All requests and groups in one pass, the new positions in (offset, request) order,
        so where two of them share a row the later one wins, as one position at a time would.
        """
        if not self.enabled or not reqs:
            return
        self._check_oracle(reqs, req_to_token, step)
        plan = self._step_plan(reqs, req_to_token).write
        if plan is None:
            return
        slots = req_to_token.reshape(-1).index_select(0, plan.index).to(torch.int64)  # seed slots, new slots
        self._write_records(plan, [self._rows(group, slots) for group in self.groups])

    def write_and_verify_tail(self, reqs: list[CanaryRequest], req_to_token: torch.Tensor, step: int) -> None:
        """`write`, then `verify("TAIL")`, reading req_to_token, the mapping and the KV bytes
        once for both: nothing runs between the two that could change them (the records,
        which the write changes, are read after it). Where a seed or new position is not a TAIL
        element (a prefill longer than the window), the two run one after the other."""
        if not self.enabled or not reqs:
            return
        step_plan = self._step_plan(reqs, req_to_token)
        plan, tail = step_plan.write, step_plan.tail
        if plan is None or plan.in_tail is None:
            self.write(reqs, req_to_token, step)
            self.verify("TAIL", reqs, req_to_token, step)
            return
        self._check_oracle(reqs, req_to_token, step)
        slots = req_to_token.reshape(-1).index_select(0, tail.elements).to(torch.int64)
        reads = self._read_pass(self._segments(tail, slots), check_kv=True)
        where = [rows.index_select(0, at) for (_, rows, _, _), at in zip(reads, plan.in_tail, strict=True)]
        kv_sum = torch.stack([kv.index_select(0, at[plan.n_reqs:])
                              for (_, _, _, kv), at in zip(reads, plan.in_tail, strict=True)])
        self._write_records(plan, where, kv_sum)
        self._check_pass("TAIL", reads, slots, tail.positions, tail.predecessor, tail.valid, tail.chain_ok,
                         rids=[r.rid for r in reqs], request_of=tail.request_of, counts=tail.counts)

    def _check_oracle(self, reqs: list[CanaryRequest], req_to_token: torch.Tensor, step: int) -> None:
        for req in reqs:
            expected = self._oracle.pop(req.rid, None)
            if expected is not None and req.new_token_ids and req.new_token_ids[0] != expected:
                slot = int(req_to_token[req.row, req.prefix_len])
                self._host_violations.append(
                    CanaryViolation("write_token", "FULL", "WRITE", slot, slot, req.prefix_len,
                                    req.rid, req.new_token_ids[0], expected, step)
                )

    def _write_records(self, plan: _WritePlan, group_rows: list[torch.Tensor],
                       kv_sum: torch.Tensor | None = None) -> None:
        """Write the plan's records. group_rows: per group, the pool rows of the seed slots then
        of the new slots; kv_sum: `[groups, total]`, the new rows' folds (None: read here)."""
        n_reqs, total, n_groups = plan.n_reqs, plan.total, len(self.groups)
        # What each seed record hands on (or the chain seed, at position 0): the first prev_in.
        seed = torch.stack([self._next_in[g][r[:n_reqs]] for g, r in zip(self.groups, group_rows, strict=True)])
        prev_in = seed if plan.all_prefixed else torch.where(plan.has_prefix, seed, _SEED_IN)  # [groups, reqs]
        chain = []  # per chain step: prev_in, prev_hash, next_in
        for j in range(plan.max_extend):
            prev_hash = _mix(prev_in)
            next_in = torch.add(plan.step_in[j], prev_hash, alpha=_M0)
            chain.append((prev_in, prev_hash, next_in))
            prev_in = next_in
        if plan.max_extend > 1:
            width = plan.max_extend * n_reqs
            prev_in, prev_hash, next_in = torch.stack(
                [torch.stack(column, dim=1) for column in zip(*chain, strict=True)]
            ).view(3, n_groups, width)[:, :, plan.lane]
        else:
            prev_in, prev_hash, next_in = chain[0]
            if plan.lane is not None:
                prev_in, prev_hash, next_in = prev_in[:, plan.lane], prev_hash[:, plan.lane], next_in[:, plan.lane]
        if kv_sum is None and total < 64:  # a few rows: advanced indexing beats normalising them
            kv_sum = torch.stack([(self._kv_words[g][r[n_reqs:]] * self._kv_weights[g]).sum(dim=1)
                                  for g, r in zip(self.groups, group_rows, strict=True)])
        elif kv_sum is None:
            kv_sum = torch.stack([self._kv_sum(g, self._index_rows(g, r[n_reqs:]))
                                  for g, r in zip(self.groups, group_rows, strict=True)])
        record = torch.stack([plan.tokens.expand(n_groups, total), prev_hash,
                              plan.positions.expand(n_groups, total), prev_in, kv_sum, next_in], dim=2)
        for g, (group, r) in enumerate(zip(self.groups, group_rows, strict=True)):
            self.records[group].index_copy_(0, r[n_reqs:], record[g])
        self.stats["writes"] += total

    # ---- verify -----------------------------------------------------------------------------

    def verify(self, phase: str, reqs: list[CanaryRequest], req_to_token: torch.Tensor, step: int) -> None:
        """HEAD (before the forward: positions < prefix_len) or TAIL (after: < seq_len).

        FULL verifies every prefix position, SWA only the last window; a position's chain is
        checked against its predecessor when that is in range too (or it is position 0).
        """
        if not self.enabled or not reqs:
            return
        plan = self._step_plan(reqs, req_to_token)
        plan = plan.head if phase == "HEAD" else plan.tail
        if plan is None:
            return
        slots = req_to_token.reshape(-1).index_select(0, plan.elements).to(torch.int64)
        self._verify_pass(phase, self._segments(plan, slots), slots, plan.positions, plan.predecessor, plan.valid,
                          plan.chain_ok, check_kv=(phase == "TAIL"), rids=[r.rid for r in reqs],
                          request_of=plan.request_of, counts=plan.counts)

    @staticmethod
    def _segments(plan: _PassPlan, slots: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        parts, at = [], 0
        for group, n in plan.segments:
            parts.append((group, slots[at:at + n]))
            at += n
        return parts

    def sweep(self, cached_paths: list, step: int) -> None:
        """Verify every slot the radix cache holds (chain, position and real-KV hash).

        Tombstoned positions have no SWA peer: the SWA group masks them out (fixed shapes, so
        the sweep reads nothing back) rather than filtering them away.
        """
        if not self.enabled or not cached_paths:
            return
        self.stats["sweep_passes"] += 1
        paths = [p for p in cached_paths if p.slots.numel()]
        if not paths:
            return
        n_groups = len(self.groups)
        lens = np.fromiter((p.slots.numel() for p in paths), np.int64, len(paths))
        _, positions = _spans(np.zeros_like(lens), lens)
        n = positions.size
        positions = np.tile(positions, n_groups)
        predecessor = np.where(positions == 0, n * n_groups, np.arange(-1, n * n_groups - 1, dtype=np.int64))
        predecessor = predecessor * _RECORD_WIDTH + _NEXT_IN
        slots = torch.cat([p.slots for p in paths])
        slots = slots if slots.device == self.device else self._to_device(slots)
        check_chain = [torch.ones(n, dtype=torch.bool)]
        active = [torch.ones(n, dtype=torch.bool)]
        if "SWA" in self.groups:
            live = torch.cat([p.swa_live for p in paths])
            # A position's chain is checked when its predecessor is live too (or it is first).
            prev_index = torch.from_numpy(np.arange(n, dtype=np.int64) - (positions[:n] > 0))
            check_chain = check_chain[: n_groups - 1] + [live[prev_index] | torch.from_numpy(positions[:n] == 0)]
            active = active[: n_groups - 1] + [live]
        host = self._to_device(np.concatenate([positions, predecessor]))
        self._verify_pass("SWEEP", [(group, slots) for group in self.groups], slots.repeat(n_groups),
                          host[:n * n_groups], host[n * n_groups:], self._to_device(torch.cat(active)),
                          self._to_device(torch.cat(check_chain)), check_kv=True, rids=[], request_of=None)

    def _verify_pass(
        self,
        phase: str,
        segments: list[tuple[str, torch.Tensor]],
        slots: torch.Tensor,
        positions: torch.Tensor,
        predecessor: torch.Tensor,
        valid: torch.Tensor,
        chain_ok: torch.Tensor | None,
        *,
        check_kv: bool,
        rids: list[str],
        request_of: Callable[[], np.ndarray] | None,
        counts: list[tuple[str, int]] | None = None,
    ) -> None:
        """One pass over the elements of both groups.

        Args:
            segments: per group (in GROUPS order) the FULL slots of its elements. Within a group
                the elements of one request (or cached path) are consecutive positions, so an
                element's predecessor, wherever its chain is checked (position > the first one
                verified), is the element before it: same req_to_token entry, same pool row.
            slots, positions: per element of all groups, concatenated.
            predecessor: per element, where the next_in of the element it chains from sits
                in the records read, flattened, with the seed's record after them (position 0).
            valid: bool, which elements are checked at all (position, chain, real-KV).
            chain_ok: bool, which valid ones have their chain checked too (None: all).
            counts: per group, the elements the stats count (None: all of them).
        """
        reads = self._read_pass(segments, check_kv=check_kv)
        self._check_pass(phase, reads, slots, positions, predecessor, valid, chain_ok, rids=rids,
                         request_of=request_of, counts=counts)

    def _read_pass(self, segments: list[tuple[str, torch.Tensor]], *, check_kv: bool) -> list[tuple]:
        """Per group: (group, pool rows, rows for index_select or None, real-KV folds or None)."""
        reads = []
        for group, group_slots in segments:
            rows = self._rows(group, group_slots)
            if check_kv:
                index = self._index_rows(group, rows)
                reads.append((group, rows, index, self._kv_sum(group, index)))
            else:
                reads.append((group, rows, None, None))
        return reads

    def _check_pass(self, phase: str, reads: list[tuple], slots: torch.Tensor, positions: torch.Tensor,
                    predecessor: torch.Tensor, valid: torch.Tensor, chain_ok: torch.Tensor | None, *, rids: list[str],
                    request_of: Callable[[], np.ndarray] | None, counts: list[tuple[str, int]] | None = None) -> None:
        """Compare the records of `reads` (read now) with what they must hold; queue the result."""
        check_kv = reads[0][3] is not None
        stored = [self.records[group][rows] if index is None else self.records[group].index_select(0, index)
                  for group, rows, index, _ in reads]
        # The records read, then the seed's (predecessor n): what each element's predecessor
        # hands on is the prev_in the element must hold.
        stored = torch.cat([*stored, self._seed_record])
        expected_in = torch.take(stored, predecessor)
        stored = stored[:-1]
        columns = [positions, expected_in]
        if check_kv:
            columns.append(reads[0][3] if len(reads) == 1 else torch.cat([kv for _, _, _, kv in reads]))
        expected = torch.stack(columns, dim=1)
        # A position below a request's length never maps to the padding slot, or below it
        # (SGLang's canary skips slot 0; ours does not): whatever a damaged write left in slot
        # 0's record, it holds no position there. An SWA position inside the window must have a live peer, so
        # a released peer (row 0) fails too; the sweep only walks live (non-tombstone) positions.
        stored[:, _POSITION].masked_fill_(slots <= 0, _NO_POSITION)
        fails = stored[:, _POSITION:_POSITION + len(columns)] != expected
        fails &= valid.unsqueeze(1)
        if chain_ok is not None:
            fails[:, 1] &= chain_ok
        for group, count in counts or [(group, rows.numel()) for group, rows, _, _ in reads]:
            self.stats["verify_full" if group == "FULL" else "verify_swa"] += count
        segments = [(group, rows.numel()) for group, rows, _, _ in reads]
        self._pending.append(_Pending(phase, segments, fails.sum(), fails, stored, expected, slots,
                                      [rows for _, rows, _, _ in reads], rids, request_of))

    # ---- readout ------------------------------------------------------------------------------

    def pending_counts(self) -> torch.Tensor | None:
        """Failures per pending verification, stacked on the device (no host read).

        The engine reads it back together with the sampled tokens and hands the values to
        `collect`, so the canary adds no device-to-host copy of its own.
        """
        if not self._pending:
            return None
        return torch.stack([p.count for p in self._pending])

    def collect(self, step: int, counts: list[int] | None = None) -> list[CanaryViolation]:
        """Turn this step's failure masks into violations: per verification, per group, per
        reason (chain, position, real-KV), in element order.

        Args:
            counts: the host copy of `pending_counts()`; None reads it here (a host read). Masks
                are read back only for a verification that failed.
        """
        if not self.enabled:
            return []
        pending, self._pending = self._pending, []
        violations, self._host_violations = self._host_violations, []
        if pending:
            if counts is None:
                counts = torch.stack([p.count for p in pending]).tolist()
            for p, count in zip(pending, counts, strict=True):
                if count == 0:
                    continue
                fails, stored, expected = p.fails.tolist(), p.stored.tolist(), p.expected.tolist()
                slots, rows = p.slots.tolist(), [r for part in p.rows for r in part.tolist()]
                request_of = p.request_of().tolist() if p.request_of is not None else None
                start = 0
                for group, n in p.segments:
                    for reason, column, stored_column, mix_stored, mix_expected in _COLUMNS[: len(expected[0])]:
                        for i in range(start, start + n):
                            if not fails[i][column]:
                                continue
                            stored_value, expected_value = stored[i][stored_column], expected[i][column]
                            violations.append(
                                CanaryViolation(
                                    reason, group, p.phase, slots[i], rows[i], expected[i][0],
                                    p.rids[request_of[i]] if request_of is not None else "",
                                    _splitmix_int(stored_value) if mix_stored else stored_value,
                                    _splitmix_int(expected_value) if mix_expected else expected_value,
                                    step,
                                )
                            )
                    start += n
        self.stats["violations"] += len(violations)
        return violations
