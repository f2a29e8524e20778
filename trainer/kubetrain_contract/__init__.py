"""kubetrain's pod contract: what crosses between the Airflow side and the training pod, written once.

Standard library only, importing neither Airflow nor TensorFlow, so that both sides import the
same definitions: the Airflow wheel ships it (pyproject.toml), the trainer and sync images copy it
to ``/app/kubetrain_contract`` (trainer/Dockerfile, trainer/Dockerfile.sync), and a checkout finds
it through the ``kubetrain_contract`` link at the repository root.

* :mod:`kubetrain_contract.exit_codes`: the training container's exit codes and whether a
  retry could help, the one table the operators and the trainers follow;
* :mod:`kubetrain_contract.pod`: the pod's directories, the stop file and the ``KUBETRAIN_*``
  environment names the Airflow side sets and the pod side reads;
* :mod:`kubetrain_contract.records`: the versioned records (dataclasses with ``to_json`` and
  ``from_json``) and the JSON schemas generated from them, in ``kubetrain_contract/schemas/``;
* :mod:`kubetrain_contract.early_stop`: the early-stop record, the rung report and Hyperband's brackets;
* :mod:`kubetrain_contract.trial`: a sweep's trial, round and sweep records;
* :mod:`kubetrain_contract.manifests`: the dataset manifest and the sync-pass manifest;
* :mod:`kubetrain_contract.run_layout`: the names of a run's files and of its sync passes;
* :mod:`kubetrain_contract.reports`: what a trainer reports as it trains (metrics.jsonl, history.csv);
* :mod:`kubetrain_contract.s3uri`: ``s3://bucket/key`` URIs, checked as S3 names buckets;
* :mod:`kubetrain_contract.json_values`: values made JSON-safe (NaN and infinities as null);
* :mod:`kubetrain_contract.flags`: every flag of the built-in trainers, described once (the trainers' argparse
  and checks and the DAG forms' Params come from it), with the rules across flags;
* :mod:`kubetrain_contract.kit`: the kit for users' own training scripts (reports, atomic outputs, the stop
  file, SIGTERM as a flag), and :mod:`kubetrain_contract.keras_callback`, its Keras callback (``make kit``
  builds the ``kubetrain-contract`` wheel).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kubetrain_contract.exit_codes import EXIT_CODES, ExitCode, final_exit_codes
from kubetrain_contract.pod import CHECKPOINT_DIR, DATA_DIR, OUTPUT_DIR, STOP_FILE, Env
from kubetrain_contract.records import Record, RecordError

if TYPE_CHECKING:
    from kubetrain_contract.early_stop import EarlyStopRecord, RungReportRecord
    from kubetrain_contract.manifests import DatasetManifest, SyncPassRecord
    from kubetrain_contract.run import PromotionEvent, RunRecord
    from kubetrain_contract.trial import SweepRecord, SweepRoundRecord, TrialRecord

# The record modules load when first named (PEP 562): a pod-side tool that reads one manifest
# starts without defining every record's dataclass (about 50 ms of each start-up, measured with
# `python -X importtime -m trainer.sync stage-in --help`).
_RECORD_MODULES = {
    "EarlyStopRecord": "early_stop",
    "RungReportRecord": "early_stop",
    "TrialRecord": "trial",
    "SweepRoundRecord": "trial",
    "SweepRecord": "trial",
    "DatasetManifest": "manifests",
    "SyncPassRecord": "manifests",
    "RunRecord": "run",
    "PromotionEvent": "run",
}


def __getattr__(name: str):
    if name == "RECORDS":
        #: every versioned record; each has its schema file in ``schemas/``
        value = tuple(__getattr__(n) for n in _RECORD_MODULES)
    elif name in _RECORD_MODULES:
        value = getattr(importlib.import_module(f"kubetrain_contract.{_RECORD_MODULES[name]}"), name)
    else:
        raise AttributeError(f"module 'kubetrain_contract' has no attribute {name!r}")
    globals()[name] = value
    return value


__all__ = [
    "CHECKPOINT_DIR",
    "DATA_DIR",
    "EXIT_CODES",
    "RECORDS",
    "EarlyStopRecord",
    "RungReportRecord",
    "DatasetManifest",
    "SyncPassRecord",
    "Record",
    "RecordError",
    "RunRecord",
    "PromotionEvent",
    "OUTPUT_DIR",
    "STOP_FILE",
    "TrialRecord",
    "SweepRoundRecord",
    "SweepRecord",
    "Env",
    "ExitCode",
    "final_exit_codes",
]
