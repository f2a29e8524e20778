"""Defaults every kubetrain DAG shares (light: DAG files import it at parse time)."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

DEFAULT_ARGS: dict[str, Any] = {
    "owner": "kubetrain",
    "retries": 2,
    "retry_delay": timedelta(seconds=int(os.environ.get("KUBETRAIN_RETRY_DELAY_SECONDS", "30"))),
}
