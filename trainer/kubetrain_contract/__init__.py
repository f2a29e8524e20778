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
* :mod:`kubetrain_contract.manifests`: the dataset manifest and the sync-pass manifest.
"""

from kubetrain_contract.early_stop import EarlyStopRecord, RungReportRecord
from kubetrain_contract.exit_codes import EXIT_CODES, ExitCode, final_exit_codes
from kubetrain_contract.manifests import DatasetManifest, SyncPassRecord
from kubetrain_contract.pod import CHECKPOINT_DIR, DATA_DIR, OUTPUT_DIR, STOP_FILE, Env
from kubetrain_contract.records import Record, RecordError
from kubetrain_contract.run import PromotionEvent, RunRecord
from kubetrain_contract.trial import SweepRecord, SweepRoundRecord, TrialRecord

#: every versioned record; each has its schema file in ``schemas/``
RECORDS: tuple[type[Record], ...] = (
    EarlyStopRecord,
    RungReportRecord,
    TrialRecord,
    SweepRoundRecord,
    SweepRecord,
    DatasetManifest,
    SyncPassRecord,
    RunRecord,
    PromotionEvent,
)

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
