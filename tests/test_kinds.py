"""Perturbation kinds through their typed contract, without a subprocess.

Most tests run a kind against `FakeView`, a few tensors standing in for the engine (an
`EngineView`); the last ones run kinds inside a real in-process engine through its hook sites.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from engine_stub.config import EngineConfig
from engine_stub.engine import Engine
from engine_stub.events import read_events
from engine_stub.fields import Field, Int
from engine_stub.model import VOCAB_SIZE, _attend
from engine_stub.perturb.contract import Damage, KindContext, Landing
from engine_stub.perturb.kinds import KINDS, register_kind
from engine_stub.perturb.perturber import Perturber
from engine_stub.perturb.sites import (
    BeforeStep,
    EvictionEffect,
    FinishEffect,
    ReqState,
    RequestFinish,
    Sampling,
    SamplingEffect,
    Site,
    WindowEviction,
)
from engine_stub.perturb.spec import PerturbationSpec, SpecError, TargetSpec, parse_perturbations
from engine_stub.perturb.targets import positions, read_start, retained_unread
from engine_stub.req import Req

WINDOW, PAGE = 8, 1


class FakeView:
    """An EngineView over plain tensors: rows of req_to_token, the mapping, one K buffer each."""

    def __init__(self, reqs: Sequence[ReqState], *, radix_held: Sequence[int] = ()) -> None:
        self.window, self.page_size, self.has_radix_cache = WINDOW, PAGE, bool(radix_held)
        self._reqs = list(reqs)
        self.table = torch.zeros((4, 64), dtype=torch.int32)
        for req in reqs:  # request row r holds slots 100*r+1+position
            self.table[req.row, :req.kv_len] = torch.arange(req.kv_len, dtype=torch.int32) \
                + 100 * req.row + 1
        self.mapping = torch.zeros(512, dtype=torch.int64)
        for req in reqs:  # SWA rows only from the frontier on (below it: released)
            slots = self.table[req.row, req.frontier:req.kv_len].to(torch.int64)
            self.mapping[slots] = slots % 97 + 1
        self.k = {"full": torch.zeros((512, 8), dtype=torch.float32),
                  "swa": torch.zeros((128, 8), dtype=torch.float32)}
        self._held = list(radix_held)
        self.free_slot: int | None = 300

    def running(self) -> list[ReqState]:
        return sorted(self._reqs, key=lambda r: r.rid)

    def slots(self, req: ReqState, positions: Sequence[int]) -> torch.Tensor:
        return self.table[req.row, list(positions)].to(torch.int64)

    def slot_range(self, req: ReqState, lo: int, hi: int) -> torch.Tensor:
        return self.table[req.row, lo:hi].to(torch.int64)

    def set_slot(self, req: ReqState, position: int, slot: int) -> None:
        self.table[req.row, position] = slot

    def swa_rows(self, slots: Sequence[int]) -> list[int]:
        return [int(self.mapping[s]) for s in slots]

    def set_swa_rows(self, slots: Sequence[int], rows: Sequence[int]) -> None:
        for slot, row in zip(slots, rows, strict=True):
            self.mapping[slot] = row

    def free_full_slot(self) -> int | None:
        return self.free_slot

    def kv_bytes(self, group: str, pool_row: int) -> tuple[int, torch.Tensor] | None:
        return (0 if group == "swa" else 1), self.k[group][pool_row].view(torch.uint8)

    def radix_held_slots(self) -> list[int]:
        return list(self._held)


A = ReqState("a", row=0, kv_len=30, frontier=10)  # retained-but-unread: [10, 23)
B = ReqState("b", row=1, kv_len=20, frontier=13)  # in the window: [13, 20)


def _call(kind: str, hook, view: FakeView, target: TargetSpec | None = None,
          **params) -> Landing | None:
    spec = PerturbationSpec(kind, target=target or TargetSpec())
    info = KINDS[kind]
    assert info.site == hook.SITE
    return info.fn(KindContext(view, hook, spec, info.resolved_params(params), random.Random(0)))


def _only(landing: Landing | None) -> Damage:
    assert landing is not None and len(landing.damage) == 1, landing
    return landing.damage[0]


# ---- positions, against the attention mask --------------------------------------------------


def _read_by_next_forward(kv_len: int, window: int) -> list[int]:
    """The key positions a decode query at `kv_len` attends to under the model's SWA mask."""
    keys = torch.zeros((1, kv_len + 1, 1, kv_len + 1))
    keys[0, :, 0, :] = torch.eye(kv_len + 1)  # each key its own one-hot value
    out = _attend(torch.zeros((1, 1, kv_len + 1)), torch.tensor([kv_len]), keys, keys,
                  torch.ones((1, kv_len + 1), dtype=torch.bool), window)
    return [p for p in range(kv_len) if float(out[0, 0, p]) > 0]


