"""The pod's one termination grace period: the trainer's SIGTERM checkpoint, then the final sync pass."""

from __future__ import annotations

import pytest

from kubetrain.pod_spec import FINAL_PASS_FIXED, SYNC_MARGIN, grace_period_for, sync_grace


@pytest.mark.parametrize("grace", [30, 60, 300, 3600])
def test_the_trainer_and_the_final_pass_share_the_grace_period(grace):
    sidecar = sync_grace(grace)
    trainer = min(60, grace // 4)
    assert 0 < sidecar and trainer + sidecar + SYNC_MARGIN == grace


@pytest.mark.parametrize(
    ("checkpoint_bytes", "grace"),
    [(1_000_000, 30), (2_000_000_000, 153), (20_000_000_000, 1075)],
)
def test_grace_period_follows_the_checkpoint_size(checkpoint_bytes, grace):
    assert grace_period_for(checkpoint_bytes) == grace
    assert sync_grace(grace) >= -(-checkpoint_bytes // 20_000_000) + FINAL_PASS_FIXED
    assert sync_grace(grace - 1) < -(-checkpoint_bytes // 20_000_000) + FINAL_PASS_FIXED or grace == 30


def test_bad_sizes_are_named():
    with pytest.raises(ValueError, match="checkpoint_bytes=-1"):
        grace_period_for(-1)
