"""A 16-trial random sweep with and without median early stopping, side by side.

Starts a private dev stack with kubetrain's trainer and sync images in its registry, uploads
the digits demo data and runs sweep_image_classifier twice under a real Airflow (scheduler,
triggerer, LocalExecutor; the ``gpu`` pool 2 slots): the same space, seed and data, 2 trials
at a time, ``force`` on so that neither reuses the other's trials. From the trial records
(S3) and the task instances (Airflow's REST API) it reports:

* trainer compute: the sum of the trainers' wall time (metrics.json ``wall_time_s``) and
  steps, and what median stopping saved, with both sweeps' best objective;
* the sweep's wall time (first trial queued to last trial done) against the ideal
  (sum of trainer wall time / parallel_trials), as a ratio;
* the per-trial orchestration overhead (task duration minus trainer wall time) and what it
  is made of: task start (queued to running), pod start and stage-in (pod created to the
  trainer container's start), trainer process start-up (container run minus the trainer's
  own wall time), final sync and records (container exit to task end).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "plugins"))

from include.airflow_ui import AirflowUI  # noqa: E402
from include.demo import DEMOS, _s3, upload_dataset  # noqa: E402
from include.devstack.stack import Stack  # noqa: E402

DAG_ID = "sweep_image_classifier"
PARALLEL = 2
TRIALS = int(
    os.environ.get("KUBETRAIN_BENCH_SWEEP_TRIALS", "16")
)  # fewer for a quick look; bench/README has 16
CONF = {
    "dataset_uri": "s3://datasets/digits/",
    "model_name": "bench-sweep",
    # Trials of about half a minute of training on one core: with a few seconds of overhead per
    # trial a sweep can come near its ideal wall time only if its trials train for far longer
    # than that (the 6-epoch trials of image size 16 measured first trained for 4.5 s each).
    "epochs": 40,
    "image_size": 24,
    "cpu": "1",
    "memory": "2Gi",
    "promote": "never",
    "force": True,
    "space": {"learning_rate": {"low": 0.0001, "high": 0.5, "log": True}, "batch_size": [32, 64, 128]},
    "algorithm": "random",
    "max_trials": TRIALS,
    "parallel_trials": PARALLEL,
    "seed": 11,
}
VARIANTS = {
    "no stopping": {"rule": "off"},
    "median stopping": {"rule": "median", "min_trials": 3, "start_step": 2},
}
IMAGE_ROOTFS = REPO / ".tools" / "images" / "bookworm-python.tar"


def _t(value: str | None) -> float | None:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() if value else None


def publish_images(stack: Stack) -> None:
    """The CPU trainer and sync images, built from their Dockerfiles, into the stack's registry."""
    from kubetrain.imagebuild.buildah import BuildahBuilder
    from kubetrain.imagebuild.builders import PushTarget
    from kubetrain.imagebuild.products import SYNC, TRAINER_CPU, ImagePublisher

    if not IMAGE_ROOTFS.exists():
        raise SystemExit(f"{IMAGE_ROOTFS} is missing: run `make images-base`")
    registry = stack.load_state()["registry"]
    builder = BuildahBuilder(REPO / ".tools" / "buildah", storage_driver="auto", log=print)
    publisher = ImagePublisher(builder, REPO / "trainer", REPO / ".tools" / "images" / "oci", log=print)
    publisher.publish(
        [TRAINER_CPU, SYNC],
        lambda item: PushTarget(registry, item.repository, insecure=True),
        base="debian",
        rootfs=IMAGE_ROOTFS,
    )


