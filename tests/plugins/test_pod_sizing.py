"""The pod's numbers: the one termination grace period (the trainer's SIGTERM checkpoint, then the
final sync pass) and the checked integers of its settings."""

from __future__ import annotations

import re

import pytest

from kubetrain.pod_sizing import SYNC_MARGIN, TRAINER_SHARE_MAX, checked_int, sync_grace


@pytest.mark.parametrize(("grace", "sidecar"), [(1, 1), (30, 13), (60, 35), (300, 230), (3600, 3530)])
def test_the_trainer_and_the_final_pass_share_the_grace_period(grace, sidecar):
    assert sync_grace(grace) == sidecar
    trainer = min(TRAINER_SHARE_MAX, grace // 4)
    assert grace == 1 or trainer + sidecar + SYNC_MARGIN == grace


@pytest.mark.parametrize(
    ("value", "minimum", "expected"), [(3, 1, 3), ("2", 0, 2), (0, 0, 0), ("10", 10, 10)]
)
def test_templated_integers_are_read(value, minimum, expected):
    assert checked_int("n", value, minimum=minimum) == expected


@pytest.mark.parametrize("value", [True, 2.0, "two", "1.5", None, 0])
def test_other_integers_are_refused_naming_the_value(value):
    with pytest.raises(ValueError, match=re.escape(f"n={value!r} is not valid: expected an integer >= 1")):
        checked_int("n", value, minimum=1)
