"""The training step on two replicas (two logical CPU devices, MirroredStrategy): the finite check
and clipping act on the all-replica gradient, and the NaN guard stops a diverged run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]


SCENARIOS = ("overflow", "nan_loss", "sgd", "clip")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    """Every scenario in one interpreter: TensorFlow starts once."""
    root = tmp_path_factory.mktemp("replicas")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.run(
        [sys.executable, str(HERE / "replica_scenarios.py"), str(root), *SCENARIOS],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def scenario(results: dict[str, dict], name: str) -> dict:
    result = results[name]
    assert "failed" not in result, result["failed"]
    return result


def test_an_overflow_on_replica_1_skips_the_step_on_every_replica(results):
    result = scenario(results, "overflow")
    assert result == {
        "weights_finite": True,
        "update_skipped": True,
        "loss_scale": 2.0**14,
        "optimizer_iterations": 0,
    }


def test_a_nan_loss_on_replica_1_stops_the_run_and_keeps_the_last_finite_checkpoint(results):
    result = scenario(results, "nan_loss")
    assert result["error"] is not None and result["error"].startswith(
        "training diverged at step 3 (epoch 1): the loss was NaN or infinite"
    )
    assert "The last finite checkpoint, ckpt-2 (step 2)" in result["error"]
    assert result["latest"] == "ckpt-2" and result["latest_finite"]


def test_two_replicas_apply_the_gradient_of_the_global_batch_once(results):
    result = scenario(results, "sgd")
    np.testing.assert_allclose(result["delta"], -np.asarray(result["gradient"]), atol=1e-6)


def test_clipping_bounds_the_norm_of_the_all_replica_gradient(results):
    result = scenario(results, "clip")
    delta, gradient = np.asarray(result["delta"]), -np.asarray(result["gradient"])
    assert np.linalg.norm(delta) == pytest.approx(
        0.05, rel=1e-4
    )  # not 2 x 0.05: one clip, not one per replica
    np.testing.assert_allclose(delta / np.linalg.norm(delta), gradient / np.linalg.norm(gradient), atol=1e-5)
