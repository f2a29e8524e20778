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
    """Names of the environment variables the Airflow side sets in the pod and the pod side reads."""

    DATA_DIR = "DATA_DIR"
    CHECKPOINT_DIR = "CHECKPOINT_DIR"
    OUTPUT_DIR = "OUTPUT_DIR"
    RUN_URI = "KUBETRAIN_RUN_URI"
    IMAGE = "KUBETRAIN_IMAGE"
    CODE_VERSION = "KUBETRAIN_CODE_VERSION"
    DATASET_MANIFEST = "KUBETRAIN_DATASET_MANIFEST"
    DATASET_VERSION = "KUBETRAIN_DATASET_VERSION"
    CACHE_DIR = "KUBETRAIN_CACHE_DIR"
    STOP_FILE = "KUBETRAIN_STOP_FILE"
