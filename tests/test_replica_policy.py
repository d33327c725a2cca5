"""The replica-choice policy of remote models: pure functions, checked on tables of cases."""

from __future__ import annotations

import pytest

from dasktensor.remote._policy import choose_replica, home_replica

A, B, C, D = (f"tcp://10.0.0.{i}:4000" for i in range(1, 5))


@pytest.mark.parametrize(
    "model, process, n, home",
    [
        (0, 0, 1, 0),  # one replica: always it
        (5, 7, 1, 0),
        (0, 0, 4, 0),
        (1, 0, 4, 1),  # models of one process: different homes
        (2, 0, 4, 2),
        (0, 1, 4, 1),  # one model in different processes: different homes
        (0, 3, 4, 3),
        (3, 2, 4, 1),  # wraps around
        (10**9, 10**9 + 1, 3, (2 * 10**9 + 1) % 3),
    ],
)
def test_home_replica(model, process, n, home):
    assert home_replica(model, process, n) == home


@pytest.mark.parametrize(
    "addresses, home, inflight, chosen, why",
    [
        ([A], 0, {}, 0, "a single replica"),
        ([A], 0, {A: 5}, 0, "a single replica, however busy"),
        ([A, B, C, D], 2, {}, 2, "nothing in flight: the home"),
        ([A, B, C, D], 2, {A: 1, B: 1, D: 1}, 2, "the home is among the least busy"),
        ([A, B, C, D], 2, {C: 1}, 3, "busy at home: the next one"),
        ([A, B, C, D], 3, {D: 1}, 0, "busy at home: the next one, wrapping around"),
        ([A, B, C, D], 2, {C: 1, D: 1}, 0, "the neighbours after the home first"),
        ([A, B, C, D], 0, {A: 2, B: 1, C: 1, D: 1}, 1, "fewest in flight wins over order"),
        ([A, B, C, D], 1, {A: 0, B: 3, C: 2, D: 2}, 0, "fewest in flight, wherever it is"),
        ([A, B, C, D], 1, {A: 1, B: 1, C: 1, D: 1}, 1, "all equally busy: the home"),
        ([A, B], 0, {C: 9, D: 9}, 0, "calls to other models' workers do not count here"),
        ([A, B], 0, {A: -1}, 0, "counts are compared as they are"),
    ],
)
def test_choose_replica(addresses, home, inflight, chosen, why):
    assert choose_replica(addresses, home, inflight) == chosen, why


def test_choose_replica_has_no_side_effects():
    addresses, inflight = [A, B, C], {A: 1}
    choose_replica(addresses, 0, inflight)
    assert addresses == [A, B, C] and inflight == {A: 1}


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: choose_replica([], 0, {}), "expected at least one replica address, got none"),
        (lambda: choose_replica([A, B], 2, {}), r"expected a home index in \[0, 2\), got 2"),
        (lambda: home_replica(0, 0, 0), "expected n_replicas >= 1, got 0"),
    ],
)
def test_bad_input_says_what_was_expected(call, message):
    with pytest.raises(ValueError, match=message):
        call()
