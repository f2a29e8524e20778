"""The same 16-trial random sweep three times: no early stopping, median stopping and asha.

Starts a private dev stack with kubetrain's trainer and sync images in its registry, uploads
the digits demo data and runs sweep_image_classifier three times under a real Airflow (scheduler,
triggerer, LocalExecutor; the ``gpu`` pool 2 slots): the same space, seed, data and trial count,
2 trials at a time, ``force`` on so that no sweep reuses another's trials, after a short sweep
that is not measured (:func:`warm_up`: the images pulled onto the node). The space is the
learning rate alone, 1e-5 to 1 log-uniform, at a fixed short budget of epochs on small images: a
good share of its points (the low learning rates) stay bad to the end, which is where a rule that
stops by rank can save compute (bench/README.md, "sweep", says why). From the trial records (S3)
and the task instances (Airflow's REST API) it reports, for each sweep:

* trainer compute: the sum of the trainers' wall time (metrics.json ``wall_time_s``) and steps,
  the compute saved against the no-stopping sweep, the sweep record's own estimate of what it
  saved (the leaderboard's line) and the best objective;
* the sweep's wall time (first trial started to last trial done) against the ideal
  (sum of trainer wall time / parallel_trials), as a ratio;
* the per-trial orchestration overhead (task duration minus trainer wall time) and what it
  is made of: task start (queued to running), pod start and stage-in (pod created to the
  trainer container's start), trainer process start-up (container run minus the trainer's
  own wall time), final sync and records (container exit to task end);
* the load average before and after each sweep (the machine may be shared).

``KUBETRAIN_BENCH_SWEEP_TRIALS``, ``KUBETRAIN_BENCH_SWEEP_EPOCHS``, ``KUBETRAIN_BENCH_SWEEP_IMAGE_SIZE``
and ``KUBETRAIN_BENCH_SWEEP_MIN_RESOURCE`` make another instance (the default, 16 trials of 81 epochs at
image size 32 with asha's first rung at 9 epochs, runs about an hour; the earlier, shorter one is
``KUBETRAIN_BENCH_SWEEP_EPOCHS=27 KUBETRAIN_BENCH_SWEEP_IMAGE_SIZE=16 KUBETRAIN_BENCH_SWEEP_MIN_RESOURCE=1``,
about 15 minutes); ``--from-raw`` writes the tables again from the last
run's raw results (in the temp dir).
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
from include.demo import DEMOS, upload_dataset  # noqa: E402
from include.devstack.stack import Stack, s3_client  # noqa: E402

DAG_ID = "sweep_image_classifier"
PARALLEL = 2
# the 1-minute load average a sweep starts at, on a machine at rest (2 cores)
QUIET_LOAD = 1.5
TRIALS = int(os.environ.get("KUBETRAIN_BENCH_SWEEP_TRIALS", "16"))  # fewer for a quick look
# Reports (epochs) per trial, and asha's first rung: rungs at 9, 27 and 81 reports (reduction factor 3).
# Why these sizes: a trial costs about 9.5 s beyond its training (the pod's start with the dataset
# staged, TensorFlow's import, the final sync and records; bench/README.md, "sweep"), and a sweep's
# wall / ideal is about 1.05 x (1 + that / its trials' mean training time). Most of asha's trials
# stop at the first rung, so 1.3 takes that rung at about 20 s of training (9 epochs at image size
# 32, 2.4 s an epoch with 2 trials on 2 cores) and the budget 9 times that: the no-stopping
# sweep's trials trained 194 s each, asha's 62 s on average (wall / ideal 1.17). At 27 epochs of 1 s (image size 16, first rung 1 epoch)
# asha's trials trained 6 s on average and its wall / ideal was 2.4-2.8.
EPOCHS = int(os.environ.get("KUBETRAIN_BENCH_SWEEP_EPOCHS", "81"))
IMAGE_SIZE = int(os.environ.get("KUBETRAIN_BENCH_SWEEP_IMAGE_SIZE", "32"))
MIN_RESOURCE = int(os.environ.get("KUBETRAIN_BENCH_SWEEP_MIN_RESOURCE", "9"))
CONF = {
    "dataset_uri": "s3://datasets/digits/",
    "model_name": "bench-sweep",
    # A fixed budget on small images, batch size 32 (45 steps an epoch). At 81 epochs every point of the
    # range learns the digits (0.975 to 1.0 on the run of 2026-11-28; at 27 epochs of image size 16 its
    # ends stayed behind): asha stops by rank at a rung, not by a point's badness, and still saves.
    "epochs": EPOCHS,
    "image_size": IMAGE_SIZE,
    "cpu": "1",
    "memory": "2Gi",
    "promote": "never",
    "force": True,
    "space": {"learning_rate": {"low": 0.00001, "high": 1.0, "log": True}, "batch_size": [32]},
    "algorithm": "random",
    "max_trials": TRIALS,
    "parallel_trials": PARALLEL,
    "seed": 11,
}
VARIANTS = {
    "no stopping": {"rule": "off"},
    "median stopping": {"rule": "median", "min_trials": 3, "start_step": 2},
    "asha": {"rule": "asha", "min_resource": MIN_RESOURCE, "reduction_factor": 3, "max_resource": EPOCHS},
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


def warm_up(ui: AirflowUI) -> float:
    """A sweep of one short trial per slot, not measured: the node pulls the trainer and sync images
    and Airflow parses and runs the sweep DAG once, so that the three measured sweeps start alike.
    Without it the first sweep alone paid the node's image pull (25 s in each of its first two
    trials' pod start, on 4201195). Returns its wall time."""
    start = time.monotonic()
    _sweep(ui, {**CONF, "max_trials": PARALLEL, "epochs": 1, "early_stopping": {"rule": "off"}})
    return time.monotonic() - start


