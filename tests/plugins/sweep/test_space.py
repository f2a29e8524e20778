"""The search space: parsing with errors that name the field, grid enumeration and seeded random draws."""

from __future__ import annotations

import airflow  # noqa: F401  (importing Airflow puts its plugins folder on sys.path)
import pytest

from kubetrain.sweep.space import SpaceError, check_settings, parse_space, random_points, tunable_schemas
from kubetrain.trainers import IMAGE_CLASSIFIER

TUNABLE = tunable_schemas(IMAGE_CLASSIFIER.params(), IMAGE_CLASSIFIER.tunable)


@pytest.mark.parametrize(
    ("space", "field", "words"),
    [
        ({"momentum": [0.9]}, "space.momentum", "unknown hyperparameter"),
        ({"batch_size": []}, "space.batch_size", "empty"),
        ({"batch_size": {"choices": []}}, "space.batch_size", "empty"),
        ({"learning_rate": {"low": 0.1, "high": 0.01}}, "space.learning_rate", "low 0.1 > high 0.01"),
        (
            {"learning_rate": {"low": 0.0, "high": 0.1, "log": True}},
            "space.learning_rate.low",
            "> 0 for a log range",
        ),
        (
            {"learning_rate": {"low": 0.001, "high": 0.1, "log": True, "step": 0.01}},
            "space.learning_rate",
            "log and step",
        ),
        ({"learning_rate": {"low": 0.001}}, "space.learning_rate.high", "missing"),
        (
            {"learning_rate": {"low": 0.001, "high": 2.0}},
            "space.learning_rate.high",
            "not a valid value of this Param",
        ),
        ({"batch_size": [32, 0]}, "space.batch_size[1]", "not a valid value of this Param"),
        ({"batch_size": {"low": 16, "high": 64.5, "type": "int"}}, "space.batch_size.high", "not an integer"),
        ({"batch_size": [32, 32]}, "space.batch_size", "twice"),
        ({"architecture": ["cnn", "resnet"]}, "space.architecture[1]", "not a valid value"),
        ({"learning_rate": {"low": 0.001, "high": 0.01, "lo": 1}}, "space.learning_rate", "unknown key"),
        ({}, "space", "at least one hyperparameter"),
    ],
)
def test_a_bad_space_is_refused_naming_the_field(space, field, words):
    with pytest.raises(SpaceError) as raised:
        parse_space(space, tunable=TUNABLE)
    assert raised.value.field == field
    assert str(raised.value).startswith(f"{field}: ") and words in str(raised.value)


def test_types_follow_the_params_schema():
    space = parse_space(
        {
            "batch_size": {"low": 16, "high": 64, "step": 16},
            "learning_rate": {"low": 1e-4, "high": 1e-2, "log": True},
        },
        tunable=TUNABLE,
    )
    assert space["batch_size"].type == "int" and space["batch_size"].grid() == [16, 32, 48, 64]
    assert space["learning_rate"].type == "float" and space["learning_rate"].grid_size() is None


def test_any_name_without_a_trainer_schema():
    space = parse_space(
        {"lr": {"low": 1, "high": 3}, "dropout": {"low": 0.1, "high": 0.3, "step": 0.1}}, tunable=None
    )
    assert space["lr"].type == "int" and space["lr"].grid() == [1, 2, 3]
    assert space["dropout"].grid() == [0.1, 0.2, 0.3]  # no 0.30000000000000004


def test_grid_is_the_product_in_name_order():
    space = parse_space({"batch_size": [32, 64], "architecture": ["cnn", "mobilenet_v2"]}, tunable=TUNABLE)
    assert list(space.grid()) == [
        {"architecture": "cnn", "batch_size": 32},
        {"architecture": "cnn", "batch_size": 64},
        {"architecture": "mobilenet_v2", "batch_size": 32},
        {"architecture": "mobilenet_v2", "batch_size": 64},
    ]


@pytest.mark.parametrize(
    ("space", "max_trials", "field", "words"),
    [
        (
            {"batch_size": [16, 32, 64, 128, 256]},
            4,
            "space",
            "the grid has 5 points (5 batch_size), more than max_trials 4",
        ),
        (
            {"learning_rate": {"low": 0.001, "high": 0.01}},
            10,
            "space.learning_rate",
            "a grid needs the values",
        ),
    ],
)
def test_a_grid_that_cannot_run_is_refused(space, max_trials, field, words):
    with pytest.raises(SpaceError) as raised:
        check_settings(
            parse_space(space, tunable=TUNABLE), algorithm="grid", max_trials=max_trials, parallel_trials=2
        )
    assert raised.value.field == field and words in str(raised.value)


def test_random_points_are_reproducible_distinct_and_inside_the_space():
    space = parse_space(
        {
            "learning_rate": {"low": 1e-4, "high": 1e-1, "log": True},
            "batch_size": [16, 32, 64, 128],
            "epochs": {"low": 1, "high": 20, "log": True, "type": "int"},
        },
        tunable=TUNABLE,
    )
    first = random_points(space, 16, seed=7)
    assert first == random_points(space, 16, seed=7)
    assert first != random_points(space, 16, seed=8)
    assert len({tuple(sorted(p.items())) for p in first}) == 16
    for point in first:
        assert 1e-4 <= point["learning_rate"] <= 1e-1 and point["batch_size"] in (16, 32, 64, 128)
        assert isinstance(point["epochs"], int) and 1 <= point["epochs"] <= 20
    # log-uniform: about as many draws per decade
    decades = [
        sum(1 for p in random_points(space, 300, seed=1) if 10**k <= p["learning_rate"] < 10 ** (k + 1))
        for k in (-4, -3, -2)
    ]
    assert min(decades) > 60, decades


def test_random_points_stop_when_a_finite_space_runs_out():
    space = parse_space({"batch_size": [16, 32], "architecture": ["cnn"]}, tunable=TUNABLE)
    points = random_points(space, 10, seed=0)
    assert sorted(p["batch_size"] for p in points) == [16, 32]
