"""Bayesian search (TPE) with Optuna's ask-and-tell, the study rebuilt from the trial records.

No study database: each round's suggest task builds an in-memory study, tells it every
finished trial of the sweep (their records in S3), and asks for the round's batch. Optuna is
imported here only, when a tpe round runs; DAG files never import this module.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from kubetrain.extras import missing_extra
from kubetrain.sweep.space import Hyperparameter, Space, point_key


def distribution(h: Hyperparameter):
    """The Optuna distribution of one dimension of the space."""
    try:
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
    except ModuleNotFoundError as exc:
        raise missing_extra("tpe", exc) from exc

    if h.kind == "values":
        return CategoricalDistribution(list(h.values))
    assert h.low is not None and h.high is not None  # a range has both bounds (as Space parses it)
    if h.type == "int":
        return IntDistribution(int(h.low), int(h.high), log=h.log, step=int(h.step or 1))
    return FloatDistribution(float(h.low), float(h.high), log=h.log, step=h.step)


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def tpe_points(
    space: Space,
    history: Sequence[Mapping[str, Any]],
    *,
    count: int,
    seed: int,
    mode: str,
    startup_trials: int,
) -> list[dict[str, Any]]:
    """The next ``count`` points of a TPE search that has seen ``history``.

    :param space: the search space.
    :param history: the sweep's trial records so far (``params``, ``status``, ``stopped_early``,
        ``objective``: ``{"value", "values"}``), oldest first. Finished trials are told as
        complete, trials stopped early as pruned (with their objective per report), failed ones
        as failed.
    :param count: points to ask for.
    :param seed: the sampler's seed; with the same history the same points come back.
    :param mode: ``max`` or ``min``.
    :param startup_trials: trials drawn at random before TPE models the history.
    """
    try:
        import optuna
        from optuna.samplers import TPESampler
        from optuna.trial import TrialState, create_trial
    except ModuleNotFoundError as exc:
        raise missing_extra("tpe", exc) from exc

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    distributions = {h.name: distribution(h) for h in space.hyperparameters}
    study = optuna.create_study(
        direction="maximize" if mode == "max" else "minimize",
        sampler=TPESampler(seed=seed, n_startup_trials=startup_trials),
    )
    seen: set[str] = set()
    for record in history:
        params = record.get("params") or {}
        if set(params) != set(distributions) or not all(
            space[name].contains(v) for name, v in params.items()
        ):
            continue  # a point outside this space (it changed since): nothing to learn from it
        seen.add(point_key(params))
        objective = record.get("objective") or {}
        value = _finite(objective.get("value"))
        steps = {i + 1: v for i, v in enumerate(map(_finite, objective.get("values") or [])) if v is not None}
        succeeded = record.get("status") == "success"
        if succeeded and not record.get("stopped_early") and value is not None:
            trial = create_trial(
                state=TrialState.COMPLETE,
                value=value,
                params=dict(params),
                distributions=distributions,
                intermediate_values=steps,
            )
        elif succeeded and steps:
            trial = create_trial(
                state=TrialState.PRUNED,
                params=dict(params),
                distributions=distributions,
                intermediate_values=steps,
            )
        else:
            trial = create_trial(state=TrialState.FAIL, params=dict(params), distributions=distributions)
        study.add_trial(trial)
    points: list[dict[str, Any]] = []
    # A point already tried (or asked for in this batch) is asked for again, a bounded number of times.
    for _ in range(count * 20):
        if len(points) == count:
            break
        asked = study.ask(distributions)
        point = {name: asked.params[name] for name in distributions}
        key = point_key(point)
        if key in seen:
            study.tell(asked, state=TrialState.FAIL)
            continue
        seen.add(key)
        points.append(point)
    return points
