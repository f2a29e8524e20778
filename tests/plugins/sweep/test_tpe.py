"""TPE rounds: the study is rebuilt from trial records, so the next round depends on the results so far."""

from __future__ import annotations

import math

import airflow  # noqa: F401  (importing Airflow puts its plugins folder on sys.path)

from kubetrain.sweep.space import parse_space
from kubetrain.sweep.tpe import tpe_points

SPACE = parse_space(
    {"learning_rate": {"low": 1e-5, "high": 1.0, "log": True}, "batch_size": [16, 32, 64, 128]}, tunable=None
)


def records(score) -> list[dict]:
    """Twelve finished trials spread over the space, scored by ``score(learning_rate)``."""
    out = []
    for i in range(12):
        lr = 10 ** (-5 + 5 * i / 11)
        values = [score(lr) * f for f in (0.5, 0.8, 1.0)]
        out.append(
            {
                "number": i,
                "params": {"learning_rate": lr, "batch_size": (16, 32, 64, 128)[i % 4]},
                "status": "success",
                "objective": {"value": values[-1], "values": values},
            }
        )
    return out


def peak_at(center: float):
    return lambda lr: math.exp(-((math.log10(lr) - math.log10(center)) ** 2))


def test_the_next_round_follows_the_results_of_the_earlier_ones():
    good_low = tpe_points(SPACE, records(peak_at(1e-4)), count=4, seed=3, mode="max", startup_trials=4)
    good_high = tpe_points(SPACE, records(peak_at(1e-1)), count=4, seed=3, mode="max", startup_trials=4)
    assert good_low != good_high
    # each batch leans towards where its history scored best
    low = sum(math.log10(p["learning_rate"]) for p in good_low) / 4
    high = sum(math.log10(p["learning_rate"]) for p in good_high) / 4
    assert low < -3 < -2 < high, (good_low, good_high)


def test_same_history_and_seed_give_the_same_points():
    history = records(peak_at(1e-2))
    assert tpe_points(SPACE, history, count=3, seed=11, mode="max", startup_trials=4) == tpe_points(
        SPACE, history, count=3, seed=11, mode="max", startup_trials=4
    )


def test_minimizing_turns_the_preference_around():
    history = records(peak_at(1e-4))
    maxed = tpe_points(SPACE, history, count=4, seed=5, mode="max", startup_trials=4)
    minned = tpe_points(SPACE, history, count=4, seed=5, mode="min", startup_trials=4)
    mean = lambda points: sum(math.log10(p["learning_rate"]) for p in points) / len(points)  # noqa: E731
    assert mean(maxed) < mean(minned)


def test_stopped_and_failed_trials_are_told_and_points_are_not_repeated():
    history = records(peak_at(1e-3))
    history[0]["status"], history[0]["objective"] = "failed", {"value": None, "values": []}
    history[1].update(stopped_early=True)
    history[1]["status"] = "success"
    history.append(
        {
            "number": 12,
            "params": {"learning_rate": 5.0, "batch_size": 16},
            "status": "success",
            "objective": {"value": 1.0, "values": [1.0]},
        }
    )  # outside the space: ignored
    points = tpe_points(SPACE, history, count=6, seed=2, mode="max", startup_trials=4)
    assert len(points) == 6
    seen = {(r["params"]["learning_rate"], r["params"]["batch_size"]) for r in history}
    assert all((p["learning_rate"], p["batch_size"]) not in seen for p in points)
    assert len({(p["learning_rate"], p["batch_size"]) for p in points}) == 6


def test_the_first_round_is_random_startup():
    first = tpe_points(SPACE, [], count=2, seed=0, mode="max", startup_trials=2)
    assert len(first) == 2 and all(1e-5 <= p["learning_rate"] <= 1.0 for p in first)
