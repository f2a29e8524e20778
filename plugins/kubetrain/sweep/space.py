"""The search space of a sweep: parsed, checked, enumerated (grid) and sampled (random).

A space is a JSON object, one entry per hyperparameter::

    {"batch_size": [16, 32, 64, 128],                               # a list of values
     "architecture": {"choices": ["cnn", "mobilenet_v2"]},          # categorical choices
     "learning_rate": {"low": 1e-4, "high": 1e-1, "log": true},     # a range (float)
     "epochs": {"low": 2, "high": 8, "step": 2, "type": "int"}}     # a range with a step

A list and ``choices`` are the same thing (categorical). A range has ``low`` <= ``high``,
optionally ``log`` (sampled log-uniformly; ``low`` > 0; no ``step``), ``step`` (values
``low + k * step`` up to ``high``) and ``type`` (``int`` or ``float``; default: the
hyperparameter's own Param type, else ``int`` when the bounds and step are integers).

Every error names the field (``space.learning_rate.low``, ``max_trials``) and what was
expected. Nothing here imports more than the standard library and jsonschema (which Airflow
itself needs), so DAG files may build the Param schema at parse time.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ALGORITHMS = ("grid", "random", "tpe")
KINDS = ("values", "range")
NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")
# Random draws until a new point turns up before the space counts as exhausted.
MAX_DRAWS_PER_TRIAL = 200
_RANGE_KEYS = {"low", "high", "log", "step", "type"}


class SpaceError(ValueError):
    """A search space (or a setting that goes with it) that cannot be searched; names the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        or (isinstance(value, float) and value.is_integer())
    )


def _clean_float(value: float) -> float:
    # Grid points low + k * step come out as 0.30000000000000004; 12 significant digits do not.
    return float(f"{value:.12g}")


@dataclass(frozen=True)
class Hyperparameter:
    """One dimension of the space.

    :param name: the hyperparameter (a Param of the training DAG, or a trainer flag).
    :param kind: ``values`` (a list or choices) or ``range``.
    :param values: the candidates of a ``values`` dimension.
    :param low: lower bound of a range.
    :param high: upper bound of a range (inclusive).
    :param log: sample a range log-uniformly.
    :param step: grid step of a range.
    :param type: ``int`` or ``float`` for a range.
    """

    name: str
    kind: str
    values: tuple[Any, ...] = ()
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    type: str = "float"

    @property
    def field(self) -> str:
        return f"space.{self.name}"

    def grid(self) -> list[Any]:
        """Every value of this dimension, in order; a float range needs a step."""
        if self.kind == "values":
            return list(self.values)
        assert self.low is not None and self.high is not None
        if self.type == "int":
            step = int(self.step or 1)
            return list(range(int(self.low), int(self.high) + 1, step))
        if not self.step:
            raise SpaceError(
                self.field,
                "a grid needs the values of every hyperparameter: give a list, choices, or a range with a step",
            )
        count = int(math.floor((self.high - self.low) / self.step + 1e-9)) + 1
        return [_clean_float(self.low + k * self.step) for k in range(count)]

    def grid_size(self) -> int | None:
        """How many values :meth:`grid` has; ``None`` for a float range without a step (unbounded)."""
        if self.kind == "values":
            return len(self.values)
        assert self.low is not None and self.high is not None
        if self.type == "int":
            return (int(self.high) - int(self.low)) // int(self.step or 1) + 1
        if not self.step:
            return None
        return int(math.floor((self.high - self.low) / self.step + 1e-9)) + 1

    def sample(self, rng: random.Random) -> Any:
        """One value drawn with ``rng``: uniform over values, log-uniform or uniform over a range."""
        if self.kind == "values":
            return self.values[rng.randrange(len(self.values))]
        assert self.low is not None and self.high is not None
        if self.step:
            return self.grid()[rng.randrange(self.grid_size() or 1)]
        if self.type == "int":
            if self.log:
                # log-uniform over [low, high + 1), floored: every integer gets its share of the log scale
                value = math.exp(rng.uniform(math.log(self.low), math.log(self.high + 1)))
                return min(int(self.high), max(int(self.low), int(math.floor(value))))
            return rng.randint(int(self.low), int(self.high))
        if self.log:
            return _clean_float(math.exp(rng.uniform(math.log(self.low), math.log(self.high))))
        return _clean_float(rng.uniform(self.low, self.high))

    def contains(self, value: Any) -> bool:
        """Whether ``value`` is a point of this dimension."""
        if self.kind == "values":
            return point_key({"v": value}) in {point_key({"v": v}) for v in self.values}
        if not _is_number(value) or (self.type == "int" and not _is_int(value)):
            return False
        assert self.low is not None and self.high is not None
        return self.low <= value <= self.high

    def to_json(self) -> Any:
        """The normalized form: ``{"choices": [...]}`` or the range's fields."""
        if self.kind == "values":
            return {"choices": list(self.values)}
        out: dict[str, Any] = {"low": self.low, "high": self.high, "type": self.type}
        if self.log:
            out["log"] = True
        if self.step:
            out["step"] = self.step
        return out


