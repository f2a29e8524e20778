"""The training pod's directories, its stop file and the environment names of the contract."""

from __future__ import annotations

# The pod contract's directories: emptyDir volumes in the pod, the images' defaults too.
DATA_DIR = "/data"
CHECKPOINT_DIR = "/checkpoints"
OUTPUT_DIR = "/output"
# The file whose appearance tells a trainer to stop (a sweep's early stopping); in CHECKPOINT_DIR, the one
# volume both the trainer and the sync sidecar write.
STOP_FILE = f"{CHECKPOINT_DIR}/.kubetrain-stop"


class Env:
    """Names of the environment variables of the training pod, the one registry both sides use.

    The Airflow side sets them in the pod (which container gets which, and what each means:
    trainer/sync/schemas/pod-env.v1.json) and the pod side reads them by these names; the pod
    side's tuning options, which the Airflow side leaves to their defaults, are here too.
    """

    DATA_DIR = "DATA_DIR"
    CHECKPOINT_DIR = "CHECKPOINT_DIR"
    OUTPUT_DIR = "OUTPUT_DIR"
    RUN_URI = "KUBETRAIN_RUN_URI"
    IMAGE = "KUBETRAIN_IMAGE"
    CODE_VERSION = "KUBETRAIN_CODE_VERSION"
    DATASET_MANIFEST = "KUBETRAIN_DATASET_MANIFEST"
    DATASET_VERSION = "KUBETRAIN_DATASET_VERSION"
    CACHE_DIR = "KUBETRAIN_CACHE_DIR"
    # the prepared copies of the dataset version (decoded, checked, resized records): where the trainer
    # reads and writes them, and the S3 prefix the stage-in downloads them from and the sidecar uploads to
    PREPARED_DIR = "KUBETRAIN_PREPARED_DIR"
    PREPARED_URI = "KUBETRAIN_PREPARED_URI"
    # bytes /data may hold (its emptyDir's sizeLimit): the trainer refuses a prepared copy that cannot fit
    DATA_SIZE_BYTES = "KUBETRAIN_DATA_SIZE_BYTES"
    STOP_FILE = "KUBETRAIN_STOP_FILE"
    # the checkpoint-sync sidecar's settings, and the pod's name (a fieldRef) for its pass manifests
    SYNC_INTERVAL = "KUBETRAIN_SYNC_INTERVAL"
    SYNC_QUIET = "KUBETRAIN_SYNC_QUIET"
    SYNC_GRACE = "KUBETRAIN_SYNC_GRACE"
    SYNC_SETTLE = "KUBETRAIN_SYNC_SETTLE"
    HOSTNAME = "HOSTNAME"
    # a sweep trial's early stopping, read by its sidecar
    EARLY_STOPPING = "KUBETRAIN_EARLY_STOPPING"
    OBJECTIVE = "KUBETRAIN_OBJECTIVE"
    OBJECTIVE_MODE = "KUBETRAIN_OBJECTIVE_MODE"
    MEDIAN_MIN_TRIALS = "KUBETRAIN_MEDIAN_MIN_TRIALS"
    MEDIAN_START_STEP = "KUBETRAIN_MEDIAN_START_STEP"
    SWEEP_TRIALS_URI = "KUBETRAIN_SWEEP_TRIALS_URI"
    # asha and hyperband: the rung rule's settings, the trial's number and bracket, where rung reports go
    ASHA_MIN_RESOURCE = "KUBETRAIN_ASHA_MIN_RESOURCE"
    ASHA_REDUCTION_FACTOR = "KUBETRAIN_ASHA_REDUCTION_FACTOR"
    ASHA_GRACE = "KUBETRAIN_ASHA_GRACE"
    ASHA_MAX_RESOURCE = "KUBETRAIN_ASHA_MAX_RESOURCE"
    ASHA_BRACKETS = "KUBETRAIN_ASHA_BRACKETS"
    ASHA_BRACKET = "KUBETRAIN_ASHA_BRACKET"
    SWEEP_TRIAL = "KUBETRAIN_SWEEP_TRIAL"
    SWEEP_RUNGS_URI = "KUBETRAIN_SWEEP_RUNGS_URI"
    # the pod side's tuning options (the Airflow side leaves them to their defaults)
    SYNC_WORKERS = "KUBETRAIN_SYNC_WORKERS"
    PROGRESS_INTERVAL = "KUBETRAIN_PROGRESS_INTERVAL"
    KEEP_ARCHIVES = "KUBETRAIN_KEEP_ARCHIVES"
    MAX_EXTRACT_RATIO = "KUBETRAIN_MAX_EXTRACT_RATIO"
    MAX_EXTRACT_BYTES = "KUBETRAIN_MAX_EXTRACT_BYTES"
    MAX_EXTRACT_MEMBERS = "KUBETRAIN_MAX_EXTRACT_MEMBERS"
    MIN_EXTRACT_MEMBER_BYTES = "KUBETRAIN_MIN_EXTRACT_MEMBER_BYTES"
    VERIFY = "KUBETRAIN_VERIFY"
    MD5_MAX_SIZE = "KUBETRAIN_MD5_MAX_SIZE"
    PART_SIZE = "KUBETRAIN_PART_SIZE"
    S3_TARGET_GBPS = "KUBETRAIN_S3_TARGET_GBPS"

    @classmethod
    def names(cls) -> frozenset[str]:
        """Every variable name of the registry."""
        return frozenset(value for key, value in vars(cls).items() if key.isupper())