def _sweep(ui: AirflowUI, conf: dict) -> tuple[str, dict]:
    """Trigger the sweep DAG with ``conf`` and wait for its run to succeed; its run id and run."""
    run_id = ui.trigger(DAG_ID, conf)
    run = ui.wait_run(DAG_ID, run_id, timeout=3600)
    if run["state"] != "success":
        tis = {k: v["state"] for k, v in ui.task_instances(DAG_ID, run_id).items()}
        raise SystemExit(f"the sweep {run_id} ended {run['state']}: {tis}")
    return run_id, run


def run_sweep(ui: AirflowUI, s3, early_stopping: dict) -> dict:
    from kubetrain.s3_layout import S3Layout

    run_id, run = _sweep(ui, {**CONF, "early_stopping": early_stopping})
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
        # What "task to pod" is made of (the trial's own stamps, sub-second, where the pod's
        # creationTimestamp has whole seconds): the task process's start (the DAG file parsed, the
        # task's arguments rendered), the trial's own work before the pod (its earlier record looked
        # up in S3, the pod spec with its images pinned) and the provider's create call.
        executing, requested = _t(timing.get("executing")), _t(timing.get("pod_requested"))
        accepted = _t(timing.get("pod_accepted"))
        start_details = {
            "task start to execute": executing - started if executing and started else None,
            "execute to pod request": requested - executing if requested and executing else None,
            "pod create call": accepted - requested if accepted and requested else None,
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
                **({"start_details": start_details} if executing else {}),
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
        "compute": record.get("compute") or {},
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
    start_details = {
        k: _median([t.get("start_details", {}).get(k) for t in trials])
        for k in trials[0].get("start_details", {})
    }
    ideal = trainer / PARALLEL
    return {
        "containers": sum(t.get("container_s") or 0.0 for t in trials) / PARALLEL,
        "tasks": sum(t["task_s"] or 0.0 for t in trials) / PARALLEL,
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
        "start_details": start_details,
        "compute": result.get("compute") or {},
        "load": result.get("load") or [],
    }


def _breakdown(rows: list[dict], off: dict, key: str, caption: str, fmt: str) -> list[str]:
    """A table of one phase's parts, a row per sweep, headed by the no-stopping sweep's (``off``);
    nothing when the results have none (an older run's)."""
    first = off.get(key)
    if not first:
        return []
    return [
        "",
        caption,
        "",
        "| | " + " | ".join(first) + " |",
        "|---|" + "---|" * len(first),
        *(f"| {r['name']} | " + " | ".join(format(v, fmt) for v in r[key].values()) + " |" for r in rows),
    ]


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
            if (Path(tempfile.gettempdir()) / f"kubetrain-bench-sweep-{rule['rule']}.json").exists()
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
            s3 = s3_client(env)
            ui = AirflowUI(
                Path(tmp) / "airflow",
                env,
                port=_free_port(),
                pool_slots=PARALLEL,
                parallelism=4,
                paused_at_creation=True,
                env={"KUBETRAIN_IMAGE_CLASSIFIER_CRON": "", "KUBETRAIN_IMAGE_BUILD_CRON": ""},
            )
            with ui:
                ui.wait_dags([DAG_ID])
                ui.set_paused(DAG_ID, False)
                print("== warm-up sweep (the images onto the node; not measured) ...", flush=True)
                print(f"== warm-up sweep: {warm_up(ui):.0f} s", flush=True)
                for name, rule in VARIANTS.items():
                    load = settle()
                    start = time.monotonic()
                    print(f"== sweep, {name} (load average {load:.1f}) ...", flush=True)
                    raw[name] = run_sweep(ui, s3, rule)
                    raw[name]["load"] = [load, os.getloadavg()[0]]
                    (Path(tempfile.gettempdir()) / f"kubetrain-bench-sweep-{rule['rule']}.json").write_text(
                        json.dumps(raw[name])
                    )
                    print(f"== sweep, {name}: {time.monotonic() - start:.0f} s", flush=True)
        finally:
            stack.down()
    return write(raw)


def settle(below: float = QUIET_LOAD, limit_s: float = 300) -> float:
    """Wait (at most ``limit_s``) for the 1-minute load average to fall to ``below`` after the
    previous sweep's own work, so that each sweep starts on a machine at rest; return it then.
    A load that stays above it is other work, and the run's verdicts are then withheld."""
    deadline = time.monotonic() + limit_s
    while os.getloadavg()[0] > below and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


def write(raw: dict) -> int:
    """The three-way table, the targets' verdicts and the overhead tables, printed and in bench/results/sweep.md.

    :param raw: each variant's raw results (:func:`run_sweep`), by name.
    """
    results = {name: summarize(name, result) for name, result in raw.items()}
    off = results["no stopping"]
    rows = list(results.values())
    for r in rows:
        r["saved"] = 1 - r["trainer_s"] / off["trainer_s"]
        r["saved_steps"] = 1 - r["steps"] / off["steps"] if off["steps"] else float("nan")
        r["gap"] = (off["best"] - r["best"]) / off["best"]
    loads = [x for r in rows for x in r["load"]]
    peak = max(loads) if loads else float("nan")
    # Each sweep starts once the previous one's work has settled (settle()); while it runs, its own
    # two trials, Airflow and the dev stack keep the load at 3 to 4 on 2 cores: that is the work
    # measured. A load still above QUIET_LOAD before a sweep is other work: the wall times (and so
    # the wall / ideal ratios) would measure it as much as the sweep, so no target is called met.
    busy = not loads or max(r["load"][0] for r in rows if r["load"]) > QUIET_LOAD
    lines = [
        f"Command: `{_instance()}make bench BENCH=sweep` (sweep_image_classifier, random search, {TRIALS} trials, "
        "parallel_trials "
        f"{PARALLEL}, {CONF['epochs']} epochs, image size {CONF['image_size']}, on the digits demo data; a real "
        "scheduler, triggerer and LocalExecutor against the dev stack; `force` so no trial is reused).",
        "",
        f"Space: `{json.dumps(CONF['space'])}`, seed {CONF['seed']}; "
        + "; ".join(f"{name} `{json.dumps(rule)}`" for name, rule in VARIANTS.items() if name in results)
        + f". Machine: {os.cpu_count()} CPUs, load average {min(loads, default=float('nan')):.1f} to {peak:.1f} "
        "(before and after each sweep).",
        "",
        "| | trainer wall, sum (s) | steps, sum | trials stopped | compute saved vs no stopping | "
        "saved, the sweep record's estimate | best val_accuracy | best vs no stopping | sweep wall (s) | "
        "ideal (s) | wall / ideal | overhead per trial (s, median) | load average (before, after) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {r['name']} | {r['trainer_s']:.1f} | {r['steps']} | {r['stopped']} | {r['saved']:.0%} "
            f"({r['saved_steps']:.0%} of the steps) | {_fraction(r['compute'].get('saved_fraction'))} | "
            f"{r['best']:.4f} | {-r['gap']:+.2%} | {r['span']:.0f} | {r['ideal']:.0f} | {r['ratio']:.2f} | "
            f"{r['overhead']:.1f} | {', '.join(f'{x:.1f}' for x in r['load']) or '?'} |"
            for r in rows
        ),
        "",
        "Leaderboard lines (the sweep record's compute): "
        + "; ".join(f'{r["name"]}: "{r["compute"].get("line") or "not recorded"}"' for r in rows)
        + ".",
        "",
        "Targets:",
        "",
    ]
    asha, median = results.get("asha"), results.get("median stopping")
    if asha:
        lines.append(
            f"- asha saves at least 60% of the no-stopping compute (2.5x less): {asha['saved']:.0%} "
            f"({off['trainer_s'] / asha['trainer_s']:.1f}x less), "
            f"**{_verdict(asha['saved'] >= 0.6, busy=busy)}**; its best objective within 1% of the no-stopping "
            f"best: {-asha['gap']:+.2%}, **{_verdict(asha['gap'] <= 0.01, busy=busy)}**."
        )
    if median:
        lines.append(
            f"- median stopping, beside it on the same space: {median['saved']:.0%} saved, best "
            f"{-median['gap']:+.2%} against the no-stopping best."
        )
    lines += [
        *(
            f"- {r['name']}: wall time within 1.3x of its ideal: {r['ratio']:.2f}, "
            f"**{_verdict(r['ratio'] <= 1.3, busy=busy)}**."
            for r in rows
        ),
        "",
        "The same wall time against two other baselines, for reading only (no target is set on them): the "
        "trainer containers' summed run / parallel_trials (the trainer process from its start to its exit: "
        "the ideal plus its own start-up and exports, which an unmodified container brings with it), and the "
        "trial tasks' summed time / parallel_trials (how well the slots were kept busy):",
        "",
        f"| | sweep wall (s) | containers' run / {PARALLEL} (s) | wall / containers' run | tasks' time / "
        f"{PARALLEL} (s) | wall / tasks' time |",
        "|---|---|---|---|---|---|",
        *(
            f"| {r['name']} | {r['span']:.0f} | {r['containers']:.0f} | {r['span'] / r['containers']:.2f} | "
            f"{r['tasks']:.0f} | {r['span'] / r['tasks']:.2f} |"
            for r in rows
            if r["containers"] and r["tasks"]
        ),
        "",
        "Per-trial overhead (median over the trials, seconds), what each trial costs beyond its training: task start to "
        "pod created (task process, pod spec, create), pod start + stage-in (pod created to the trainer container's start: "
        "init container staging the dataset from the shared snapshot), trainer start-up (container run minus the "
        "trainer's own wall time: Python and TensorFlow import, data load, model build), exit to task end (the "
        "task sees the pod end, the sidecar's final sync pass, the pod's deletion, the trial's report and records):",
        "",
        "| | " + " | ".join(off["phases"]) + " |",
        "|---|" + "---|" * len(off["phases"]),
        *(f"| {r['name']} | " + " | ".join(f"{v:.1f}" for v in r["phases"].values()) + " |" for r in rows),
        *_breakdown(
            rows,
            off,
            "details",
            "What \"exit to task end\" is made of (median seconds): from the trainer's exit to the pod's end "
            "(the training container's log ends, the sidecar's final sync pass, the pod's terminal status on the "
            "task's watch) and its deletion, the task's check of the final pass in S3, the trial's report and "
            "records, the task process's exit:",
            ".1f",
        ),
        *_breakdown(
            rows,
            off,
            "start_details",
            "What \"task to pod\" is made of (median seconds, the trial's own stamps): the task process's start "
            "to the operator's execute (the DAG file parsed, the task's arguments rendered), execute to the pod's "
            "request (the trial's earlier record looked up in S3, the pod spec with its images pinned), the "
            "provider's create call:",
            ".2f",
        ),
        "",
        "Compute saved: 1 - the sweep's summed trainer wall time / the no-stopping sweep's (the same points, "
        "seed and data); the sweep record's estimate instead prices each stopped trial's remaining reports at "
        "the median hours per report of the trials that trained to their end. Overhead per trial: the task's duration minus the trainer's own wall time "
        "(its training loop). Sweep wall: first trial started to last trial done; ideal: the trainers' summed "
        "wall time / parallel_trials. Before the three, a sweep of one 1-epoch trial per slot, not measured, "
        "pulls the images onto the node and runs the DAG once, so that every sweep starts alike. "
        "Each sweep starts once the 1-minute load average has fallen to "
        f"{QUIET_LOAD} (at most 5 minutes' wait); the load during a sweep is its own work. No target is called "
        f"met when the load before a sweep stayed above {QUIET_LOAD} on the {os.cpu_count()} CPUs: other work "
        "was running, the trials then waited for a core (and asha's rung decisions depend on when the trials "
        "report).",
    ]
    print("\n".join(lines))
    (REPO / "bench" / "results").mkdir(exist_ok=True)
    (REPO / "bench" / "results" / "sweep.md").write_text("\n".join(lines) + "\n")
    return 0


def _instance() -> str:
    """The variables that made a smaller instance than bench/README.md's, as a command's prefix."""
    return "".join(
        f"{name}={os.environ[name]} "
        for name in (
            "KUBETRAIN_BENCH_SWEEP_TRIALS",
            "KUBETRAIN_BENCH_SWEEP_EPOCHS",
            "KUBETRAIN_BENCH_SWEEP_IMAGE_SIZE",
            "KUBETRAIN_BENCH_SWEEP_MIN_RESOURCE",
        )
        if os.environ.get(name)
    )


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _verdict(met: bool, *, busy: bool) -> str:
    if not met:
        return "not met"
    return "within the target on this run, not judged: the machine was busy" if busy else "met"


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    raise SystemExit(main())