@dataclass(frozen=True)
class Space:
    """The hyperparameters of a sweep, in name order."""

    hyperparameters: tuple[Hyperparameter, ...]

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.hyperparameters]

    def __getitem__(self, name: str) -> Hyperparameter:
        for h in self.hyperparameters:
            if h.name == name:
                return h
        raise KeyError(name)

    def grid_size(self) -> int | None:
        """Points of the full grid; ``None`` when a float range has no step."""
        size = 1
        for h in self.hyperparameters:
            n = h.grid_size()
            if n is None:
                return None
            size *= n
        return size

    def grid(self) -> Iterator[dict[str, Any]]:
        """Every point of the grid, the last hyperparameter (by name) varying fastest."""
        axes = [h.grid() for h in self.hyperparameters]
        for combination in itertools.product(*axes):
            yield dict(zip(self.names, combination, strict=True))

    def to_json(self) -> dict[str, Any]:
        return {h.name: h.to_json() for h in self.hyperparameters}


def point_key(point: Mapping[str, Any]) -> str:
    """A canonical string of a point, to find duplicates."""
    return json.dumps(point, sort_keys=True, default=str)


def random_points(space: Space, count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` distinct points drawn with ``random.Random(seed)`` (fewer when a finite space runs out).

    The same space, count and seed give the same points, in the same order, on any machine:
    the stream depends only on Python's Mersenne Twister and the hyperparameters' names.
    """
    rng = random.Random(seed)
    seen: set[str] = set()
    points: list[dict[str, Any]] = []
    limit = space.grid_size()
    while len(points) < count and (limit is None or len(points) < limit):
        for _ in range(MAX_DRAWS_PER_TRIAL):
            point = {h.name: h.sample(rng) for h in space.hyperparameters}
            key = point_key(point)
            if key not in seen:
                seen.add(key)
                points.append(point)
                break
        else:
            break  # the space has (nearly) no new points left
    return points


# -- parsing and checking ------------------------------------------------------------------------


def _param_schema(schema: Mapping[str, Any] | None) -> dict[str, Any] | None:
    # A Param's schema carries form-only keys (title, section, description) that jsonschema ignores.
    return dict(schema) if schema else None


def _check_against(field: str, value: Any, schema: Mapping[str, Any] | None) -> None:
    """Refuse a candidate value that the hyperparameter's own Param would refuse."""
    if not schema:
        return
    import jsonschema

    validator = jsonschema.Draft202012Validator(_param_schema(schema))
    error = next(iter(sorted(validator.iter_errors(value), key=str)), None)
    if error is not None:
        raise SpaceError(field, f"{value!r} is not a valid value of this Param: {error.message}")


def _range_type(name: str, spec: Mapping[str, Any], schema: Mapping[str, Any] | None) -> str:
    declared = spec.get("type")
    if declared is not None:
        if declared not in ("int", "float"):
            raise SpaceError(
                f"space.{name}.type", f"{declared!r} is not a range type: expected 'int' or 'float'"
            )
        return declared
    types = (schema or {}).get("type")
    types = types if isinstance(types, list) else [types]
    if "integer" in types and "number" not in types:
        return "int"
    if "number" in types:
        return "float"
    numbers = [spec.get("low"), spec.get("high"), *([spec["step"]] if spec.get("step") is not None else [])]
    return "int" if all(isinstance(v, int) and not isinstance(v, bool) for v in numbers) else "float"


def parse_hyperparameter(name: str, spec: Any, schema: Mapping[str, Any] | None = None) -> Hyperparameter:
    """One entry of a space, checked; ``schema`` is the JSON schema of the Param it sets, if any."""
    field = f"space.{name}"
    if isinstance(spec, list):
        spec = {"choices": spec}
    if not isinstance(spec, Mapping):
        raise SpaceError(
            field,
            f'{spec!r} is not a hyperparameter: expected a list of values, {{"choices": [...]}} or a range '
            '{"low": ..., "high": ..., "log": false, "step": null, "type": "int|float"}',
        )
    if "choices" in spec:
        extra = sorted(set(spec) - {"choices"})
        if extra:
            raise SpaceError(field, f"choices cannot be combined with {', '.join(extra)}")
        values = spec["choices"]
        if not isinstance(values, list) or not values:
            raise SpaceError(field, f"{values!r} is empty or not a list: expected at least one value")
        for index, value in enumerate(values):
            if not (value is None or isinstance(value, bool | int | float | str)) or (
                isinstance(value, float) and not math.isfinite(value)
            ):
                raise SpaceError(
                    f"{field}[{index}]",
                    f"{value!r} is not a plain value: expected a number, string, boolean or null",
                )
            _check_against(f"{field}[{index}]", value, schema)
        if len({point_key({"v": v}) for v in values}) != len(values):
            raise SpaceError(field, f"{values!r} lists a value twice")
        return Hyperparameter(name, "values", values=tuple(values))
    unknown = sorted(set(spec) - _RANGE_KEYS)
    if unknown:
        raise SpaceError(
            field, f"unknown key(s) {', '.join(unknown)}: a range has low, high, log, step and type"
        )
    for bound in ("low", "high"):
        if bound not in spec:
            raise SpaceError(f"{field}.{bound}", "missing: a range needs low and high")
        if not _is_number(spec[bound]):
            raise SpaceError(f"{field}.{bound}", f"{spec[bound]!r} is not a number")
    low, high = spec["low"], spec["high"]
    if low > high:
        raise SpaceError(field, f"low {low!r} > high {high!r}: expected low <= high")
    kind = _range_type(name, spec, schema)
    log = spec.get("log", False)
    if not isinstance(log, bool):
        raise SpaceError(f"{field}.log", f"{log!r} is not a boolean")
    step = spec.get("step")
    if step is not None:
        if not _is_number(step) or step <= 0:
            raise SpaceError(f"{field}.step", f"{step!r} is not a number > 0")
        if log:
            raise SpaceError(field, "log and step cannot be combined: a log range is sampled, not stepped")
    if log and low <= 0:
        raise SpaceError(f"{field}.low", f"{low!r} must be > 0 for a log range")
    if kind == "int":
        for key, value in (("low", low), ("high", high), ("step", step)):
            if value is not None and not _is_int(value):
                raise SpaceError(
                    f"{field}.{key}", f"{value!r} is not an integer, and the range's type is int"
                )
        low, high = int(low), int(high)
        step = int(step) if step is not None else None
    else:
        low, high = float(low), float(high)
        step = float(step) if step is not None else None
    _check_against(f"{field}.low", low, schema)
    _check_against(f"{field}.high", high, schema)
    return Hyperparameter(name, "range", low=low, high=high, log=log, step=step, type=kind)


def parse_space(raw: Any, *, tunable: Mapping[str, Mapping[str, Any] | None] | None = None) -> Space:
    """A space from its JSON form, every entry checked.

    :param raw: the ``space`` Param's value.
    :param tunable: the hyperparameters this trainer has, each with its Param's JSON schema
        (``None``: no schema to check values against); ``None`` accepts any name (a container
        that gets its hyperparameters as ``--name=value`` arguments).
    """
    if not isinstance(raw, Mapping) or not raw:
        raise SpaceError(
            "space", f"{raw!r} is not a search space: expected an object with at least one hyperparameter"
        )
    hyperparameters = []
    for name in sorted(raw):
        if not isinstance(name, str) or not NAME.match(name):
            raise SpaceError(
                f"space.{name}", "is not a hyperparameter name: expected letters, digits, '_', '.' and '-'"
            )
        if tunable is not None and name not in tunable:
            known = ", ".join(sorted(tunable)) or "none"
            raise SpaceError(f"space.{name}", f"unknown hyperparameter: this trainer's are {known}")
        hyperparameters.append(parse_hyperparameter(name, raw[name], (tunable or {}).get(name)))
    return Space(tuple(hyperparameters))


def check_settings(space: Space, *, algorithm: object, max_trials: object, parallel_trials: object) -> None:
    """Refuse an algorithm that cannot search ``space`` within ``max_trials``; the settings come as a run's
    Params give them, unchecked."""
    if algorithm not in ALGORITHMS:
        raise SpaceError(
            "algorithm", f"{algorithm!r} is not an algorithm: expected one of {', '.join(ALGORITHMS)}"
        )
    if not isinstance(max_trials, int) or isinstance(max_trials, bool) or max_trials < 1:
        raise SpaceError("max_trials", f"{max_trials!r} is not an integer >= 1")
    if not isinstance(parallel_trials, int) or isinstance(parallel_trials, bool) or parallel_trials < 1:
        raise SpaceError("parallel_trials", f"{parallel_trials!r} is not an integer >= 1")
    if algorithm == "grid":
        for h in space.hyperparameters:
            h.grid()  # a float range without a step says so, naming the field
        size = space.grid_size()
        assert size is not None
        if size > max_trials:
            dims = " x ".join(f"{h.grid_size()} {h.name}" for h in space.hyperparameters)
            raise SpaceError(
                "space",
                f"the grid has {size} points ({dims}), more than max_trials {max_trials}: "
                "raise max_trials or give fewer values",
            )


def tunable_schemas(params: Mapping[str, Any], names: Sequence[str]) -> dict[str, dict[str, Any] | None]:
    """``{name: JSON schema}`` of the Params named ``names`` (Param objects or plain schemas)."""
    out: dict[str, dict[str, Any] | None] = {}
    for name in names:
        param = params.get(name)
        schema = getattr(param, "schema", param)
        out[name] = (
            {k: v for k, v in dict(schema).items() if k not in ("title", "description", "section")}
            if schema
            else None
        )
    return out


def space_param_schema(tunable: Sequence[str] | None) -> dict[str, Any]:
    """The JSON schema of the ``space`` Param: what the trigger form can refuse before a run exists.

    Unknown names (with a known trainer), empty lists and malformed entries fail here; bounds
    that need arithmetic (low > high, a grid larger than max_trials) are the plan task's.
    """
    value = {"type": ["number", "string", "boolean", "null"]}
    # One schema for both forms (no oneOf), so that an error's path names the hyperparameter.
    entry = {
        "type": ["array", "object"],
        "minItems": 1,
        "items": value,
        "properties": {
            "choices": {"type": "array", "minItems": 1, "items": value},
            "low": {"type": "number"},
            "high": {"type": "number"},
            "log": {"type": "boolean"},
            "step": {"type": ["number", "null"], "exclusiveMinimum": 0},
            "type": {"enum": ["int", "float"]},
        },
        "additionalProperties": False,
        "anyOf": [{"type": "array"}, {"required": ["choices"]}, {"required": ["low", "high"]}],
    }
    names: dict[str, Any] = {"pattern": NAME.pattern}
    if tunable is not None:
        names = {"enum": sorted(tunable)}
    return {"type": "object", "minProperties": 1, "propertyNames": names, "additionalProperties": entry}
