"""Invariants and the KV canary add no would-be device sync to a decode step (BRIEF §9).

A decode step synchronizes once on its own (the sampled tokens come back to the host). With every
check on (STRICT invariants, kv_canary=log with its radix sweep) a step must not sync more often
than with every check off: their results ride back with the tokens.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine_stub.config import EngineConfig
from engine_stub.events import EventLog
from engine_stub.invariants import InvariantCheckLevel, override_level
from engine_stub.req import Req
from engine_stub.scheduler import Scheduler
from engine_stub.synccheck import SyncCheck, count_syncs


def _decode_sync_counts(tmp_path, level: str, canary: str, page_size: int) -> tuple[list[SyncCheck], dict]:
    config = EngineConfig(device="cpu", invariant_check=level, kv_canary=canary, page_size=page_size,
                          kv_canary_sweep_interval=1, window=24, swa_pool_tokens=256)
    events = EventLog(tmp_path / f"{level}-{canary}.jsonl")
    sched = Scheduler(config, events)
    rng = random.Random(0)
    # Two waves: the second hits the radix cache, so the sweep has cached paths to walk.
    for i in range(3):
        sched.add_request(Req(f"a{i}", [rng.randrange(32, 127) for _ in range(40)], 6))
    with override_level(InvariantCheckLevel.parse(level)):
        while sched.has_work:
            sched.step()
        for i in range(3):
            sched.add_request(Req(f"b{i}", [rng.randrange(32, 127) for _ in range(20)], 40))
        sched.step()  # the prefill
        for _ in range(24):  # past the window: every decode step now also evicts
            sched.step()
        checks = [count_syncs(sched.step) for _ in range(4)]
    events.close()
    return checks, {**sched.canary.stats, **sched.stats}


@pytest.mark.parametrize("level", ["warn", "strict"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_checks_add_no_sync_to_a_decode_step(tmp_path, page_size: int, level: str) -> None:
    planted = count_syncs(lambda: torch.ones(3).sum().item())
    assert planted.total == 1, "the detector must see a planted .item() first"
    baseline, _ = _decode_sync_counts(tmp_path, "off", "off", page_size)
    checked, stats = _decode_sync_counts(tmp_path, level, "log", page_size)
    assert stats["sweep_passes"] > 0 and stats["verify_swa"] > 0 and stats["swa_evicted_tokens"] > 0
    for base, full in zip(baseline, checked, strict=True):
        assert full.total == base.total, (
            f"checks added syncs:\n--- off ---\n{base.summary()}\n--- {level} + canary ---\n{full.summary()}"
        )
    assert all(base.total >= 1 for base in baseline), "a decode step reads its sampled tokens back"
