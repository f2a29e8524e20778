"""Multi-worker training on the dev stack: the same digits training with 1 and 2 workers.

Starts a private dev stack, pushes the trainer and sync images built from their Dockerfiles
(cached under .tools/images, as the tests do), uploads the digits demo dataset and runs
train_image_classifier_distributed through `airflow dags test` twice, with workers=1 and
workers=2 and everything else equal (the global batch, hence the number of steps). For each:
examples/s in total and per worker (the chief's steady-state figure in metrics.json counts the
global batch), time to start (the train task's start to the first training step on every
replica, from the replicas' logs), and the final validation accuracy.

Writes bench/results/distributed.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "plugins"))

from include.demo import AIRFLOW, DEMOS, upload_dataset  # noqa: E402
from include.devstack.stack import NAMESPACE, Stack  # noqa: E402

DAG = "train_image_classifier_distributed"
CONF = {
    "dataset_uri": "s3://datasets/digits/",
    "epochs": 4,
    "batch_size": 64,
    "image_size": 32,
    "gpus": 0,
    "cpu": "1",
    "memory": "2Gi",
    "checkpoint_every_steps": 50,
    "force": True,
    "promote": "never",
}
FIRST_STEP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO step \d+ epoch", re.M)
RESULT = REPO / "bench" / "results" / "distributed.md"


def publish_images(registry: str) -> None:
    from kubetrain.imagebuild.buildah import BuildahBuilder
    from kubetrain.imagebuild.builders import PushTarget
    from kubetrain.imagebuild.products import SYNC, TRAINER_CPU, ImagePublisher

    rootfs = REPO / ".tools" / "images" / "bookworm-python.tar"
    if not rootfs.exists():
        raise SystemExit(f"{rootfs} is missing: run `make images-base`")
    builder = BuildahBuilder(REPO / ".tools" / "buildah", storage_driver="auto", log=print)
    publisher = ImagePublisher(builder, REPO / "trainer", REPO / ".tools" / "images" / "oci", log=print)
    publisher.publish(
        [TRAINER_CPU, SYNC],
        lambda item: PushTarget(registry, item.repository, insecure=True),
        base="debian",
        rootfs=rootfs,
    )


class LogKeeper(threading.Thread):
    """Keeps the trainer log of every replica pod of the DAG while it runs."""

    def __init__(self, kubeconfig: str) -> None:
        super().__init__(daemon=True)
        from kubernetes import client, config

        self.core = client.CoreV1Api(config.new_client_from_config(config_file=kubeconfig))
        self.logs: dict[str, str] = {}
        self.errors: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                pods = self.core.list_namespaced_pod(
                    NAMESPACE, label_selector=f"kubetrain.io/dag-id={DAG}"
                ).items
            except Exception as exc:  # the API is busy; look again
                self.errors.append(repr(exc)[:300])
                pods = []
            for pod in pods:
                try:
                    # The raw body: the client's own decoding of a log is not the text the pod wrote.
                    self.logs[pod.metadata.name] = self.core.read_namespaced_pod_log(
                        pod.metadata.name, NAMESPACE, container="base", _preload_content=False
                    ).data.decode()
                except Exception as exc:
                    self.errors.append(repr(exc)[:300])
                    continue
            time.sleep(1.0)


def run_once(workers: int, env: dict[str, str], home: Path, stack_env: dict[str, str], s3) -> dict:
    keeper = LogKeeper(stack_env["KUBECONFIG"])
    keeper.start()
    try:
        out = subprocess.run(
            [str(AIRFLOW), "dags", "test", DAG, "-c", json.dumps({**CONF, "workers": workers})],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
        )
    finally:
        keeper.stop.set()
        keeper.join(5)
    with sqlite3.connect(home / "airflow.db") as db:
        run_id, state = db.execute(
            "SELECT run_id, state FROM dag_run WHERE dag_id = ? ORDER BY id DESC LIMIT 1", (DAG,)
        ).fetchone()
        start = db.execute(
            "SELECT start_date FROM task_instance WHERE dag_id = ? AND run_id = ? AND task_id = 'train'",
            (DAG, run_id),
        ).fetchone()[0]
        run_uri = json.loads(
            db.execute(
                "SELECT value FROM xcom WHERE dag_id = ? AND run_id = ? AND task_id = 'train' "
                "AND key = 'run_uri'",
                (DAG, run_id),
            ).fetchone()[0]
        )
    if out.returncode or state != "success":
        print(out.stdout[-4000:], out.stderr[-2000:])
        raise SystemExit(f"the {workers}-worker run failed ({state})")
    bucket, _, prefix = run_uri[len("s3://") :].partition("/")
    metrics = json.loads(s3.get_object(Bucket=bucket, Key=f"{prefix}/output/metrics.json")["Body"].read())
    task_start = (
        datetime.fromisoformat(str(start)).replace(tzinfo=UTC)
        if "+" not in str(start)
        else datetime.fromisoformat(str(start))
    )
    first_steps = {}
    for pod, text in keeper.logs.items():
        match = FIRST_STEP.search(text)
        if match:
            first_steps[pod] = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").replace(tzinfo=UTC)
    if len(first_steps) < workers:
        for pod, text in keeper.logs.items():
            print(f"--- {pod}\n{text[-1500:]}")
        raise SystemExit(
            f"found the first step of {len(first_steps)} of {workers} replicas in their logs "
            f"(logs kept: {sorted(keeper.logs)}; errors: {keeper.errors[-3:]})"
        )
    return {
        "workers": workers,
        "examples_per_s": metrics["examples_per_s"],
        "per_worker": metrics["examples_per_s"] / workers,
        "steps": metrics["steps"],
        "wall_time_s": metrics["wall_time_s"],
        "startup_s": metrics.get("startup_s"),
        "start_to_first_step_s": max((t - task_start).total_seconds() for t in first_steps.values()),
        "val_accuracy": metrics["final"]["val_accuracy"],
    }


def main() -> int:
    import boto3

    demo = DEMOS["image_classifier"]
    with tempfile.TemporaryDirectory(prefix="kubetrain-bench-") as tmp:
        stack = Stack(Path(tmp) / "stack")
        stack.up()
        try:
            stack_env = stack.env()
            publish_images(stack.load_state()["registry"])
            upload_dataset(demo, stack_env)
            home = Path(tmp) / "airflow"
            home.mkdir()
            shutil.copy(REPO / ".airflow" / "airflow.db", home / "airflow.db")
            env = {
                **os.environ,
                **stack_env,
                "AIRFLOW_HOME": str(home),
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
                "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
                "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
                "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                "PYTHONPATH": str(REPO),
            }
            subprocess.run(
                [str(AIRFLOW), "pools", "set", "--include-deferred", "gpu", "4", "GPU training pods"],
                cwd=REPO,
                env=env,
                capture_output=True,
                check=True,
            )
            s3 = boto3.client(
                "s3",
                endpoint_url=stack_env["KUBETRAIN_S3_ENDPOINT"],
                region_name="us-east-1",
                aws_access_key_id=stack_env["KUBETRAIN_S3_ACCESS_KEY_ID"],
                aws_secret_access_key=stack_env["KUBETRAIN_S3_SECRET_ACCESS_KEY"],
            )
            rows = [run_once(n, env, home, stack_env, s3) for n in (1, 2)]
        finally:
            stack.down()
    one, two = rows
    gap = abs(one["val_accuracy"] - two["val_accuracy"]) * 100
    lines = [
        f"Measured {datetime.now(UTC):%Y-%m-%d} on a {os.cpu_count()}-core machine without GPU, on the dev stack "
        "(Indexed Jobs and a headless Service; every replica a local process), the digits classifier "
        f"(1,797 images, {CONF['image_size']} px, global batch {CONF['batch_size']}, {CONF['epochs']} epochs, "
        "the same steps for both), 1 CPU requested per worker. Indicative: the machine is shared.",
        "",
        "| workers | steps | examples/s total | examples/s per worker | task start -> first step on every replica (s) "
        "| trainer start-up (s) | trainer wall (s) | final val_accuracy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workers']} | {r['steps']} | {r['examples_per_s']:.0f} | {r['per_worker']:.0f} | "
            f"{r['start_to_first_step_s']:.0f} | {r['startup_s'] or 0:.1f} | {r['wall_time_s']:.0f} | "
            f"{r['val_accuracy']:.4f} |"
        )
    lines += [
        "",
        f"Final accuracy of the two within {gap:.2f} points (target: 1). 2 workers run at "
        f"{two['examples_per_s'] / one['examples_per_s']:.2f}x the examples/s of 1.",
        "",
        "What limits the 2-worker speed here: both workers are processes on the same 2 cores (beside the API "
        "server, S3 and Airflow), so there is no extra compute to gain; each step adds a gRPC ring all-reduce of "
        "the gradients between them over loopback and a per-step synchronisation, which costs more than a step of "
        "this small CNN computes. The start-up is dominated by TensorFlow's import and the ring's rendezvous, "
        "paid by every replica in parallel on the same cores. On a cluster each worker has its own node and GPU: "
        "the point of this table is correctness (same steps, same accuracy) and the overhead, not a speed-up.",
    ]
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
