"""Defaults every kubetrain DAG shares (light: DAG files import it at parse time)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from kubetrain.settings import environ

DEFAULT_ARGS: dict[str, Any] = {
    "owner": "kubetrain",
    "retries": 2,
    "retry_delay": timedelta(seconds=int(environ("KUBETRAIN_RETRY_DELAY_SECONDS", "30"))),
}