class TestPositions:
    @pytest.mark.parametrize("kv_len", [3, 8, 9, 30])
    def test_in_window_is_the_oldest_position_the_next_forward_reads(self, kv_len: int) -> None:
        req = ReqState("r", 0, kv_len, frontier=0)
        assert read_start(req, WINDOW) == _read_by_next_forward(kv_len, WINDOW)[0]
        assert positions(TargetSpec(positions="in_window"), req, WINDOW) == [read_start(req, WINDOW)]

    def test_retained_unread_is_the_frontier_and_never_reaches_the_window(self) -> None:
        assert list(retained_unread(A, WINDOW)) == list(range(10, 23))
        assert set(retained_unread(A, WINDOW)).isdisjoint(_read_by_next_forward(A.kv_len, WINDOW))
        assert positions(TargetSpec(positions="retained_unread"), A, WINDOW) == [10]
        assert positions(TargetSpec(positions="retained_unread", count=20), A, WINDOW) \
            == list(range(10, 23))
        assert positions(TargetSpec(positions="retained_unread"), B, WINDOW) == []

    @pytest.mark.parametrize(("where", "count", "expected"), [
        ("in_window", 2, [23, 24]), ("out_of_window", 2, [8, 9]), ("last", 2, [28, 29]),
        ((27, 40), 1, [27, 28, 29]),
    ])
    def test_positions_of_each_word(self, where, count: int, expected: list[int]) -> None:
        assert positions(TargetSpec(positions=where, count=count), A, WINDOW) == expected

    def test_yaml_range_forms_mean_lo_to_hi_exclusive(self) -> None:
        (flow,), (mapping,) = (parse_perturbations([{"kind": "strip_swa_mapping",
                                                     "target": {"positions": p}}])
                               for p in ([3, 5], {"from": 3, "to": 5}))
        assert flow.target.positions == mapping.target.positions == (3, 5)
        with pytest.raises(SpecError, match="lo <= position < hi"):
            parse_perturbations([{"kind": "strip_swa_mapping", "target": {"positions": [5, 5]}}])


# ---- kinds at the start of a step ------------------------------------------------------------


class TestBeforeStep:
    def test_strip_swa_mapping_zeroes_the_in_window_peer(self) -> None:
        view = FakeView([A, B])
        slot = int(view.table[0, 23])
        before = int(view.mapping[slot])
        damage = _only(_call("strip_swa_mapping", BeforeStep(), view,
                             TargetSpec(positions="in_window")))
        assert int(view.mapping[slot]) == 0
        assert damage == Damage("mapping", slot=slot, position=23, request="a", before=before,
                                after=0)

    def test_strip_swa_mapping_of_a_released_peer_does_not_land(self) -> None:
        view = FakeView([A])
        assert _call("strip_swa_mapping", BeforeStep(), view,
                     TargetSpec(positions="out_of_window")) is None

    @pytest.mark.parametrize(("value", "expected"), [("zero", 0), ("minus_one", -1),
                                                     ("freed_slot", 300),
                                                     ("other_live_slot", 113 + 1)])
    def test_corrupt_req_to_token_writes_the_value(self, value: str, expected: int) -> None:
        view = FakeView([A, B])  # b's oldest read position is 13: slot 100 + 1 + 13
        landing = _call("corrupt_req_to_token", BeforeStep(), view,
                        TargetSpec(positions="in_window", value=value))
        assert int(view.table[0, 23]) == expected
        assert _only(landing) == Damage("req_to_token", request="a", row=0, position=23,
                                        before=24, after=expected, detail=value)

    def test_corrupt_req_to_token_without_a_free_slot_does_not_land(self) -> None:
        view = FakeView([A])
        view.free_slot = None
        assert _call("corrupt_req_to_token", BeforeStep(), view,
                     TargetSpec(positions="last", value="freed_slot")) is None

    def test_alias_swa_mapping_shares_another_requests_peer(self) -> None:
        view = FakeView([A, B])
        other = int(view.mapping[114])
        damage = _only(_call("alias_swa_mapping", BeforeStep(), view, TargetSpec(positions="last")))
        assert int(view.mapping[30]) == other and damage.after == other and damage.slot == 30

    @pytest.mark.parametrize("group", ["full", "swa"])
    def test_flip_kv_byte_flips_one_byte_of_the_slots_row(self, group: str) -> None:
        view = FakeView([A])
        damage = _only(_call("flip_kv_byte", BeforeStep(), view,
                             TargetSpec(positions="last", group=group), byte=3))
        row = 30 if group == "full" else int(view.mapping[30])
        assert int(view.k[group][row].view(torch.uint8)[3]) == 0xFF
        assert (damage.kind, damage.pool, damage.slot, damage.pool_row) == ("kv_bytes", group, 30, row)
        assert (damage.before, damage.after) == (0, 0xFF)

    def test_flip_kv_byte_past_the_row_does_not_land(self) -> None:
        assert _call("flip_kv_byte", BeforeStep(), FakeView([A]), byte=10_000) is None

    def test_flip_kv_byte_of_a_cached_slot_picks_one_no_request_uses(self) -> None:
        view = FakeView([A], radix_held=[5, 250])  # slot 5 is a's too
        damage = _only(_call("flip_kv_byte", BeforeStep(), view, TargetSpec(request="cached")))
        assert (damage.slot, damage.request, damage.position) == (250, None, None)

    def test_request_index_beyond_the_running_ones_does_not_land(self) -> None:
        assert _call("strip_swa_mapping", BeforeStep(), FakeView([A, B]),
                     TargetSpec(request=2)) is None


