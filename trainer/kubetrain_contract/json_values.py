"""Values made fit for strict JSON, as both sides write their documents (``allow_nan=False``)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any


def json_safe(value: Any) -> Any:
    """``value`` with what strict JSON cannot hold made plain.

    NaN and infinities become ``None``; real numbers of other types (numpy's) become ``int``
    or ``float``; mapping keys become strings; tuples become lists; any other object
    becomes its text.
    """
    if value is None or isinstance(value, str | bool):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        number = float(value)
        return number if math.isfinite(number) else None
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return str(value)