def run_sweep(ui: AirflowUI, s3, early_stopping: dict) -> dict:
    from kubetrain.s3_layout import S3Layout

    conf = {**CONF, "early_stopping": early_stopping}
    run_id = ui.trigger(DAG_ID, conf)
    run = ui.wait_run(DAG_ID, run_id, timeout=3600)
    if run["state"] != "success":
        tis = {k: v["state"] for k, v in ui.task_instances(DAG_ID, run_id).items()}
        raise SystemExit(f"the sweep {run_id} ended {run['state']}: {tis}")
    tis = {
        k: v
        for k, v in ui.task_instances(DAG_ID, run_id).items()
        if ".train" in k and v["state"] == "success"
    }
    sweep = S3Layout().run(DAG_ID, run_id)
    record = json.loads(
        s3.get_object(Bucket=sweep.bucket, Key=f"{sweep.prefix}/sweep/sweep.json")["Body"].read()
    )
    trials = []
    for trial in record["trials"]:
        full = json.loads(
            s3.get_object(Bucket=sweep.bucket, Key=f"{sweep.prefix}/sweep/trials/{trial['number']}.json")[
                "Body"
            ].read()
        )
        ti = next(
            v
            for k, v in tis.items()
            if k.endswith(f"[{trial['number']}]") or v.get("rendered_map_index") == f"trial {trial['number']}"
        )
        timing = full.get("timing") or {}
        base = timing.get("base") or {}
        queued, started, ended = _t(ti.get("queued_when")), _t(ti.get("start_date")), _t(ti.get("end_date"))
        pod_created, base_start, base_end = (
            _t(timing.get("pod_created")),
            _t(base.get("started")),
            _t(base.get("finished")),
        )
        trainer = float(full.get("wall_time_s") or 0.0)
        resumed, pod_done = _t(timing.get("resumed")), _t(timing.get("pod_done"))
        final_pass, recorded = _t(timing.get("final_pass")), _t(timing.get("recorded"))
        phases = {
            "task to pod": pod_created - started if pod_created and started else None,
            "pod start + stage-in": base_start - pod_created if base_start and pod_created else None,
            "trainer start-up": (base_end - base_start) - trainer if base_end and base_start else None,
            "exit to task end": ended - base_end if ended and base_end else None,
        }
        # What "exit to task end" is made of (the trial's own stamps). A trial that deferred (the
        # sweep's deferrable=True) also stamps when it resumed in a new task process.
        details = {
            "exit to pod ended + deleted": pod_done - base_end if pod_done and base_end else None,
            **({"of which exit to resumed": resumed - base_end} if resumed and base_end else {}),
            "final pass": final_pass - pod_done if final_pass and pod_done else None,
            "report + records": recorded - final_pass if recorded and final_pass else None,
            "task exit": ended - recorded if ended and recorded else None,
        }
        trials.append(
            {
                "number": trial["number"],
                "params": trial["params"],
                "value": (trial.get("objective") or {}).get("value"),
                "stopped_early": trial.get("stopped_early"),
                "steps": full.get("steps") or 0,
                "trainer_s": trainer,
                "queued": queued,
                "started": started,
                "ended": ended,
                "task_s": ended - started if ended and started else None,
                "phases": phases,
                "details": details,
                "container_s": base_end - base_start if base_end and base_start else None,
            }
        )
    span = max(t["ended"] for t in trials) - min(t["started"] for t in trials)
    return {
        "run_id": run_id,
        "dag_wall": _t(run["end_date"]) - _t(run["start_date"]),
        "span": span,
        "trials": trials,
        "best": record["best"],
    }


def normalize(result: dict) -> dict:
    """Results of the first version of this script: it took the task's queued_when for its start,
    but a deferred task is queued again when its trigger fires (after its start_date)."""
    for t in result["trials"]:
        if "task start" in t["phases"]:
            t["started"] = t["queued"] + t["phases"].pop("task start")
            t["task_s"] = t["ended"] - t["started"]
        if "container_s" not in t and t["phases"].get("trainer start-up") is not None:
            t["container_s"] = t["trainer_s"] + t["phases"]["trainer start-up"]
        if "final sync + record" in t["phases"]:
            t["phases"]["exit to task end"] = t["phases"].pop("final sync + record")
    result["span"] = max(t["ended"] for t in result["trials"]) - min(t["started"] for t in result["trials"])
    return result


def summarize(name: str, result: dict) -> dict:
    trials = normalize(result)["trials"]
    trainer = sum(t["trainer_s"] for t in trials)
    overheads = [t["task_s"] - t["trainer_s"] for t in trials if t["task_s"] is not None]
    # The orchestration alone: the task's time outside the training container's run (the trainer
    # process's own start-up, TensorFlow's import, and its model export are in that run).
    orchestration = [
        t["task_s"] - t["container_s"] for t in trials if t["task_s"] is not None and t.get("container_s")
    ]
    phases = {k: _median([t["phases"][k] for t in trials]) for k in trials[0]["phases"]}
    details = {
        k: _median([t.get("details", {}).get(k) for t in trials]) for k in trials[0].get("details", {})
    }
    ideal = trainer / PARALLEL
    return {
        "name": name,
        "trainer_s": trainer,
        "steps": sum(t["steps"] for t in trials),
        "best": result["best"]["best_value"],
        "stopped": sum(1 for t in trials if t["stopped_early"]),
        "span": result["span"],
        "dag_wall": result["dag_wall"],
        "ideal": ideal,
        "ratio": result["span"] / ideal if ideal else float("nan"),
        "overhead": _median(overheads),
        "orchestration": _median(orchestration),
        "phases": phases,
        "details": details,
    }


def _median(values: list) -> float:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else float("nan")