# ---- kinds with effects ----------------------------------------------------------------------


def _eviction(view: FakeView) -> WindowEviction:
    return WindowEviction(A, view.slot_range(A, 10, 22), frontier=10, new_frontier=22)


class TestEffects:
    def test_skip_free_swa_frees_nothing_and_names_each_kept_slot(self) -> None:
        view = FakeView([A, B])
        landing = _call("skip_free_swa", _eviction(view), view)
        assert isinstance(landing.effect, EvictionEffect)
        assert landing.effect.free.numel() == 0 and landing.effect.new_frontier is None
        assert [d.slot for d in landing.damage] == list(range(11, 23))
        assert {(d.kind, d.pool, d.detail) for d in landing.damage} == {("free_list", "swa", "kept")}

    def test_never_evict_swa_keeps_the_frontier(self) -> None:
        view = FakeView([A])
        landing = _call("never_evict_swa", _eviction(view), view)
        assert landing.effect.new_frontier == 10 and landing.damage[0].kind == "frontier"

    def test_evict_inside_window_pushes_the_frontier_into_the_window(self) -> None:
        view = FakeView([A])
        landing = _call("evict_inside_window", _eviction(view), view, extra_tokens=3)
        assert landing.effect.new_frontier == 25
        assert landing.effect.free.tolist() == list(range(11, 26))
        assert [d.position for d in landing.damage if d.kind == "free_list"] == [22, 23, 24]
        assert landing.digest["after"] == {"new_frontier": 25, "freed": list(range(11, 26))}

    def test_double_free_swa_frees_the_slots_again(self) -> None:
        view = FakeView([A])
        landing = _call("double_free_swa", _eviction(view), view)
        assert landing.effect.free is None and landing.effect.free_again.tolist() == list(range(11, 23))

    def test_eviction_of_an_untargeted_request_does_not_land(self) -> None:
        view = FakeView([A, B])
        assert _call("skip_free_swa", _eviction(view), view, TargetSpec(request=1)) is None

    def test_leak_request_keeps_every_slot_of_the_finished_request(self) -> None:
        view = FakeView([B])
        landing = _call("leak_request", RequestFinish(A), view)
        assert isinstance(landing.effect, FinishEffect) and landing.effect.leak
        assert len(landing.damage) == A.kv_len

    def test_double_free_full_frees_the_target_slots_once_more(self) -> None:
        view = FakeView([A])  # its row as it was when it finished
        landing = _call("double_free_full", RequestFinish(A), view,
                        TargetSpec(positions="last", count=2))
        assert landing.effect.free_full_again.tolist() == [29, 30]

    def test_swap_next_token_swaps_the_first_differing_pair(self) -> None:
        landing = _call("swap_next_token", Sampling((A, B), (7, 9)), FakeView([A, B]))
        assert isinstance(landing.effect, SamplingEffect) and landing.effect.next_ids == [9, 7]
        assert [(d.request, d.position, d.before, d.after) for d in landing.damage] \
            == [("a", 30, 7, 9), ("b", 20, 9, 7)]

    def test_swap_next_token_of_equal_tokens_does_not_land(self) -> None:
        assert _call("swap_next_token", Sampling((A, B), (7, 7)), FakeView([A, B])) is None


# ---- declarations ----------------------------------------------------------------------------


