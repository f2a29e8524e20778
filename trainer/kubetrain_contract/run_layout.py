"""A run's files in S3, as the pod writes them and the Airflow side reads them.

Below a run's prefix (``s3://<training bucket>/runs/<dag_id>/<run>``)::

    checkpoints/...                 the trainer's CHECKPOINT_DIR, synced by the sidecar
    output/metrics.json             final and best metrics (METRICS_JSON)
    output/params.json              hyperparameters, dataset version, image (PARAMS_JSON)
    output/history.csv              one row an epoch (kubetrain_contract.reports.HISTORY_CSV)
    output/metrics.jsonl            one report a line (kubetrain_contract.reports.METRICS_JSONL)
    output/confusion_matrix.json    a classifier's (CONFUSION_MATRIX_JSON)
    output/samples.json             a dialogue model's replies (SAMPLES_JSON)
    sync/pass-<8 digits>.json       the sidecar's pass manifests (:func:`pass_key`)
    run-record.json                 the run's record (RUN_RECORD_JSON)
"""

from __future__ import annotations

import re

METRICS_JSON = "metrics.json"
PARAMS_JSON = "params.json"
CONFUSION_MATRIX_JSON = "confusion_matrix.json"
SAMPLES_JSON = "samples.json"
RUN_RECORD_JSON = "run-record.json"
#: the run's area of pass manifests (beside checkpoints/ and output/)
SYNC_AREA = "sync"
MAX_PASS_NUMBER = 99_999_999
#: a pass manifest's key (or its name): the pass number in group 1
PASS_NAME = re.compile(r"(?:^|/)pass-(\d{8})\.json$")


def pass_prefix(run_key: str) -> str:
    """The key prefix every pass manifest of the run at ``run_key`` starts with (to list them)."""
    return f"{run_key.rstrip('/')}/{SYNC_AREA}/pass-"


def pass_key(run_key: str, number: int) -> str:
    """Key of the sync pass manifest number ``number`` below the run's key ``run_key``.

    :raises ValueError: ``number`` is not an integer from 0 to 99999999 (eight digits).
    """
    if not isinstance(number, int) or isinstance(number, bool) or not 0 <= number <= MAX_PASS_NUMBER:
        raise ValueError(
            f"sync pass number {number!r} is not valid: expected an integer from 0 to {MAX_PASS_NUMBER}"
        )
    return f"{pass_prefix(run_key)}{number:08d}.json"


def pass_number(key: str) -> int | None:
    """The pass number of a pass manifest's key, or ``None`` when ``key`` is not one."""
    match = PASS_NAME.search(key)
    return int(match.group(1)) if match else None
