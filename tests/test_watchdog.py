"""The workload watchdog: a stall with requests outstanding is a hang, progress is not."""

from __future__ import annotations

import threading
import time

import pytest

from canaries.watchdog import Patience, Watchdog


def _wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_watchdog_with_a_stalled_engine_aborts_every_outstanding_request_naming_the_stall():
    aborted = threading.Event()
    with Watchdog(Patience(stall_s=0.2, hard_cap_s=30, poll_s=0.02), probe=lambda: (7, 0, 0)) as dog:
        dog.track(aborted.set)
        dog.track(lambda: None)
        assert aborted.wait(5)
    assert dog.reason == "no engine progress for 0.2 s with 2 request(s) outstanding"


def test_watchdog_with_a_progressing_engine_never_fires_before_the_hard_cap():
    steps = iter(range(10**6))
    with Watchdog(Patience(stall_s=0.1, hard_cap_s=30, poll_s=0.02), probe=lambda: next(steps)) as dog:
        token = dog.track(lambda: None)
        time.sleep(0.6)  # six stall windows, with progress at every probe
        assert not dog.fired
        dog.untrack(token)


def test_watchdog_with_an_engine_that_never_answers_calls_it_a_stall():
    with Watchdog(Patience(stall_s=0.2, hard_cap_s=30, poll_s=0.02), probe=lambda: None) as dog:
        dog.track(lambda: None)
        assert _wait_for(lambda: dog.fired)
    assert dog.reason.startswith("no engine progress for 0.2 s")


def test_watchdog_at_its_hard_cap_fires_however_the_engine_progresses():
    steps = iter(range(10**6))
    with Watchdog(Patience(stall_s=0.1, hard_cap_s=0.3, poll_s=0.02), probe=lambda: next(steps)) as dog:
        dog.track(lambda: None)
        assert _wait_for(lambda: dog.fired)
    assert dog.reason == "hard cap: the workload ran 0.3 s with 1 request(s) outstanding"


def test_watchdog_with_nothing_outstanding_never_fires():
    with Watchdog(Patience(stall_s=0.1, hard_cap_s=0.2, poll_s=0.02), probe=lambda: None) as dog:
        time.sleep(0.5)
    assert dog.reason is None


def test_watchdog_aborts_a_request_tracked_after_it_fired_at_once():
    with Watchdog(Patience(stall_s=0.1, hard_cap_s=30, poll_s=0.02), probe=lambda: None) as dog:
        dog.track(lambda: None)
        assert _wait_for(lambda: dog.fired)
        late = threading.Event()
        dog.track(late.set)
        assert late.is_set()


@pytest.mark.parametrize("kwargs, named", [
    ({"stall_s": 0}, "stall_s=0"),
    ({"hard_cap_s": float("nan")}, "hard_cap_s=nan"),
    ({"poll_s": -1}, "poll_s=-1"),
    ({"stall_s": 5, "poll_s": 6}, "poll_s=6"),
    ({"stall_s": 50, "hard_cap_s": 10}, "stall_s=50"),
])
def test_patience_with_a_bad_field_is_refused_naming_it(kwargs, named):
    with pytest.raises(ValueError, match=named):
        Patience(**kwargs)


def test_watchdog_stall_while_the_machine_starves_the_engine_says_so():
    # (ran, waited for a CPU): at the workload's start, at the stall's start, at the cut
    readings = iter([(0.0, 0.0), (1.0, 0.0), (1.0, 50.0)])
    with Watchdog(Patience(stall_s=0.2, hard_cap_s=30, poll_s=0.02), probe=lambda: (7, 0, 0),
                  cpu=lambda: next(readings, (1.0, 50.0))) as dog:
        dog.track(lambda: None)
        time.sleep(1.0)
    assert dog.fired and dog.starved and "starved" in dog.reason


def test_watchdog_stall_of_an_engine_that_ran_or_slept_is_the_engines():
    from canaries.schedstat import starved

    assert starved((0.0, 0.0), (0.0, 0.1), 240.0) is None  # it slept: waiting on something, a hang
    assert starved((0.0, 0.0), (60.0, 180.0), 240.0) is None  # it ran a quarter of the window: spinning
    assert "waited 230 s" in starved((0.0, 0.0), (1.0, 230.0), 240.0)
    assert starved(None, (1.0, 230.0), 240.0) is None  # /proc could not say


def test_group_cpu_reads_this_process_group():
    import os

    from canaries.schedstat import group_cpu

    ran, waited = group_cpu(os.getpgrp())
    assert ran > 0 and waited >= 0


def test_watchdog_hard_cap_while_the_machine_starves_the_engine_says_so():
    readings = iter([(0.0, 0.0)])  # at the start; then it ran a little and mostly waited
    steps = iter(range(10**6))
    with Watchdog(Patience(stall_s=0.1, hard_cap_s=0.3, poll_s=0.02), probe=lambda: next(steps),
                  cpu=lambda: next(readings, (0.2, 0.25))) as dog:
        dog.track(lambda: None)
        time.sleep(1.0)
    assert dog.reason.startswith("hard cap") and dog.starved and "starved" in dog.reason
