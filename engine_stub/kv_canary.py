"""KV canary: per-slot shadow records that prove every slot a forward reads holds what it should.

For each pool (FULL, SWA) a record per slot row: (token, position, prev_hash, kv_hash).
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
`collect()` reads a mask only for a (verification, reason) that failed.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """One verification's failure masks, kept as device tensors until `collect()`."""

    phase: str
    group: str
    failed: dict[str, torch.Tensor]  # reason -> bool [n]
    stored: dict[str, torch.Tensor]
    expected: dict[str, torch.Tensor]
    slots: torch.Tensor
    rows: torch.Tensor
    positions: torch.Tensor
    rids: list[str]  # per request of the verification (empty for a sweep)
    request_of: torch.Tensor | None  # per element: its index into `rids`


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
        # [rows, 4] int64: token, position, prev_hash, kv_hash.
        self.records = {g: torch.zeros(rows[g], 4, dtype=torch.int64, device=device) for g in self.groups}
        self._pending: list[_Pending] = []
        self._oracle: dict[str, int] = {}
        self._host_violations: list[CanaryViolation] = []
        self.stats = {"verify_full": 0, "verify_swa": 0, "sweep_passes": 0, "writes": 0, "violations": 0}

    # ---- helpers ----------------------------------------------------------------------------

    def _rows(self, group: str, slots: torch.Tensor) -> torch.Tensor:
        if group == "SWA":
            return self.kv_pool.full_to_swa_index_mapping[slots]
        return slots

    def _kv_hash(self, group: str, rows: torch.Tensor) -> torch.Tensor:
        # A linear fold with odd weights: any change to one 64-bit word changes the sum.
        words = [
            buf[rows].reshape(rows.numel(), -1).view(torch.int64)
            for layer in self.group_layers[group]
            for buf in (self.kv_pool.k_buffer[layer], self.kv_pool.v_buffer[layer])
        ]
        flat = torch.cat(words, dim=1)
        weights = (torch.arange(flat.shape[1], dtype=torch.int64, device=self.device) * 2 + 1) * _MIX_MULTIPLIERS[3]
        return _splitmix((flat * weights).sum(dim=1))

    # ---- write ------------------------------------------------------------------------------

    def note_sampled(self, rid: str, token_id: int) -> None:
        """The token oracle: what request `rid` must write next (noted at the sampler exit)."""
        if self.enabled:
            self._oracle[rid] = token_id

    def forget(self, rid: str) -> None:
        self._oracle.pop(rid, None)

    def write(self, reqs: list[CanaryRequest], req_to_token: torch.Tensor, step: int) -> None:
        """Record the new positions of every request (after the forward wrote their KV)."""
        if not self.enabled or not reqs:
            return
        for req in reqs:
            expected = self._oracle.pop(req.rid, None)
            if expected is not None and req.new_token_ids and req.new_token_ids[0] != expected:
                slot = int(req_to_token[req.row, req.prefix_len])
                self._host_violations.append(
                    CanaryViolation("write_token", "FULL", "WRITE", slot, slot, req.prefix_len,
                                    req.rid, req.new_token_ids[0], expected, step)
                )
        rows_t = torch.tensor([r.row for r in reqs], device=self.device)
        max_extend = max(r.seq_len - r.prefix_len for r in reqs)
        for group in self.groups:
            records = self.records[group]
            # The running hash is seeded from the record at prefix_len - 1 (the seed slot).
            seed_pos = torch.tensor([max(r.prefix_len - 1, 0) for r in reqs], device=self.device)
            seed_rows = self._rows(group, req_to_token[rows_t, seed_pos].to(torch.int64))
            seed = records[seed_rows]
            prev = _chain(seed[:, 2], seed[:, 0], seed[:, 1])
            has_prefix = torch.tensor([r.prefix_len > 0 for r in reqs], device=self.device)
            prev = torch.where(has_prefix, prev, torch.full_like(prev, _CHAIN_SEED))
            for j in range(max_extend):
                active = [i for i, r in enumerate(reqs) if r.prefix_len + j < r.seq_len]
                idx = torch.tensor(active, device=self.device)
                pos = torch.tensor([reqs[i].prefix_len + j for i in active], device=self.device)
                tok = torch.tensor([reqs[i].new_token_ids[j] for i in active], device=self.device)
                slots = req_to_token[rows_t[idx], pos].to(torch.int64)
                rows = self._rows(group, slots)
                kvh = self._kv_hash(group, rows)
                record = torch.stack([tok, pos, prev[idx], kvh], dim=1)
                records.index_copy_(0, rows, record)
                prev = prev.index_copy(0, idx, _chain(prev[idx], tok, pos))
        self.stats["writes"] += sum(r.seq_len - r.prefix_len for r in reqs)

    # ---- verify -----------------------------------------------------------------------------

    def verify(self, phase: str, reqs: list[CanaryRequest], req_to_token: torch.Tensor, step: int) -> None:
        """HEAD (before the forward: positions < prefix_len) or TAIL (after: < seq_len)."""
        if not self.enabled or not reqs:
            return
        device = self.device
        upto = [r.prefix_len if phase == "HEAD" else r.seq_len for r in reqs]
        rows = torch.tensor([r.row for r in reqs], device=device)
        for group in self.groups:
            # FULL verifies every prefix position, SWA only the last window.
            lo = [0] * len(reqs) if group == "FULL" else [max(0, u - self.window) for u in upto]
            lens = [u - low for u, low in zip(upto, lo, strict=True)]
            total = sum(lens)
            if not total:
                continue
            lo_t = torch.tensor(lo, device=device)
            lens_t = torch.tensor(lens, device=device)
            request_of = torch.repeat_interleave(torch.arange(len(reqs), device=device), lens_t,
                                                 output_size=total)
            first_of_request = torch.cumsum(lens_t, 0) - lens_t
            positions = torch.arange(total, device=device) - first_of_request[request_of] + lo_t[request_of]
            element_rows = rows[request_of]
            slots = req_to_token[element_rows, positions].to(torch.int64)
            prev_slots = req_to_token[element_rows, (positions - 1).clamp(min=0)].to(torch.int64)
            # A position's chain is checked against its predecessor when that is in range too.
            check_chain = (positions == 0) | (positions > lo_t[request_of])
            self._verify_slots(phase, group, slots, positions, prev_slots, check_chain,
                               ([r.rid for r in reqs], request_of), check_kv=(phase == "TAIL"), step=step)

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
        slots = torch.cat([p.slots for p in paths]).to(self.device)
        positions = torch.cat([torch.arange(p.slots.numel()) for p in paths]).to(self.device)
        prev_slots = torch.cat([p.slots[(torch.arange(p.slots.numel()) - 1).clamp(min=0)] for p in paths]).to(self.device)
        for group in self.groups:
            if group == "FULL":
                live = torch.ones_like(slots, dtype=torch.bool)
                chain = torch.ones_like(live)
            else:
                live = torch.cat([p.swa_live for p in paths]).to(self.device)
                # A position's chain is checked when its predecessor is live too (or it is first).
                prev_live = torch.cat([torch.cat([torch.ones(1, dtype=torch.bool), p.swa_live[:-1]]) for p in paths])
                chain = prev_live.to(self.device) | (positions == 0)
            self._verify_slots("SWEEP", group, slots, positions, prev_slots, chain, None,
                               check_kv=True, step=step, active=live)

    def _verify_slots(
        self,
        phase: str,
        group: str,
        slots: torch.Tensor,
        positions: torch.Tensor,
        prev_slots: torch.Tensor,
        check_chain: torch.Tensor,
        requests: tuple[list[str], torch.Tensor] | None,
        *,
        check_kv: bool,
        step: int,
        active: torch.Tensor | None = None,
    ) -> None:
        records = self.records[group]
        rows = self._rows(group, slots)
        # A zeroed req_to_token entry reads the padding slot and is skipped. An SWA position
        # inside the window must have a live peer, so there a released peer (row 0) is checked
        # and fails; the sweep only walks live (non-tombstone) positions.
        checked = slots > 0
        if active is not None:
            checked &= active
        stored = records[rows]
        prev = records[self._rows(group, prev_slots)]
        expected_prev = torch.where(
            positions == 0, torch.full_like(positions, _CHAIN_SEED), _chain(prev[:, 2], prev[:, 0], prev[:, 1])
        )
        failed = {
            "verify_chain_hash": checked & check_chain & (stored[:, 2] != expected_prev),
            "verify_position": checked & (stored[:, 1] != positions),
        }
        stored_values = {"verify_chain_hash": stored[:, 2], "verify_position": stored[:, 1]}
        expected_values = {"verify_chain_hash": expected_prev, "verify_position": positions}
        if check_kv:
            actual = self._kv_hash(group, rows)
            failed["verify_real_kv_hash"] = checked & (stored[:, 3] != actual)
            stored_values["verify_real_kv_hash"] = stored[:, 3]
            expected_values["verify_real_kv_hash"] = actual
        self.stats["verify_full" if group == "FULL" else "verify_swa"] += int(slots.numel())
        self._pending.append(
            _Pending(phase, group, failed, stored_values, expected_values, slots, rows, positions,
                     *(requests or ([], None)))
        )

    # ---- readout ------------------------------------------------------------------------------

    def pending_counts(self) -> torch.Tensor | None:
        """Failures per pending (verification, reason), stacked on the device (no host read).

        The engine reads it back together with the sampled tokens and hands the values to
        `collect`, so the canary adds no device-to-host copy of its own.
        """
        if not self._pending:
            return None
        return torch.stack([m.sum() for p in self._pending for m in p.failed.values()])

    def collect(self, step: int, counts: list[int] | None = None) -> list[CanaryViolation]:
        """Turn this step's failure masks into violations.

        Args:
            counts: the host copy of `pending_counts()`; None reads it here (a host read). Masks
                are read back only for a (verification, reason) that failed.
        """
        if not self.enabled:
            return []
        pending, self._pending = self._pending, []
        violations, self._host_violations = self._host_violations, []
        if pending:
            if counts is None:
                counts = torch.stack([m.sum() for p in pending for m in p.failed.values()]).tolist()
            it = iter(counts)
            for p in pending:
                for reason, mask in p.failed.items():
                    if next(it) == 0:
                        continue
                    for i in mask.nonzero().flatten().tolist():
                        violations.append(
                            CanaryViolation(
                                reason, p.group, p.phase, int(p.slots[i]), int(p.rows[i]),
                                int(p.positions[i]),
                                p.rids[int(p.request_of[i])] if p.request_of is not None else "",
                                int(p.stored[reason][i]),
                                int(p.expected[reason][i]), step,
                            )
                        )
        self.stats["violations"] += len(violations)
        return violations
