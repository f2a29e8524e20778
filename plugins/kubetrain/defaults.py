"""Defaults every kubetrain DAG shares (light: DAG files import it at parse time)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from kubetrain.settings import environ


def seconds_from_env(name: str, default: int) -> int:
    """A whole number of seconds >= 0 from the environment variable ``name``, else ``default``.

    :raises ValueError: naming the variable, its value and what is expected.
    """
    text = environ(name)
    if text is None or not text.strip():
        return default
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name}={text!r}: expected a whole number of seconds >= 0")
    return value


DEFAULT_ARGS: dict[str, Any] = {
    "owner": "kubetrain",
    "retries": 2,
    "retry_delay": timedelta(seconds=seconds_from_env("KUBETRAIN_RETRY_DELAY_SECONDS", 30)),
    # Applied by Airflow only to the operators that take it: the training operators, whose pod (or
    # replica) fails its task once it has been unschedulable this long with no autoscaler adding a node.
    "unschedulable_grace_seconds": seconds_from_env("KUBETRAIN_UNSCHEDULABLE_GRACE_SECONDS", 60),
}