def main() -> int:
    if sys.argv[1:] == ["--from-raw"]:  # re-summarize the raw results of the last run (in the temp dir)
        raw = {
            name: json.loads(
                (Path(tempfile.gettempdir()) / f"kubetrain-bench-sweep-{rule['rule']}.json").read_text()
            )
            for name, rule in VARIANTS.items()
        }
        return write(raw)
    raw = {}
    with tempfile.TemporaryDirectory(prefix="kubetrain-bench-sweep-") as tmp:
        stack = Stack(Path(tmp) / "stack")
        stack.up()
        try:
            env = stack.env()
            publish_images(stack)
            upload_dataset(DEMOS["image_classifier"], env)
            s3 = _s3(env)
            ui = AirflowUI(
                Path(tmp) / "airflow",
                env,
                port=_free_port(),
                seed_db=REPO / ".airflow" / "airflow.db",
                pool_slots=PARALLEL,
                parallelism=4,
                paused_at_creation=True,
                env={"KUBETRAIN_IMAGE_CLASSIFIER_CRON": "", "KUBETRAIN_IMAGE_BUILD_CRON": ""},
            )
            with ui:
                ui.wait_dags([DAG_ID])
                ui.set_paused(DAG_ID, False)
                for name, rule in VARIANTS.items():
                    start = time.monotonic()
                    print(f"== sweep, {name} ...", flush=True)
                    raw[name] = run_sweep(ui, s3, rule)
                    (Path(tempfile.gettempdir()) / f"kubetrain-bench-sweep-{rule['rule']}.json").write_text(
                        json.dumps(raw[name])
                    )
                    print(f"== sweep, {name}: {time.monotonic() - start:.0f} s", flush=True)
        finally:
            stack.down()
    return write(raw)


def write(raw: dict) -> int:
    results = {name: summarize(name, result) for name, result in raw.items()}
    off, med = results["no stopping"], results["median stopping"]
    saved = 1 - med["trainer_s"] / off["trainer_s"]
    saved_steps = 1 - med["steps"] / off["steps"] if off["steps"] else float("nan")
    best_gap = (off["best"] - med["best"]) / off["best"]
    lines = [
        f"Command: `make bench BENCH=sweep` (sweep_image_classifier, random search, {TRIALS} trials, parallel_trials "
        f"{PARALLEL}, {CONF['epochs']} epochs, image size {CONF['image_size']}, on the digits demo data; a real "
        "scheduler, triggerer and LocalExecutor against the dev stack; `force` so no trial is reused).",
        "",
        f"Space: `{json.dumps(CONF['space'])}`, seed {CONF['seed']}; median stopping "
        f"`{json.dumps(VARIANTS['median stopping'])}`.",
        "",
        "| | trainer wall, sum (s) | steps, sum | trials stopped | best val_accuracy | sweep wall (s) | ideal (s) | wall / ideal | overhead per trial (s, median) | of which orchestration (s, median) |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {r['name']} | {r['trainer_s']:.1f} | {r['steps']} | {r['stopped']} | {r['best']:.4f} | {r['span']:.0f} | "
            f"{r['ideal']:.0f} | {r['ratio']:.2f} | {r['overhead']:.1f} | {r['orchestration']:.1f} |"
            for r in (off, med)
        ),
        "",
        f"Median stopping saved {saved:.0%} of the trainer wall time and {saved_steps:.0%} of the steps (target >= 40%); "
        f"its best objective is {best_gap:+.2%} below the no-stopping best (target within 1%).",
        "",
        "Per-trial overhead (median over the trials, seconds), what each trial costs beyond its training: task start to "
        "pod created (task process, pod spec, create), pod start + stage-in (pod created to the trainer container's start: "
        "init container staging the dataset from the shared snapshot), trainer start-up (container run minus the "
        "trainer's own wall time: Python and TensorFlow import, data load, model build), exit to task end (the "
        "task sees the pod end, the sidecar's final sync pass, the pod's deletion, the trial's report and records):",
        "",
        "| | " + " | ".join(off["phases"]) + " |",
        "|---|" + "---|" * len(off["phases"]),
        *(
            f"| {r['name']} | " + " | ".join(f"{v:.1f}" for v in r["phases"].values()) + " |"
            for r in (off, med)
        ),
        *(
            [
                "",
                "What \"exit to task end\" is made of (median seconds): from the trainer's exit to the pod's end "
                "(the training container's log ends, the sidecar's final sync pass, the pod's terminal status on the "
                "task's watch) and its deletion, the task's check of the final pass in S3, the trial's report and "
                "records, the task process's exit:",
                "",
                "| | " + " | ".join(off["details"]) + " |",
                "|---|" + "---|" * len(off["details"]),
                *(
                    f"| {r['name']} | " + " | ".join(f"{v:.1f}" for v in r["details"].values()) + " |"
                    for r in (off, med)
                ),
            ]
            if off.get("details")
            else []
        ),
        "",
        "Overhead per trial: the task's duration minus the trainer's own wall time (its training loop); of which "
        "orchestration: the task's duration minus the training container's run, i.e. without the trainer process's "
        "start-up (Python, TensorFlow's import, data load, model build) and its export after the loop. "
        "Sweep wall: first trial started to last trial done; ideal: the trainers' summed wall time / parallel_trials. "
        "Targets: at most 10 s per trial beyond its training and a wall time within 1.3x of the ideal.",
    ]
    print("\n".join(lines))
    (REPO / "bench" / "results").mkdir(exist_ok=True)
    (REPO / "bench" / "results" / "sweep.md").write_text("\n".join(lines) + "\n")
    return 0


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    raise SystemExit(main())
