"""The pod's environment is one contract: what pod_spec.py writes is what trainer/ reads.

The two sides live in two environments (Airflow, TensorFlow), so neither imports the other:
trainer/sync/schemas/pod-env.v1.json lists the variables, the Airflow side is checked by
rendering a pod, the pod side by reading its sources (every string constant that names an
environment variable, outside docstrings).
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import airflow  # noqa: F401  (importing Airflow puts its plugins folder on sys.path)

from kubetrain import pod_spec

REPO = Path(__file__).resolve().parents[2]
CONTRACT = json.loads((REPO / "trainer" / "sync" / "schemas" / "pod-env.v1.json").read_text())
POD_SIDE = [
    REPO / "trainer" / "sync",
    REPO / "trainer" / "common",
    REPO / "trainer" / "dialogue",
    REPO / "trainer",
]
ENV_NAME = re.compile(r"^(KUBETRAIN_[A-Z0-9_]+|DATA_DIR|CHECKPOINT_DIR|OUTPUT_DIR|HOSTNAME)$")


def written_by_pod_spec() -> dict[str, list[str]]:
    config = pod_spec.TrainingPodConfig(
        image="r.example/kubetrain/trainer@sha256:" + "a" * 64,
        sync_image="r.example/kubetrain/sync@sha256:" + "b" * 64,
        run_uri="s3://training/runs/train_x/manual__1",
        dataset_manifest="s3://training/manifests/d/0123456789abcdef.json",
        dataset_version="0123456789abcdef",
        cache_claim="dataset-cache",
        gpus=1,
        early_stopping=pod_spec.MedianStopping(
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


def docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def read_by_pod_side() -> dict[str, set[str]]:
    """Environment variable names in the pod side's code, and the files that name them."""
    found: dict[str, set[str]] = {}
    files = {
        p
        for folder in POD_SIDE
        for p in (folder.glob("*.py") if folder.name == "trainer" else folder.rglob("*.py"))
    }
    for path in sorted(files):
        if ".venv" in path.parts:
            continue
        tree = ast.parse(path.read_text())
        skip = docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
                if ENV_NAME.match(node.value):
                    found.setdefault(node.value, set()).add(str(path.relative_to(REPO)))
    return found


def test_pod_spec_writes_exactly_the_contract():
    written = written_by_pod_spec()
    expected = {name: spec["containers"] for name, spec in CONTRACT["written"].items()}
    assert written == expected


def test_the_pod_side_reads_every_variable_the_airflow_side_writes():
    read = read_by_pod_side()
    unread = sorted(set(CONTRACT["written"]) - set(read))
    assert unread == [], f"pod_spec.py sets {unread}, which nothing in trainer/ reads"


def test_the_pod_side_reads_nothing_outside_the_contract():
    read = read_by_pod_side()
    known = (
        set(CONTRACT["written"])
        | set(CONTRACT.get("written_for_replicas", {}))
        | set(CONTRACT["pod_side_options"])
    )
    unknown = {name: sorted(files) for name, files in read.items() if name not in known}
    assert unknown == {}, (
        "trainer/ reads variables that trainer/sync/schemas/pod-env.v1.json does not list; add them to "
        f"`written` (and pod_spec.py) or to `pod_side_options`: {unknown}"
    )
    stale = sorted(set(CONTRACT["pod_side_options"]) - set(read))
    assert stale == [], f"pod-env.v1.json lists options that trainer/ no longer reads: {stale}"
