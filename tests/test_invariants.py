"""engine_stub.invariants: registry, levels, crash matrix, count path, firings, properties."""

from __future__ import annotations

import gc
import math
import uuid
import weakref
from unittest import mock

import pytest
import torch

from engine_stub import invariants
from engine_stub.invariants import (
    Bucket,
    CountGroup,
    Finite,
    Firing,
    InClosedRange,
    InRange,
    Invariant,
    InvariantCheckLevel,
    InvariantViolation,
    IsTrue,
    IsZero,
    NotInf,
    NotNaN,
    PageAligned,
    Positive,
    Property,
    counter_snapshot,
    crashes,
    drain_firings,
    expect,
    firing_from_device_assert,
    hit_counts,
    note_failures,
    override_level,
    register_count_source,
    registered_invariants,
    reset_counters,
    resolve_level,
    set_firing_sink,
)
from engine_stub.synccheck import count_syncs

OFF, WARN, STRICT = InvariantCheckLevel.OFF, InvariantCheckLevel.WARN, InvariantCheckLevel.STRICT
FAILING = torch.tensor([True, False, True, False])
PASSING = torch.tensor([True, True, True])


def _make_invariant(
    bucket: Bucket = Bucket.GUARD, prop: Property | None = None, **kwargs
) -> Invariant:
    # The registry is process-global, so every test invariant gets a fresh name.
    return Invariant(f"test.{uuid.uuid4().hex}", bucket, prop or IsTrue(), **kwargs)


def _assert_calls_naming(assert_async: mock.MagicMock, name: str) -> list[mock._Call]:
    return [c for c in assert_async.call_args_list if f"[{name}]" in c.args[1]]


class TestRegistry:
    def test_register_duplicate_name_raises_key_error(self) -> None:
        inv = _make_invariant()
        with pytest.raises(KeyError, match="already registered"):
            Invariant(inv.name, Bucket.SOFTEN, IsTrue())

    def test_fatal_uncontainable_with_recover_raises_value_error(self) -> None:
        with pytest.raises(ValueError, match="FATAL_UNCONTAINABLE has no correct recovery"):
            _make_invariant(Bucket.FATAL_UNCONTAINABLE, recover=lambda v: v)

    @pytest.mark.parametrize("name", ["", None])
    def test_register_empty_name_raises_value_error(self, name: str | None) -> None:
        with pytest.raises(ValueError, match="non-empty name"):
            Invariant(name, Bucket.GUARD, IsTrue())  # type: ignore[arg-type]

    def test_register_non_bucket_raises_type_error(self) -> None:
        with pytest.raises(TypeError, match="must be a Bucket"):
            Invariant(f"test.{uuid.uuid4().hex}", "GUARD", IsTrue())  # type: ignore[arg-type]

    def test_register_name_outside_the_catalogue_raises_key_error(self) -> None:
        with pytest.raises(KeyError, match="not in the detector catalogue"):
            Invariant(f"alloc.{uuid.uuid4().hex}", Bucket.GUARD, IsTrue())

    def test_register_catalogued_name_with_another_bucket_raises_value_error(self) -> None:
        # Refused before the registry is touched: the engine's own swa.peer_mapped stays.
        with pytest.raises(ValueError, match="differs from the catalogue's FATAL_UNCONTAINABLE"):
            Invariant("swa.peer_mapped", Bucket.GUARD, IsTrue())


LEVEL_TEXTS = [
    ("off", OFF),
    ("OFF", OFF),
    ("Warn", WARN),
    ("warn", WARN),
    ("strict", STRICT),
    ("STRICT", STRICT),
    (" strict ", STRICT),
    ("0", OFF),
    ("1", WARN),
    ("2", STRICT),
]
BAD_LEVEL_TEXTS = ["3", "-1", "on", "true", "strictest", "2.0", "warning"]


