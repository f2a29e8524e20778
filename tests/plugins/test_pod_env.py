"""The pod's environment is one contract: what pod_spec.py writes is what trainer/ reads.

``kubetrain_contract.pod.Env`` names every variable and both sides use its names;
trainer/sync/schemas/pod-env.v1.json says which containers get which and what each means. Here
the Airflow side is checked by rendering a pod; tests/trainer/contract/test_pod_env_reads.py checks
the pod side by running its readers against an environment that records what they read.
"""

from __future__ import annotations

import json
from pathlib import Path

import airflow  # noqa: F401  (importing Airflow puts its plugins folder on sys.path)

from kubetrain import pod_spec
from kubetrain.sweep.stopping import MedianStopping, RungStopping
from kubetrain_contract.cluster import HOSTS_ENV, REPLICAS_ENV, ROLE_ENV
from kubetrain_contract.pod import Env

REPO = Path(__file__).resolve().parents[2]
CONTRACT = json.loads((REPO / "trainer" / "sync" / "schemas" / "pod-env.v1.json").read_text())


def written_by_pod_spec(early_stopping: object = None) -> dict[str, list[str]]:
    config = pod_spec.TrainingPodConfig(
        image="r.example/kubetrain/trainer@sha256:" + "a" * 64,
        sync_image="r.example/kubetrain/sync@sha256:" + "b" * 64,
        run_uri="s3://training/runs/train_x/manual__1",
        dataset_manifest="s3://training/manifests/d/0123456789abcdef.json",
        dataset_version="0123456789abcdef",
        dataset_bytes=1 << 30,
        cache_claim="dataset-cache",
        gpus=1,
        early_stopping=early_stopping
        or MedianStopping(
            objective="val_accuracy",
            mode="max",
            trials_uri="s3://training/runs/sweep_x/manual__1/sweep/trials/",
        ),
    )
    pod = pod_spec.training_pod(config)
    found: dict[str, list[str]] = {}
    for container in pod.spec.init_containers + pod.spec.containers:
        for env in container.env or []:
            found.setdefault(env.name, []).append(container.name)
    return found


def test_pod_spec_writes_exactly_the_contract():
    # a median trial's pod, and a hyperband trial's with a known budget: together every variable
    rungs = RungStopping(
        rule="hyperband",
        objective="val_accuracy",
        mode="max",
        trials_uri="s3://training/runs/sweep_x/manual__1/sweep/trials/",
        rungs_uri="s3://training/runs/sweep_x/manual__1/sweep/rungs/",
        trial=1,
        max_resource=9,
        brackets=3,
        bracket=1,
    )
    written = {**written_by_pod_spec(), **written_by_pod_spec(rungs)}
    expected = {name: spec["containers"] for name, spec in CONTRACT["written"].items()}
    assert written == expected


def test_the_contract_file_names_the_registrys_variables():
    listed = (
        set(CONTRACT["written"]) | set(CONTRACT["written_for_replicas"]) | set(CONTRACT["pod_side_options"])
    )
    registry = Env.names() | {REPLICAS_ENV, HOSTS_ENV, ROLE_ENV}
    assert sorted(listed - registry) == [], "pod-env.v1.json lists variables kubetrain_contract.pod.Env lacks"
    assert sorted(registry - listed) == [], "kubetrain_contract.pod.Env names variables pod-env.v1.json lacks"
