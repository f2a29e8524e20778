"""A sweep DAG's fixed settings, its Params, and the check of a run's settings (the plan).

Light at import (DAG files build their Params from it at parse time): Airflow's Param and
the space module only.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from airflow.sdk import Param

from kubetrain.sweep.space import ALGORITHMS, SpaceError, check_settings, parse_space, space_param_schema
from kubetrain_contract.early_stop import hyperband_brackets

# Params of a sweep that say how to search, not what one trial trains: never part of a trial's fingerprint.
SWEEP_PARAMS = ("space", "algorithm", "max_trials", "parallel_trials", "seed", "objective", "early_stopping")
EARLY_STOPPING_RULES = ("off", "median", "asha", "hyperband")
# The settings of each rule and their defaults (the sidecar's: trainer/sync/median.py, trainer/sync/asha.py).
MEDIAN_SETTINGS = {"min_trials": 3, "start_step": 4}
RUNG_SETTINGS = {"min_resource": 1, "reduction_factor": 3, "grace": 1}
_METRIC = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,127}$")


def parallel_choices(bound: int) -> tuple[int, ...]:
    """The ``parallel_trials`` a DAG offers: powers of two below ``bound``, and ``bound``."""
    if bound < 1:
        raise ValueError(f"max_parallel_trials={bound!r} is not valid: expected an integer >= 1")
    choices = {bound}
    power = 1
    while power < bound:
        choices.add(power)
        power *= 2
    return tuple(sorted(choices))


@dataclass(frozen=True)
class SweepSettings:
    """What a sweep DAG fixes when it is parsed.

    :param tunable: the hyperparameters the space may name, each with its Param's JSON schema
        (values are checked against it); ``None`` accepts any name (a container that reads its
        hyperparameters as ``--name=value`` arguments, see ``hyperparameter_args``).
    :param objective: the default objective: the trainer's monitored metric and ``max``/``min``.
    :param max_parallel_trials: the most trials of one sweep that run at once. Airflow's
        ``max_active_tis_per_dagrun`` is fixed when the DAG is parsed, so the ``parallel_trials``
        Param chooses among static variants (:func:`parallel_choices`); the ``gpu`` pool bounds
        the GPU pods of every DAG together.
    :param rounds: tpe rounds unrolled in the DAG (grid and random use the first only).
    :param hyperparameter_args: append each trial's values to the container's arguments as
        ``--name=value`` (for a container whose argument templates do not read ``params``).
    """

    tunable: Mapping[str, Mapping[str, Any] | None] | None
    objective: tuple[str, str] = ("val_accuracy", "max")
    max_parallel_trials: int = 4
    rounds: int = 4
    hyperparameter_args: bool = False

    def __post_init__(self) -> None:
        parallel_choices(self.max_parallel_trials)
        if not isinstance(self.rounds, int) or self.rounds < 1:
            raise ValueError(f"rounds={self.rounds!r} is not valid: expected an integer >= 1")
        if self.objective[1] not in ("max", "min") or not _METRIC.match(self.objective[0]):
            raise ValueError(
                f"objective={self.objective!r} is not valid: expected (metric name, 'max' or 'min')"
            )

    @property
    def parallel_choices(self) -> tuple[int, ...]:
        return parallel_choices(self.max_parallel_trials)

    def params(
        self,
        *,
        space: Mapping[str, Any],
        algorithm: str = "random",
        max_trials: int = 8,
        parallel_trials: int | None = None,
        min_trials: int = 3,
        start_step: int = 4,
    ) -> dict[str, Param]:
        """The sweep's Params (section "Sweep"), with these defaults."""
        tunable = sorted(self.tunable) if self.tunable is not None else None
        names = (
            f" ({', '.join(tunable)})" if tunable else " (any name; each trial gets --name=value arguments)"
        )
        return {
            "space": Param(
                dict(space),
                **space_param_schema(tunable),
                title="Search space",
                description="Per hyperparameter"
                + names
                + ': a list of values, {"choices": [...]}, or a range '
                '{"low": 0.0001, "high": 0.1, "log": true, "step": null, "type": "float"}. A hyperparameter of '
                "the space overrides its fixed Param in every trial.",
                section="Sweep",
            ),
            "algorithm": Param(
                algorithm,
                type="string",
                enum=list(ALGORITHMS),
                title="Algorithm",
                description="grid: every point of the space (each hyperparameter a list, choices or a stepped "
                "range); random: max_trials points drawn with the seed; tpe: Bayesian search (Optuna's TPE) "
                "in rounds of parallel_trials trials, each round learning from the trials before it.",
                section="Sweep",
            ),
            "max_trials": Param(
                max_trials,
                type="integer",
                minimum=1,
                maximum=1000,
                title="Max trials",
                description="Trials at most; a grid larger than this is refused.",
                section="Sweep",
            ),
            "parallel_trials": Param(
                parallel_trials or self.max_parallel_trials,
                type="integer",
                enum=list(self.parallel_choices),
                title="Parallel trials",
                description=f"Trials that run at once (at most {self.max_parallel_trials}, this DAG's bound; the "
                "gpu pool bounds all GPU pods). tpe asks for this many per round.",
                section="Sweep",
            ),
            "seed": Param(
                0,
                type="integer",
                minimum=0,
                maximum=2**31 - 1,
                title="Seed",
                description="Seed of random and tpe: the same space, seed and data give the same trials.",
                section="Sweep",
            ),
            "objective": Param(
                {"metric": self.objective[0], "mode": self.objective[1]},
                type="object",
                properties={
                    "metric": {"type": "string", "pattern": _METRIC.pattern},
                    "mode": {"type": "string", "enum": ["max", "min"]},
                },
                required=["metric", "mode"],
                additionalProperties=False,
                title="Objective",
                description="The metric that ranks trials (a history.csv column or metrics.jsonl key, e.g. "
                f"val_accuracy) and whether larger is better; default: the trainer's monitor, {self.objective[0]}.",
                section="Sweep",
            ),
            "early_stopping": Param(
                {"rule": "off", "min_trials": min_trials, "start_step": start_step},
                type="object",
                properties={
                    "rule": {"type": "string", "enum": list(EARLY_STOPPING_RULES)},
                    "min_trials": {"type": "integer", "minimum": 1},
                    "start_step": {"type": "integer", "minimum": 1},
                    "min_resource": {"type": "integer", "minimum": 1},
                    "reduction_factor": {"type": "integer", "minimum": 2},
                    "grace": {"type": "integer", "minimum": 1},
                    "max_resource": {"type": ["integer", "null"], "minimum": 1},
                    "brackets": {"type": ["integer", "null"], "minimum": 1},
                },
                required=["rule"],
                additionalProperties=False,
                title="Early stopping",
                description="median: stop a trial whose best objective after start_step reports is worse than "
                "the median of the finished trials' running averages at the same report (Katib's medianstop), "
                "once min_trials trials have finished. asha: at each rung, min_resource * reduction_factor**k "
                "reports (from grace reports on, below max_resource, a trial's reports at full training: when "
                "unset, the run's epochs if the space does not search them), only the top 1/reduction_factor "
                "of the trials that have reached the rung go on. "
                "hyperband: asha in brackets (default: as many as max_resource allows, else 3) whose first "
                "rungs are min_resource * reduction_factor**b; each trial is assigned one by its number.",
                section="Sweep",
            ),
        }

    def plan(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Check a run's sweep settings and size its rounds; :class:`SpaceError` names the bad field.

        :param params: the run's Params.
        """
        space = parse_space(params.get("space"), tunable=self.tunable)
        algorithm = params.get("algorithm")
        max_trials = params.get("max_trials")
        parallel = params.get("parallel_trials")
        seed = params.get("seed", 0)
        check_settings(space, algorithm=algorithm, max_trials=max_trials, parallel_trials=parallel)
        if parallel not in self.parallel_choices:
            raise SpaceError(
                "parallel_trials",
                f"{parallel!r} is not offered by this DAG: expected one of {list(self.parallel_choices)} "
                f"(its bound is {self.max_parallel_trials})",
            )
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise SpaceError("seed", f"{seed!r} is not an integer >= 0")
        objective = params.get("objective") or {}
        metric, mode = objective.get("metric"), objective.get("mode")
        if not isinstance(metric, str) or not _METRIC.match(metric):
            raise SpaceError("objective.metric", f"{metric!r} is not a metric name, e.g. 'val_accuracy'")
        if mode not in ("max", "min"):
            raise SpaceError("objective.mode", f"{mode!r} is not valid: expected 'max' or 'min'")
        early = dict(params.get("early_stopping") or {"rule": "off"})
        rule = early.get("rule", "off")
        if rule not in EARLY_STOPPING_RULES:
            raise SpaceError(
                "early_stopping.rule",
                f"{rule!r} is not a rule: expected one of {', '.join(EARLY_STOPPING_RULES)}",
            )
        for key, default in MEDIAN_SETTINGS.items():
            value = early.setdefault(key, default)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpaceError(f"early_stopping.{key}", f"{value!r} is not an integer >= 1")
        if rule in ("asha", "hyperband"):
            if early.get("max_resource") is None:
                early["max_resource"] = epochs_budget(params, space.names, early)
            early.update(rung_settings(early))
        if algorithm == "grid":
            sizes = [space.grid_size()]
        elif algorithm == "random":
            sizes = [max_trials]
        else:
            count = math.ceil(max_trials / parallel)
            if count > self.rounds:
                raise SpaceError(
                    "max_trials",
                    f"tpe runs at most {self.rounds} rounds of parallel_trials ({parallel}) trials in this DAG, "
                    f"{self.rounds * parallel} trials, fewer than max_trials {max_trials}: raise parallel_trials "
                    "or lower max_trials",
                )
            sizes = [parallel] * (count - 1) + [max_trials - parallel * (count - 1)]
        return {
            "space": space.to_json(),
            "algorithm": algorithm,
            "max_trials": max_trials,
            "parallel_trials": parallel,
            "seed": seed,
            "objective": {"metric": metric, "mode": mode},
            "early_stopping": early,
            "rounds": sizes,
        }

    def fixed_params(self, params: Mapping[str, Any], exclude: Sequence[str]) -> dict[str, Any]:
        """The run's Params that every trial trains with (the sweep's own Params left out)."""
        return {k: v for k, v in params.items() if k not in SWEEP_PARAMS and k not in exclude}


def epochs_budget(params: Mapping[str, Any], searched: Sequence[str], early: Mapping[str, Any]) -> int | None:
    """A trial's reports at full training when ``max_resource`` is not set: the run's ``epochs``
    Param, which every trial shares when the space does not search it (kubetrain's trainers report
    once an epoch), so that no rung is placed at or past a trial's last report; ``None`` when the
    epochs are searched, missing, or not above ``min_resource`` (no rung could judge a trial then,
    and the rule places rungs without a bound as before).

    :param params: the run's Params.
    :param searched: the names the space searches.
    :param early: the run's ``early_stopping`` Param.
    """
    epochs = params.get("epochs")
    if "epochs" in searched or not isinstance(epochs, int) or isinstance(epochs, bool):
        return None
    min_resource = early.get("min_resource", RUNG_SETTINGS["min_resource"])
    if not isinstance(min_resource, int) or isinstance(min_resource, bool) or epochs <= min_resource:
        return None
    return epochs


def rung_settings(early: Mapping[str, Any]) -> dict[str, Any]:
    """The checked settings of the asha or hyperband rule, with their defaults; :class:`SpaceError`
    names the bad one.

    :param early: the run's ``early_stopping`` Param.
    """
    out: dict[str, Any] = {}
    for key, least in (("min_resource", 1), ("reduction_factor", 2), ("grace", 1)):
        value = early.get(key, RUNG_SETTINGS[key])
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise SpaceError(f"early_stopping.{key}", f"{value!r} is not an integer >= {least}")
        out[key] = value
    for key in ("max_resource", "brackets"):
        value = early.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise SpaceError(f"early_stopping.{key}", f"{value!r} is not an integer >= 1 (or null)")
        out[key] = value
    if out["max_resource"] is not None and out["max_resource"] <= out["min_resource"]:
        raise SpaceError(
            "early_stopping.max_resource",
            f"{out['max_resource']!r} is not above min_resource {out['min_resource']}: no rung would judge a trial",
        )
    if early.get("rule") == "hyperband":
        if out["brackets"] is None:
            out["brackets"] = hyperband_brackets(
                out["min_resource"], out["max_resource"], out["reduction_factor"]
            )
    elif out["brackets"] not in (None, 1):
        raise SpaceError(
            "early_stopping.brackets",
            f"{out['brackets']!r} is not valid for asha, one bracket: use hyperband",
        )
    else:
        out["brackets"] = 1
    return out