class TestLevels:
    def test_resolve_level_without_env_returns_off(self) -> None:
        assert resolve_level() is OFF

    def test_resolve_level_with_empty_env_returns_off(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("ENGINE_STUB_INVARIANT_CHECK", "")
        assert resolve_level() is OFF

    @pytest.mark.parametrize(("text", "level"), LEVEL_TEXTS)
    def test_resolve_level_reads_env_returns_level(
        self, monkeypatch: pytest.MonkeyPatch, text: str, level: InvariantCheckLevel
    ) -> None:
        monkeypatch.setenv("ENGINE_STUB_INVARIANT_CHECK", text)
        assert resolve_level() is level

    @pytest.mark.parametrize("text", BAD_LEVEL_TEXTS)
    def test_resolve_level_bad_env_raises_value_error_naming_variable(
        self, monkeypatch: pytest.MonkeyPatch, text: str
    ) -> None:
        monkeypatch.setenv("ENGINE_STUB_INVARIANT_CHECK", text)
        with pytest.raises(ValueError, match=r"ENGINE_STUB_INVARIANT_CHECK=.*off\|warn\|strict"):
            resolve_level()

    @pytest.mark.parametrize(("text", "level"), LEVEL_TEXTS)
    def test_override_level_parses_text_returns_level(
        self, text: str, level: InvariantCheckLevel
    ) -> None:
        with override_level(text) as in_force:
            assert in_force is level
            assert resolve_level() is level
        assert resolve_level() is OFF

    @pytest.mark.parametrize("text", BAD_LEVEL_TEXTS)
    def test_override_level_bad_text_raises_value_error(self, text: str) -> None:
        with pytest.raises(ValueError, match="not a check level"), override_level(text):
            pass

    @pytest.mark.parametrize(
        ("number", "level"), [(0, OFF), (1, WARN), (2, STRICT), (STRICT, STRICT)]
    )
    def test_override_level_accepts_int_returns_level(
        self, number: int, level: InvariantCheckLevel
    ) -> None:
        with override_level(number) as in_force:
            assert in_force is level

    def test_override_level_beats_env_and_restores_on_exit(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("ENGINE_STUB_INVARIANT_CHECK", "warn")
        with override_level("strict"):
            with override_level("off"):
                assert resolve_level() is OFF
            assert resolve_level() is STRICT
        assert resolve_level() is WARN

    def test_override_level_restores_after_exception(self) -> None:
        with pytest.raises(RuntimeError, match="boom"), override_level("strict"):
            raise RuntimeError("boom")
        assert resolve_level() is OFF


# (bucket, level, outcome of a failing expect): every cell of SGLang's crash matrix.
CRASH_MATRIX = [
    (Bucket.SOFTEN, OFF, "silent"),
    (Bucket.SOFTEN, WARN, "count"),
    (Bucket.SOFTEN, STRICT, "count"),
    (Bucket.GUARD, OFF, "silent"),
    (Bucket.GUARD, WARN, "count"),
    (Bucket.GUARD, STRICT, "crash"),
    (Bucket.FATAL_CONTAINABLE, OFF, "silent"),
    (Bucket.FATAL_CONTAINABLE, WARN, "count"),
    (Bucket.FATAL_CONTAINABLE, STRICT, "crash"),
    (Bucket.FATAL_UNCONTAINABLE, OFF, "silent"),
    (Bucket.FATAL_UNCONTAINABLE, WARN, "crash"),
    (Bucket.FATAL_UNCONTAINABLE, STRICT, "crash"),
]


class TestCrashMatrix:
    @pytest.mark.parametrize(("bucket", "level", "outcome"), CRASH_MATRIX)
    def test_crashes_matches_matrix(
        self, bucket: Bucket, level: InvariantCheckLevel, outcome: str
    ) -> None:
        assert crashes(bucket, level) is (outcome == "crash")

    @pytest.mark.parametrize(("bucket", "level", "outcome"), CRASH_MATRIX)
    def test_expect_failing_value_crashes_or_counts(
        self, bucket: Bucket, level: InvariantCheckLevel, outcome: str
    ) -> None:
        inv = _make_invariant(bucket)
        with override_level(level):
            if outcome == "crash":
                with pytest.raises(InvariantViolation, match=rf"\[{inv.name}\]: planted"):
                    expect(inv, FAILING, "planted")
            else:
                assert expect(inv, FAILING, "planted") is FAILING
        assert hit_counts()[inv.name] == (0 if outcome == "silent" else 2)

    @pytest.mark.parametrize(("bucket", "level", "outcome"), CRASH_MATRIX)
    def test_expect_passing_value_never_fires(
        self, bucket: Bucket, level: InvariantCheckLevel, outcome: str
    ) -> None:
        inv = _make_invariant(bucket)
        with override_level(level):
            expect(inv, PASSING, "planted")
            assert drain_firings() == []
        assert hit_counts()[inv.name] == 0

    @pytest.mark.parametrize("level", [OFF, WARN, STRICT])
    @pytest.mark.parametrize("bucket", list(Bucket))
    def test_expect_empty_tensor_never_fires(
        self, bucket: Bucket, level: InvariantCheckLevel
    ) -> None:
        inv = _make_invariant(bucket)
        with override_level(level), mock.patch.object(torch, "_assert_async") as assert_async:
            expect(inv, torch.zeros(0, dtype=torch.bool), "empty")
        assert_async.assert_not_called()
        assert hit_counts()[inv.name] == 0


class TestCrashPath:
    @pytest.mark.parametrize(("value", "predicate"), [(FAILING, False), (PASSING, True)])
    def test_crash_path_hands_predicate_and_name_to_async_assert(
        self, value: torch.Tensor, predicate: bool
    ) -> None:
        inv = _make_invariant(Bucket.GUARD)
        with override_level(STRICT), mock.patch.object(torch, "_assert_async") as assert_async:
            expect(inv, value, "caller wants free")
        condition, message = assert_async.call_args.args
        assert bool(condition) is predicate
        assert f"[{inv.name}]" in message
        assert message.endswith("caller wants free")

    def test_crash_path_emits_firing_before_raising(self) -> None:
        inv = _make_invariant(Bucket.FATAL_UNCONTAINABLE, site="test.site")
        seen: list[Firing] = []
        set_firing_sink(seen.append)
        with override_level(WARN), pytest.raises(InvariantViolation) as excinfo:
            expect(inv, FAILING, "planted", slots=torch.tensor([10, 11, 12, 13]))
        assert seen == [excinfo.value.firing]
        firing = seen[0]
        assert (firing.name, firing.bucket, firing.level, firing.site) == (
            inv.name,
            "FATAL_UNCONTAINABLE",
            "WARN",
            "test.site",
        )
        assert firing.crashed
        assert firing.slots == (11, 13)
        assert (firing.new_hits, firing.total_hits) == (2, 2)

    def test_crash_path_puts_pending_count_path_firings_on_record_first(self) -> None:
        counted = _make_invariant(Bucket.GUARD, site="test.counted")
        fatal = _make_invariant(Bucket.FATAL_UNCONTAINABLE, site="test.fatal")
        seen: list[Firing] = []
        set_firing_sink(seen.append)
        with override_level(WARN):
            expect(counted, FAILING, "what led to it", slots=torch.tensor([1, 2, 3, 4]))
            with pytest.raises(InvariantViolation) as excinfo:
                expect(fatal, FAILING, "the crash")
        assert [f.name for f in seen] == [counted.name, fatal.name]
        assert (seen[0].crashed, seen[0].slots, seen[0].msg) == (False, (2, 4), "what led to it")
        assert seen[1] == excinfo.value.firing and seen[1].new_hits == 2
        assert drain_firings() == []  # drained once, not again at the next read-back


class TestCountPath:
    def test_count_path_failing_value_does_not_sync(self) -> None:
        inv = _make_invariant(Bucket.GUARD)
        planted = torch.tensor([1, 2])
        # Gate: a detector blind to scalar reads would pass the assert below whatever expect does.
        assert count_syncs(lambda: planted.sum().item()).total > 0, (
            "synccheck missed a planted .item()"
        )
        with override_level(WARN):
            check = count_syncs(expect, inv, FAILING, "planted", slots=torch.tensor([1, 2, 3, 4]))
        assert check.total == 0, check.summary()
        assert hit_counts()[inv.name] == 2

    def test_drain_firings_reports_each_increase_once_with_failing_slots(self) -> None:
        inv = _make_invariant(Bucket.GUARD, site="test.site")
        seen: list[Firing] = []
        set_firing_sink(seen.append)
        with override_level(WARN):
            expect(inv, FAILING, "first", slots=torch.tensor([10, 11, 12, 13]))
            expect(inv, PASSING, "ignored", slots=torch.tensor([20, 21, 22]))
            (firing,) = drain_firings()
            assert drain_firings() == []
            expect(inv, torch.tensor([False]), "second", slots=torch.tensor([30]))
            (later,) = drain_firings()
        assert (firing.name, firing.bucket, firing.level, firing.site) == (
            inv.name,
            "GUARD",
            "WARN",
            "test.site",
        )
        assert not firing.crashed
        assert firing.slots == (11, 13)
        assert firing.msg == "first"
        assert (firing.new_hits, firing.total_hits) == (2, 2)
        assert (later.slots, later.msg, later.new_hits, later.total_hits) == ((30,), "second", 1, 3)
        assert seen == [firing, later]

    def test_drain_firings_without_slots_returns_firing_with_no_slots(self) -> None:
        inv = _make_invariant(Bucket.SOFTEN)
        with override_level(STRICT):
            expect(inv, FAILING, "no slots")
            (firing,) = drain_firings()
        assert firing.slots == ()
        assert firing.to_dict()["invariant"] == inv.name

    @pytest.mark.parametrize("level", [OFF, WARN, STRICT])
    def test_recover_applies_at_every_level(self, level: InvariantCheckLevel) -> None:
        inv = _make_invariant(Bucket.SOFTEN, InRange(0, 8), recover=lambda v: v.clamp(0, 7))
        with override_level(level):
            recovered = expect(inv, torch.tensor([-3, 2, 9]), "clamp")
        assert recovered.tolist() == [0, 2, 7]
        assert hit_counts()[inv.name] == (0 if level is OFF else 2)


NAN, INF = math.nan, math.inf
PROPERTY_CASES = [
    (IsTrue(), torch.tensor([True, False]), [True, False]),
    (IsTrue(), torch.tensor([0, 3, -1]), [False, True, True]),
    (InRange(0, 4), torch.tensor([-1, 0, 3, 4]), [False, True, True, False]),
    (InRange(0.5, 1.5), torch.tensor([0.25, 0.5, 1.49, 1.5]), [False, True, True, False]),
    (InClosedRange(0, 4), torch.tensor([-1, 0, 4, 5]), [False, True, True, False]),
    (PageAligned(4), torch.tensor([0, 4, 6, -4, -3]), [True, True, False, True, False]),
    (PageAligned(1), torch.tensor([0, 5, 7]), [True, True, True]),
    (NotNaN(), torch.tensor([0.0, NAN, INF]), [True, False, True]),
    (NotInf(), torch.tensor([0.0, NAN, INF, -INF]), [True, True, False, False]),
    (Finite(), torch.tensor([0.0, NAN, INF, -INF]), [True, False, False, False]),
    (IsTrue(), torch.tensor([0.0, NAN, -INF]), [False, True, True]),
    (Positive(), torch.tensor([-1, 0, 1, 5]), [False, False, True, True]),
    (Positive(), torch.tensor([1.0, NAN, 0.5]), [True, False, True]),
    (Positive(), torch.tensor([2.0, -0.0, INF]), [True, False, True]),
    (IsZero(), torch.tensor([0, 3, -1, 0]), [True, False, False, True]),
    (IsZero(), torch.tensor([0.0, NAN, -0.0]), [True, False, True]),
]


class TestProperties:
    @pytest.mark.parametrize(("prop", "value", "expected"), PROPERTY_CASES, ids=repr)
    def test_ok_on_planted_values_returns_elementwise_bools(
        self, prop: Property, value: torch.Tensor, expected: list[bool]
    ) -> None:
        ok = prop.ok(value)
        assert ok.dtype == torch.bool
        assert ok.shape == value.shape
        assert ok.tolist() == expected

    @pytest.mark.parametrize(("prop", "value", "expected"), PROPERTY_CASES, ids=repr)
    def test_fails_and_all_ok_agree_with_ok(
        self, prop: Property, value: torch.Tensor, expected: list[bool]
    ) -> None:
        # The count path counts `fails`, the crash path asserts `all_ok`: both must say what
        # `ok` says, NaN included.
        fails = prop.fails(value)
        assert fails.dtype == torch.bool and fails.shape == value.shape
        assert fails.tolist() == [not ok for ok in expected]
        for part in range(len(expected)):
            assert bool(prop.all_ok(value[part:])) is all(expected[part:])

    @pytest.mark.parametrize(
        ("make", "match"),
        [
            (lambda: InRange(1, 1), "lo < hi"),
            (lambda: InClosedRange(2, 1), "lo <= hi"),
            (lambda: PageAligned(0), "page_size >= 1"),
        ],
    )
    def test_construct_empty_range_raises_value_error(self, make, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            make()


class TestCounters:
    def test_counters_survive_registrations_that_grow_them(self) -> None:
        inv = _make_invariant(Bucket.GUARD)
        with override_level(WARN):
            expect(inv, FAILING, "before")
            # More invariants than the counter tensors have rows: they are copied, not reset.
            later = [_make_invariant(Bucket.SOFTEN) for _ in range(invariants._capacity + 1)]
            expect(inv, FAILING, "after")
            expect(later[-1], torch.tensor([False]), "new")
        counts = hit_counts()
        assert counts[inv.name] == 4
        assert counts[later[-1].name] == 1
        assert all(counts[other.name] == 0 for other in later[:-1])

    def test_counter_snapshot_lists_every_invariant_sorted_with_its_count(self) -> None:
        inv = _make_invariant(Bucket.GUARD)
        with override_level(WARN):
            expect(inv, FAILING, "planted")
        names, values = counter_snapshot()
        assert names == sorted(inv.name for inv in registered_invariants())
        assert dict(zip(names, values.tolist(), strict=True)) == hit_counts()

    def test_counter_snapshot_is_a_copy(self) -> None:
        inv = _make_invariant(Bucket.GUARD)
        with override_level(WARN):
            expect(inv, FAILING, "planted")
            names, values = counter_snapshot()
            expect(inv, FAILING, "again")
        assert values[names.index(inv.name)].item() == 2
        assert hit_counts()[inv.name] == 4

    def test_crash_message_names_the_invariant_for_a_later_parse(self) -> None:
        inv = _make_invariant(Bucket.FATAL_UNCONTAINABLE, site="test.site")
        for _ in range(2):  # the second message comes from the cache
            with override_level(WARN), pytest.raises(InvariantViolation) as excinfo:
                expect(inv, FAILING, "caller wants free_full")
            parsed = firing_from_device_assert(excinfo.value, level=WARN)
            assert (parsed.name, parsed.bucket, parsed.site, parsed.msg) == (
                inv.name, "FATAL_UNCONTAINABLE", "test.site", "caller wants free_full")


def _twins(n: int, bucket: Bucket = Bucket.GUARD) -> tuple[list[Invariant], CountGroup]:
    """`n` invariants to check one by one, and a group of `n` others to report in one go."""
    singles = [_make_invariant(bucket, site="test.site") for _ in range(n)]
    group = CountGroup(*((_make_invariant(bucket, site="test.site"), f"entry {i}") for i in range(n)))
    return singles, group


def _identity(codes: torch.Tensor) -> torch.Tensor:
    return codes


def _report_both_ways(singles, group, reports) -> None:
    """Each report (a list of (codes, slots) parts) as one expect per entry, and as one group
    report: its counts in one op, one context."""
    k = len(singles)
    index = group.index("cpu", [*range(k), None])
    for parts in reports:
        codes = torch.cat([c for c, _ in parts])
        slots = None if parts[0][1] is None else torch.cat([s for _, s in parts])
        for i, inv in enumerate(singles):
            expect(inv, codes != i, f"entry {i}", slots=slots)
        group.add(torch.bincount(codes, minlength=k + 1), index)
        note_failures(group, [(_identity, c, s) for c, s in parts])


def _as_twins(firings, singles, group) -> list[tuple[tuple, tuple]]:
    by_name = {f.name: f for f in firings}

    def fields(name: str) -> tuple:
        f = by_name.get(name)
        return None if f is None else (f.bucket, f.level, f.site, f.msg, f.new_hits, f.total_hits,
                                       f.crashed, f.slots)

    return [(fields(a.name), fields(b.name)) for a, b in zip(singles, group.invariants, strict=True)]


class TestCountGroups:
    def test_group_report_fires_as_one_expect_per_entry(self) -> None:
        singles, group = _twins(3)
        reports = [
            [(torch.tensor([0, 3, 2, 0]), torch.tensor([10, 11, 12, 13]))],
            [(torch.tensor([3, 1]), torch.tensor([20, 21])), (torch.tensor([0, 1, 3]), torch.tensor([30, 31, 32]))],
            [(torch.tensor([3, 3]), torch.tensor([40, 41]))],
        ]
        with override_level(WARN):
            _report_both_ways(singles, group, reports[:2])
            first = drain_firings()
            _report_both_ways(singles, group, reports[2:])
            assert drain_firings() == []
            _report_both_ways(singles, group, reports[:1])
            second = drain_firings()
        for pairs in (_as_twins(first, singles, group), _as_twins(second, singles, group)):
            for single, grouped in pairs:
                assert single == grouped
        assert _as_twins(first, singles, group)[0][1][-1] == (10, 13, 30)  # slots in order, parts joined

    def test_group_report_without_slots_fires_with_its_messages(self) -> None:
        singles, group = _twins(2, Bucket.SOFTEN)
        with override_level(STRICT):
            _report_both_ways(singles, group, [[(torch.tensor([2, 1]), None)]])
            firings = drain_firings()
        for single, grouped in _as_twins(firings, singles, group):
            assert single == grouped
        assert _as_twins(firings, singles, group)[0] == (None, None)

    @pytest.mark.parametrize("room", [0, 1, 2, 3, 5])
    def test_group_report_near_the_pending_cap_keeps_what_the_expects_keep(
        self, monkeypatch: pytest.MonkeyPatch, room: int
    ) -> None:
        monkeypatch.setattr(invariants, "_MAX_PENDING", 6)
        filler = _make_invariant(Bucket.SOFTEN)
        singles, group = _twins(3)
        report = [[(torch.tensor([0, 1, 2]), torch.tensor([7, 8, 9]))]]
        outcomes = []
        for way in ("singles", "group"):
            with override_level(WARN):
                for _ in range(6 - room):
                    expect(filler, PASSING, "fill", slots=torch.tensor([1, 2, 3]))
                if way == "singles":
                    for i, inv in enumerate(singles):
                        expect(inv, torch.tensor([0, 1, 2]) != i, f"entry {i}", slots=torch.tensor([7, 8, 9]))
                else:
                    group.add(torch.ones(3, dtype=torch.int64), group.index("cpu", [0, 1, 2]))
                    note_failures(group, [(_identity, c, s) for c, s in report[0]])
                firings = {f.name: (f.slots, f.msg, f.new_hits) for f in drain_firings()}
            outcomes.append([firings.get(inv.name) for inv in (singles if way == "singles" else group.invariants)])
        assert outcomes[0] == outcomes[1]
        kept = min(room, 3)
        assert [slots for slots, _, _ in outcomes[1]] == [(7,), (8,), (9,)][:kept] + [()] * (3 - kept)

    def test_group_refuses_an_invariant_that_crashes_at_warn(self) -> None:
        with pytest.raises(ValueError, match="crashes at WARN"):
            CountGroup((_make_invariant(Bucket.FATAL_UNCONTAINABLE), "x"))

    def test_group_refuses_a_repeated_invariant_and_no_entry(self) -> None:
        inv = _make_invariant()
        with pytest.raises(ValueError, match="once"):
            CountGroup((inv, "a"), (inv, "b"))
        with pytest.raises(ValueError, match="at least one"):
            CountGroup()

    def test_group_add_and_note_failures_do_not_sync(self) -> None:
        _singles, group = _twins(3)
        index = group.index("cpu", [0, 1, 2])
        counts = torch.tensor([1, 0, 2])
        check = count_syncs(group.add, counts, index)
        assert check.total == 0, check.summary()
        parts = [(_identity, torch.tensor([0, 2, 2]), torch.tensor([4, 5, 6]))]
        check = count_syncs(note_failures, group, parts)
        assert check.total == 0, check.summary()
        firings = {f.name: f.slots for f in drain_firings()}
        assert [firings.get(inv.name) for inv in group.invariants] == [(4,), None, (5, 6)]


class _OwingSource:
    """A count source that adds its group's counts only when flushed."""

    def __init__(self, group: CountGroup) -> None:
        self.group = group
        self.index = group.index("cpu", range(len(group)))
        self.owed: list[torch.Tensor] = []
        self.flushes = 0
        register_count_source(self)

    def owe(self, counts: list[int]) -> None:
        self.owed.append(torch.tensor(counts))

    def flush_counts(self) -> None:
        self.flushes += 1
        for counts in self.owed:
            self.group.add(counts, self.index)
        self.owed.clear()


class TestCountSources:
    @pytest.mark.parametrize("reader", ["hit_counts", "counter_snapshot", "drain_firings"])
    def test_every_reader_flushes_the_sources_first(self, reader: str) -> None:
        _singles, group = _twins(2)
        source = _OwingSource(group)
        source.owe([2, 1])
        if reader == "hit_counts":
            seen = hit_counts()
        elif reader == "counter_snapshot":
            names, values = counter_snapshot()
            seen = dict(zip(names, values.tolist(), strict=True))
        else:
            seen = {f.name: f.new_hits for f in drain_firings()}
        assert [seen[inv.name] for inv in group.invariants] == [2, 1]

    def test_reset_counters_forgets_what_a_source_still_owes(self) -> None:
        _singles, group = _twins(1)
        source = _OwingSource(group)
        source.owe([3])
        reset_counters()
        assert source.owed == []
        assert hit_counts()[group.invariants[0].name] == 0

    def test_sources_are_held_weakly(self) -> None:
        _singles, group = _twins(1)
        source = _OwingSource(group)
        alive = weakref.ref(source)
        assert source in invariants._count_sources
        del source
        gc.collect()
        assert alive() is None  # registering did not keep it alive
        hit_counts()  # and readers no longer reach it

    def test_counter_snapshot_flushing_a_source_does_not_sync(self) -> None:
        _singles, group = _twins(2)
        source = _OwingSource(group)
        source.owe([1, 1])
        check = count_syncs(counter_snapshot)
        assert check.total == 0, check.summary()
        assert source.flushes >= 1
