"""The pod side reads the pod's environment as the contract says: every variable the Airflow side writes,
and none that trainer/sync/schemas/pod-env.v1.json does not list.

What is read is observed, not looked up in the sources: the pod side's readers (the sync tool's
command line, a trainer's flags, the run information, the stop file, the sidecar's settings, the
S3 engine's tuning, the replica rule) run against an environment that records every name asked
for. tests/plugins/test_pod_env.py checks the Airflow side: the pod it renders writes exactly the
contract's variables, and the contract file names what ``kubetrain_contract.pod.Env`` names.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from kubetrain_contract.cluster import HOSTS_ENV, REPLICAS_ENV, ROLE_ENV
from kubetrain_contract.pod import Env

REPO = Path(__file__).resolve().parents[3]
CONTRACT = json.loads((REPO / "trainer" / "sync" / "schemas" / "pod-env.v1.json").read_text())
# the names of the pod contract, as opposed to the platform's (AWS_*, TF_CONFIG, JOB_COMPLETION_INDEX)
CONTRACT_NAME = re.compile(r"^(KUBETRAIN_[A-Z0-9_]+|DATA_DIR|CHECKPOINT_DIR|OUTPUT_DIR|HOSTNAME)$")


class RecordingEnviron(dict):
    """An environment that remembers every name read from it."""

    def __init__(self, values: dict[str, str]) -> None:
        super().__init__(values)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> str:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return super().__contains__(key)


@pytest.fixture(scope="module")
def read_by_pod_side(tmp_path_factory) -> set[str]:
    """The contract names the pod side's readers ask the environment for."""
    from kubetrain_contract.s3uri import S3Uri
    from trainer.common.cluster import tf_config
    from trainer.common.config import TrainerConfig, parse_config
    from trainer.common.contract import RunInfo
    from trainer.common.signals import StopRequest
    from trainer.image_classifier.prepare import data_size_limit
    from trainer.sync.__main__ import build_parser
    from trainer.sync.s3 import target_gbps
    from trainer.sync.sidecar import SyncConfig

    root = tmp_path_factory.mktemp("pod")
    clean = {k: v for k, v in os.environ.items() if not CONTRACT_NAME.match(k) and k != "TF_CONFIG"}
    env = RecordingEnviron(
        {
            **clean,
            **{name: str(root / name.lower()) for name in (Env.DATA_DIR, Env.CHECKPOINT_DIR, Env.OUTPUT_DIR)},
        }
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "environ", env)
        build_parser()  # every command of the sync tool: stage-in, checkpoint-sync, restore, probe
        parse_config(TrainerConfig, [], prog="trainer", description="")  # the trainers' directories
        RunInfo.from_env()
        StopRequest()
        SyncConfig(run=S3Uri("training", "runs/x/y"), dirs={})
        target_gbps()
        tf_config()
        data_size_limit()  # the image classifier's prepared copy
    return {name for name in env.read if CONTRACT_NAME.match(name)}


def test_every_name_read_is_a_name_of_the_registry(read_by_pod_side):
    assert read_by_pod_side - Env.names() - {REPLICAS_ENV, HOSTS_ENV, ROLE_ENV} == set()


def test_the_pod_side_reads_every_variable_the_airflow_side_writes(read_by_pod_side):
    unread = sorted(set(CONTRACT["written"]) - read_by_pod_side)
    assert unread == [], f"pod_spec.py sets {unread}, which nothing in trainer/ reads"


def test_the_pod_side_reads_nothing_outside_the_contract(read_by_pod_side):
    known = (
        set(CONTRACT["written"]) | set(CONTRACT["written_for_replicas"]) | set(CONTRACT["pod_side_options"])
    )
    unknown = sorted(read_by_pod_side - known)
    assert unknown == [], (
        "trainer/ reads variables that trainer/sync/schemas/pod-env.v1.json does not list; add them to "
        f"`written` (and pod_spec.py) or to `pod_side_options`: {unknown}"
    )
    stale = sorted(set(CONTRACT["pod_side_options"]) - read_by_pod_side)
    assert stale == [], f"pod-env.v1.json lists options that trainer/ no longer reads: {stale}"
