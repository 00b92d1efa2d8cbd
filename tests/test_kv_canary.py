"""The KV canary catches planted damage at the right slot, position and request, and nothing else.

Each test drives `engine.scheduler.step()` directly (no engine thread), so damage lands between
two known steps; violations are read back from the durable event log, as the harness reads them.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine_stub.config import EngineConfig
from engine_stub.engine import Engine
from engine_stub.events import read_events
from engine_stub.kv_canary import (
    _CHAIN_SEED,
    _MIX_MULTIPLIERS,
    _SEED_IN,
    _ZERO_IN,
    GROUPS,
    REASONS,
    CanaryRequest,
    CanaryViolation,
    _chain,
    _splitmix,
    _splitmix_int,
    _unsplitmix_int,
)
from engine_stub.mem.kv_pool import HybridKVPool
from engine_stub.model import VOCAB_SIZE
from engine_stub.req import Req
from engine_stub.scheduler import CanaryRaised

WINDOW = 8
PATTERN = "SFSS"


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    eng = Engine(
        EngineConfig(device="cpu", window=WINDOW, layer_pattern=PATTERN, kv_canary="log",
                     full_pool_tokens=512, swa_pool_tokens=128, max_context_len=256,
                     kv_canary_sweep_interval=4, event_log=str(tmp_path / "events.jsonl")),
        exit_on_crash=False,
    )
    yield eng
    eng.stop(drain_timeout_s=0)


def _add(engine: Engine, rid: str, prompt_len: int, max_new_tokens: int) -> Req:
    rng = random.Random(rid)
    req = Req(rid, [rng.randrange(VOCAB_SIZE) for _ in range(prompt_len)], max_new_tokens)
    engine.scheduler.add_request(req)
    return req


def _steps(engine: Engine, n: int) -> None:
    for _ in range(n):
        engine.scheduler.step()


def _violations(engine: Engine, step: int | None = None) -> list[dict]:
    events = read_events(engine.events.path)
    return [e for e in events if e["kind"] == "canary_violation" and (step is None or e["step"] == step)]


def _slot(engine: Engine, req: Req, position: int) -> int:
    return int(engine.scheduler.req_to_token_pool.req_to_token[req.row, position])


def _two_decoding(engine: Engine) -> tuple[Req, Req]:
    """Two requests of different lengths, decoding well past one window (SWA peers recycled)."""
    a = _add(engine, "a", 20, 40)
    b = _add(engine, "b", 27, 40)
    _steps(engine, 1 + 2 * WINDOW)
    assert a.kv_len > a.prompt_len + WINDOW and b.kv_len > b.prompt_len + WINDOW
    assert engine.scheduler.stats["swa_evicted_tokens"] > 0
    assert _violations(engine) == []
    return a, b


@pytest.mark.parametrize(
    ("where", "groups"),
    [
        ("out_of_window", {"FULL"}),  # only the full group reads that position
        ("in_window", {"FULL", "SWA"}),  # both groups read it
    ],
)
def test_wrong_slot_in_req_to_token_reports_slot_position_and_request(
    engine: Engine, where: str, groups: set[str]
) -> None:
    a, b = _two_decoding(engine)
    position = 5 if where == "out_of_window" else a.kv_len - 3
    wrong = _slot(engine, b, b.kv_len - 2)  # another live request's slot, in its window
    engine.scheduler.req_to_token_pool.req_to_token[a.row, position] = wrong
    step = engine.scheduler.step_no + 1
    _steps(engine, 1)

    hits = [v for v in _violations(engine, step)
            if v["slot"] == wrong and v["position"] == position and v["request"] == "a"]
    assert {v["reason"] for v in hits} >= {"verify_position"}
    assert {v["reason"] for v in hits} <= {"verify_position", "verify_chain_hash"}
    assert {v["group"] for v in hits if v["phase"] == "HEAD"} == groups
    position_hit = next(v for v in hits if v["reason"] == "verify_position")
    assert (position_hit["stored"], position_hit["expected"]) == (b.kv_len - 3, position)
    assert "fail_reason=verify_position" in position_hit["line"]
    # Nothing is blamed on the undamaged request.
    assert all(v["request"] in ("a", "") for v in _violations(engine, step))


def test_zeroed_req_to_token_entry_fails_position_and_next_chain_link(engine: Engine) -> None:
    a, _ = _two_decoding(engine)
    position = 6
    engine.scheduler.req_to_token_pool.req_to_token[a.row, position] = 0  # the padding slot
    step = engine.scheduler.step_no + 1
    _steps(engine, 1)
    violations = _violations(engine, step)
    found = {(v["reason"], v["position"], v["request"]) for v in violations}
    # A position below the request's length never maps to the padding slot (SGLang's canary
    # skips slot 0, ours fails it), and its successor's chain no longer links.
    assert ("verify_position", position, "a") in found
    assert ("verify_chain_hash", position + 1, "a") in found
    assert all(v["stored"] == -1 for v in violations if v["reason"] == "verify_position")


@pytest.mark.parametrize("group", ["FULL", "SWA"])
def test_flipped_kv_byte_gives_real_kv_hash_violation_in_tail(engine: Engine, group: str) -> None:
    a, _ = _two_decoding(engine)
    position = a.kv_len - 2  # live in both pools
    slot = _slot(engine, a, position)
    layer = PATTERN.index("F" if group == "FULL" else "S")
    pool = engine.scheduler.kv_pool
    row = int(pool.rows_of(layer, torch.tensor([slot]))[0])
    raw = pool.k_buffer[layer][row].view(torch.uint8)  # float64 row as bytes
    raw[0, 0] ^= 0x01  # the lowest mantissa byte: a small, finite change
    step = engine.scheduler.step_no + 1
    _steps(engine, 1)

    violations = _violations(engine, step)
    assert violations, "a flipped KV byte went unnoticed"
    assert {(v["phase"], v["group"], v["reason"]) for v in violations} == {
        ("TAIL", group, "verify_real_kv_hash")
    }
    (hit,) = violations
    assert (hit["slot"], hit["pool_row"], hit["position"], hit["request"]) == (slot, row, position, "a")


def test_flipped_byte_of_cached_slot_is_caught_by_sweep(engine: Engine) -> None:
    short = _add(engine, "short", 12, 12)
    _add(engine, "long", 16, 60)
    while short.finish_reason is None:
        _steps(engine, 1)
    tree = engine.scheduler.tree_cache
    assert tree is not None and tree.total_size() > 0
    cached = tree.cached_paths()[0].slots
    slot = int(cached[3])
    layer = PATTERN.index("F")
    engine.scheduler.kv_pool.v_buffer[layer][slot].view(torch.uint8)[1, 2] ^= 0x10
    interval = engine.config.kv_canary_sweep_interval
    _steps(engine, interval)
    sweeps = [v for v in _violations(engine) if v["phase"] == "SWEEP"]
    assert sweeps
    assert {(v["reason"], v["group"], v["slot"], v["position"], v["request"]) for v in sweeps} == {
        ("verify_real_kv_hash", "FULL", slot, 3, "")
    }


def test_token_oracle_mismatch_gives_write_token(engine: Engine) -> None:
    a, _ = _two_decoding(engine)
    actual = a.output_ids[-1]
    wrong = (actual + 1) % VOCAB_SIZE
    engine.scheduler.canary.note_sampled("a", wrong)
    position = a.kv_len
    step = engine.scheduler.step_no + 1
    _steps(engine, 1)
    violations = _violations(engine, step)
    assert [(v["reason"], v["phase"], v["request"], v["position"], v["stored"], v["expected"])
            for v in violations] == [("write_token", "WRITE", "a", position, actual, wrong)]


@pytest.mark.parametrize(("page_size", "radix_cache"), [(1, True), (1, False), (4, True)])
def test_clean_run_has_no_violations_and_verifies_less_swa_than_full(
    tmp_path: Path, page_size: int, radix_cache: bool
) -> None:
    eng = Engine(
        EngineConfig(device="cpu", window=WINDOW, page_size=page_size, kv_canary="log",
                     radix_cache=radix_cache, full_pool_tokens=512, swa_pool_tokens=128,
                     max_context_len=256, kv_canary_sweep_interval=3,
                     event_log=str(tmp_path / "events.jsonl")),
        exit_on_crash=False,
    )
    try:
        shared = [random.Random(0).randrange(VOCAB_SIZE) for _ in range(20)]
        for i in range(6):
            suffix = [random.Random(i).randrange(VOCAB_SIZE) for _ in range(3 + i)]
            eng.scheduler.add_request(Req(f"r{i}", shared + suffix if i % 2 else suffix * 4, 20))
        while eng.scheduler.has_work:
            eng.scheduler.step()
        stats = eng.scheduler.canary.stats
        assert _violations(eng) == []
        assert stats["violations"] == 0
        assert 0 < stats["verify_swa"] < stats["verify_full"]
        assert stats["writes"] > 0
        if radix_cache:
            assert stats["sweep_passes"] > 0
    finally:
        eng.stop(drain_timeout_s=0)


def test_raise_mode_raises_with_the_violations(tmp_path: Path) -> None:
    eng = Engine(
        EngineConfig(device="cpu", window=WINDOW, kv_canary="raise", full_pool_tokens=512,
                     swa_pool_tokens=128, max_context_len=256, event_log=str(tmp_path / "e.jsonl")),
        exit_on_crash=False,
    )
    try:
        a, b = _add(eng, "a", 20, 30), _add(eng, "b", 24, 30)
        _steps(eng, 4)
        eng.scheduler.req_to_token_pool.req_to_token[a.row, 2] = _slot(eng, b, 9)
        with pytest.raises(CanaryRaised) as info:
            _steps(eng, 1)
        assert any(v.reason == "verify_position" and v.request == "a" for v in info.value.violations)
        assert "kv_canary violation: launch_tag=HEAD_FULL" in str(info.value)
        # The violations were logged durably before the raise.
        assert len(_violations(eng)) == len(info.value.violations)
    finally:
        eng.scheduler.running.clear()
        eng.stop(drain_timeout_s=0)


def test_off_mode_records_nothing(tmp_path: Path) -> None:
    eng = Engine(EngineConfig(device="cpu", window=WINDOW, kv_canary="off",
                              event_log=str(tmp_path / "e.jsonl")), exit_on_crash=False)
    try:
        a = _add(eng, "a", 20, 12)
        _steps(eng, 3)
        eng.scheduler.req_to_token_pool.req_to_token[a.row, 2] = 0
        _steps(eng, 1)
        assert _violations(eng) == []
        assert eng.scheduler.canary.stats == dict.fromkeys(eng.scheduler.canary.stats, 0)
    finally:
        eng.scheduler.running.clear()
        eng.stop(drain_timeout_s=0)


def test_violation_log_line_has_the_frozen_format() -> None:
    v = CanaryViolation("verify_position", "SWA", "HEAD", 17, 5, 9, "req-1", 3, 9, 42)
    assert v.log_line() == (
        "kv_canary violation: launch_tag=HEAD_SWA fail_reason=verify_position slot_idx=17 "
        "pool_row=5 position=9 request=req-1 stored=0x3 expected=0x9 step=42"
    )
    assert v.to_dict()["reason"] in REASONS


# ---- the batched canary against the per-position one it replaced -------------------------------


def test_splitmix_inverse_and_the_unwritten_record() -> None:
    values = torch.tensor([0, 1, -1, _CHAIN_SEED, 2**62 + 12345, -(2**63)], dtype=torch.int64)
    for value in values.tolist():
        x = _unsplitmix_int(value)
        assert _splitmix_int(x) == value == int(_splitmix(torch.tensor([x]))[0])
    # An unwritten record reads as the all-zero record: prev_hash 0, kv_hash 0.
    assert _splitmix_int(_ZERO_IN) == 0 and _splitmix_int(_SEED_IN) == _CHAIN_SEED


@dataclass
class _RefPending:
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


class _LoopCanary:
    """The canary as it was before batching (per group, per position), kept verbatim as the
    oracle of the batched one: same calls, same violations.

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
        self._pending: list[_RefPending] = []
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

    def forget(self, rid: str, last_token: int | None = None, position: int = -1, step: int = 0) -> None:
        expected = self._oracle.pop(rid, None)
        if expected is not None and last_token is not None and last_token != expected:
            self._host_violations.append(CanaryViolation("write_token", "FULL", "FINISH", -1, -1, position,
                                                         rid, last_token, expected, step))

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
        # A position never maps to the padding slot (or below it): such a read holds no
        # position. An SWA position inside the window must have a live peer, so there a
        # released peer (row 0) is checked and fails; the sweep only walks live positions.
        checked = torch.ones_like(slots, dtype=torch.bool) if active is None else active.clone()
        stored = records[rows].clone()
        stored[:, 1] = torch.where(slots <= 0, torch.full_like(slots, -1), stored[:, 1])
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
            _RefPending(phase, group, failed, stored_values, expected_values, slots, rows, positions,
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


class _BothCanaries:
    """Stands in for the scheduler's canary: every call goes to the batched canary and to a
    `_LoopCanary`, and each step's `collect` asserts both report the same violations."""

    def __init__(self, batched, *, fused: bool) -> None:
        self.batched, self.fused, self.seen = batched, fused, []
        self.loop = _LoopCanary("log", batched.kv_pool, batched.window, batched.sweep_interval)

    def __getattr__(self, name):  # mode, stats, pending_counts, ...: the batched canary's
        return getattr(self.batched, name)

    def verify(self, phase, reqs, table, step):
        self.batched.verify(phase, reqs, table, step)
        self.loop.verify(phase, reqs, table, step)

    def write_and_verify_tail(self, reqs, table, step):
        if self.fused:
            self.batched.write_and_verify_tail(reqs, table, step)
        else:
            self.batched.write(reqs, table, step)
            self.batched.verify("TAIL", reqs, table, step)
        self.loop.write(reqs, table, step)
        self.loop.verify("TAIL", reqs, table, step)

    def sweep(self, paths, step):
        self.batched.sweep(paths, step)
        self.loop.sweep(paths, step)

    def note_sampled(self, rid, token):
        self.batched.note_sampled(rid, token)
        self.loop.note_sampled(rid, token)

    def forget(self, rid, *args):
        self.batched.forget(rid, *args)
        self.loop.forget(rid, *args)

    def collect(self, step, counts=None):
        got, want = self.batched.collect(step, counts), self.loop.collect(step)
        assert got == want, f"step {step}:\nbatched {got}\nloop    {want}"
        self.seen.extend(got)
        return got


def _attach_loop_canary(sched, *, fused: bool) -> list[CanaryViolation]:
    """Put `_BothCanaries` in the scheduler's place; returns the list of what they reported."""
    both = _BothCanaries(sched.canary, fused=fused)
    sched.canary = both
    return both.seen


def _damage(sched, rng: random.Random) -> None:
    """One random piece of the damage the perturbation kinds do, between two steps."""
    running = [r for r in sched.running if r.kv_len > 2]
    if not running:
        return
    req = rng.choice(running)
    table = sched.req_to_token_pool.req_to_token
    mapping = sched.allocator.full_to_swa_index_mapping
    pool = sched.kv_pool
    pos = rng.randrange(req.kv_len)
    slot = int(table[req.row, pos])
    kind = rng.choice(["r2t_other", "r2t_zero", "r2t_minus_one", "map_alias", "map_zero", "kv_flip", "oracle"])
    if kind.startswith("r2t"):
        other = rng.choice(running)
        value = {"r2t_other": int(table[other.row, rng.randrange(other.kv_len)]), "r2t_zero": 0,
                 "r2t_minus_one": -1}[kind]
        table[req.row, pos] = value
    elif kind.startswith("map") and slot > 0:
        other = int(table[req.row, rng.randrange(req.kv_len)])
        mapping[slot] = int(mapping[other]) if kind == "map_alias" else 0
    elif kind == "kv_flip" and slot > 0:
        layer = rng.randrange(len(pool.layer_pattern))
        row = int(pool.rows_of(layer, torch.tensor([slot]))[0])
        if row > 0:
            buf = rng.choice([pool.k_buffer, pool.v_buffer])[layer]
            raw = buf[row].view(-1).view(torch.uint8)
            raw[rng.randrange(raw.numel())] ^= 1 << rng.randrange(8)
    elif kind == "oracle":
        sched.canary.note_sampled(req.rid, rng.randrange(VOCAB_SIZE))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize(("page_size", "seed"), [(1, 0), (1, 1), (4, 2), (4, 3)])
def test_batched_canary_reports_what_the_per_position_one_does(
    tmp_path: Path, page_size: int, seed: int, fused: bool
) -> None:
    eng = Engine(
        EngineConfig(device="cpu", window=WINDOW, page_size=page_size, layer_pattern=PATTERN, kv_canary="log",
                     full_pool_tokens=512, swa_pool_tokens=160, max_context_len=256,
                     kv_canary_sweep_interval=3, event_log=str(tmp_path / "events.jsonl")),
        exit_on_crash=False,
    )
    try:
        sched = eng.scheduler
        seen = _attach_loop_canary(sched, fused=fused)
        rng = random.Random(seed)
        shared = [rng.randrange(VOCAB_SIZE) for _ in range(12)]
        steps, crashed = 0, False
        for wave in range(3):
            for i in range(3):
                # Prompts shorter and longer than the window (the fused write + TAIL, and the
                # fallback), some sharing a cached prefix (cache hits, sweeps of cached paths).
                prompt = shared + [rng.randrange(VOCAB_SIZE) for _ in range(rng.choice([1, 5, 20]))]
                sched.add_request(Req(f"w{wave}r{i}", prompt if i else prompt[5:], rng.randrange(6, 24)))
            while sched.has_work and not crashed:
                if steps > 2 and rng.random() < 0.35:
                    _damage(sched, rng)
                try:
                    sched.step()
                except IndexError:  # damage the engine itself does not survive (both saw it all)
                    crashed = True
                steps += 1
        assert steps > 20
        assert {v.reason for v in seen} >= {"verify_chain_hash", "verify_position", "verify_real_kv_hash"}
        assert {v.phase for v in seen} >= {"HEAD", "TAIL"}
    finally:
        eng.scheduler.running.clear()
        eng.stop(drain_timeout_s=0)


def test_batched_canary_matches_on_a_clean_long_prefill(tmp_path: Path) -> None:
    """A prefill much longer than the window (many chain steps), then a cache hit on it."""
    eng = Engine(
        EngineConfig(device="cpu", window=WINDOW, layer_pattern=PATTERN, kv_canary="log", full_pool_tokens=512,
                     swa_pool_tokens=160, max_context_len=256, kv_canary_sweep_interval=2,
                     event_log=str(tmp_path / "events.jsonl")),
        exit_on_crash=False,
    )
    try:
        sched = eng.scheduler
        seen = _attach_loop_canary(sched, fused=True)
        prompt = [random.Random(5).randrange(VOCAB_SIZE) for _ in range(90)]
        sched.add_request(Req("long", prompt, 5))
        sched.add_request(Req("other", prompt[:7], 9))
        while sched.has_work:
            sched.step()
        sched.add_request(Req("hit", prompt + [1, 2, 3], 6))
        while sched.has_work:
            sched.step()
        assert seen == [] and sched.stats["cached_tokens"] > 0 and sched.canary.stats["sweep_passes"] > 0
    finally:
        eng.stop(drain_timeout_s=0)


def test_a_decode_step_reuses_the_last_tail_and_shares_the_writes_reads(engine: Engine) -> None:
    _two_decoding(engine)
    canary = engine.scheduler.canary
    last_tail = canary._plan.tail
    _steps(engine, 1)
    plan = canary._plan
    assert plan.head is last_tail, "a decode's HEAD elements are the last step's TAIL elements"
    assert plan.write is not None and plan.write.in_tail is not None, "decode writes take the fused path"
    assert _violations(engine) == []


def test_a_swapped_last_token_is_caught_at_the_finish(engine: Engine) -> None:
    """The last sampled token is never written to KV, so the write-time oracle never sees it;
    the finish compares what the request answers with against what the sampler gave."""
    canary = engine.scheduler.canary
    canary.note_sampled("r", 7)
    canary.forget("r", 7, 10, 3)  # answered as sampled
    canary.note_sampled("r", 7)
    canary.forget("r", 9, 11, 4)  # swapped after the sampler
    (violation,) = canary.collect(4)
    assert (violation.reason, violation.phase, violation.stored, violation.expected) == ("write_token", "FINISH", 9, 7)