class TestDeclarations:
    def test_every_kind_declares_a_site_a_summary_and_catalogued_detectors(self) -> None:
        from engine_stub.detectors import detector_names

        for info in KINDS.values():
            assert isinstance(info.site, Site) and info.summary
            assert set(info.caught_by) <= set(detector_names()), info.name

    def test_registering_an_uncatalogued_detector_raises_key_error(self) -> None:
        with pytest.raises(KeyError, match="catalogue"):
            register_kind("test_kind_never_registered", Site.BEFORE_STEP,
                          caught_by=("swa.no_such_check",))(lambda ctx: None)
        assert "test_kind_never_registered" not in KINDS

    def test_registering_a_name_twice_raises_key_error(self) -> None:
        with pytest.raises(KeyError, match="already registered"):
            register_kind("flip_kv_byte", Site.BEFORE_STEP, caught_by=())(lambda ctx: None)

    def test_params_are_checked_against_the_kinds_declaration(self) -> None:
        assert KINDS["flip_kv_byte"].params["byte"] == Field("byte", Int(minimum=0), 0,
                                                             KINDS["flip_kv_byte"].params["byte"].doc)
        with pytest.raises(SpecError, match=r"params\.byte: must be >= 0"):
            parse_perturbations([{"kind": "flip_kv_byte", "params": {"byte": -1}}])
        with pytest.raises(SpecError, match=r"params\.extra_tokens: unknown key"):
            parse_perturbations([{"kind": "flip_kv_byte", "params": {"extra_tokens": 2}}])

    def test_a_landing_must_name_its_damage(self) -> None:
        with pytest.raises(ValueError, match="at least one Damage"):
            Landing({"x": 1}, ())
        with pytest.raises(ValueError, match="damage kind"):
            Damage("everything")


# ---- inside a real engine ------------------------------------------------------------------


@pytest.fixture
def make_engine(tmp_path: Path) -> Iterator:
    engines: list[Engine] = []

    def make(perturbations: list[dict], **knobs) -> Engine:
        config = EngineConfig(device="cpu", window=WINDOW, layer_pattern="SFSS", kv_canary="log",
                              full_pool_tokens=512, swa_pool_tokens=128, max_context_len=256,
                              invariant_check="warn", event_log=str(tmp_path / "events.jsonl"),
                              **knobs)
        engine = Engine(config, perturber=Perturber(parse_perturbations(perturbations), seed=1),
                        exit_on_crash=False)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.stop(drain_timeout_s=0)


def _run(engine: Engine, steps: int) -> list[dict]:
    for rid, n in (("a", 20), ("b", 27)):
        rng = random.Random(rid)
        engine.scheduler.add_request(Req(rid, [rng.randrange(VOCAB_SIZE) for _ in range(n)], 30))
    for _ in range(steps):
        engine.scheduler.step()
    return [e for e in read_events(engine.events.path) if e["kind"] == "perturbation_landed"]


class TestInTheEngine:
    def test_strip_lands_on_the_mapping_through_the_scheduler_view(self, make_engine) -> None:
        engine = make_engine([{"kind": "strip_swa_mapping", "trigger": {"event": "window_cross"},
                               "target": {"positions": "in_window"}}])
        (landed,) = _run(engine, 2)  # a prefill, then the step it lands in (a decode)
        assert landed["step"] == 2
        (damage,) = landed["damage"]
        assert damage["kind"] == "mapping" and damage["after"] == 0
        mapping = engine.scheduler.allocator.full_to_swa_index_mapping
        assert int(mapping[damage["slot"]]) == 0
        req = next(r for r in engine.scheduler.running if r.rid == damage["request"])
        # The oldest position the landing step's forward read: its query sat at kv_len - 1.
        assert damage["position"] == (req.kv_len - 1) - WINDOW + 1

    def test_skip_free_swa_effect_is_applied_by_the_eviction(self, make_engine) -> None:
        engine = make_engine([{"kind": "skip_free_swa", "trigger": {"event": "window_cross"}}])
        before = engine.scheduler.allocator.swa_available_size()
        (landed,) = _run(engine, 2 * WINDOW + 2)
        assert landed["after"]["freed"] == [] and landed["before"]["freed"]
        assert {d["detail"] for d in landed["damage"]} == {"kept"}
        assert engine.scheduler.allocator.swa_available_size() < before

    def test_no_scenario_no_view_no_context(self, tmp_path: Path) -> None:
        config = EngineConfig(device="cpu", window=WINDOW, full_pool_tokens=512,
                              swa_pool_tokens=128, max_context_len=256,
                              event_log=str(tmp_path / "e.jsonl"))
        engine = Engine(config, exit_on_crash=False)
        try:
            assert engine.scheduler.perturber is None
            assert _run(engine, 3) == []
        finally:
            engine.stop(drain_timeout_s=0)


def test_the_readmes_kind_example_registers_and_lands() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme.split("### Adding a perturbation kind", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    try:
        exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - our own README
        view = FakeView([A])
        damage = _only(_call("drop_last_token", BeforeStep(), view))
        assert int(view.table[0, 29]) == 0 and (damage.position, damage.after) == (29, 0)
    finally:
        KINDS.pop("drop_last_token", None)
