"""`make demo`, `make demo-dialogue` and `make airflow`: kubetrain end to end on the dev stack.

    python -m include.demo image_classifier   # digits classifier through `airflow dags test`
    python -m include.demo dialogue           # dialogue Transformer likewise
    python -m include.demo distributed        # the digits classifier on 2 workers (MultiWorkerMirroredStrategy)
    python -m include.demo ui                 # the Airflow UI, demo datasets uploaded

Runs in the Airflow environment (.venv) against a running dev stack (`make stack-up`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from include.devstack.stack import s3_client

REPO = Path(__file__).resolve().parents[1]
DEMO_DIR = REPO / ".demo"
TRAINER_PYTHON = REPO / "trainer" / ".venv" / "bin" / "python"
AIRFLOW = REPO / ".venv" / "bin" / "airflow"
# lines of the task log shown when a run fails (the terminal shows only the progress lines otherwise)
FAILURE_TAIL = 25


@dataclass(frozen=True)
class Demo:
    dag_id: str
    dataset: str
    generator: str
    filename: str
    conf: dict


DEMOS = {
    "image_classifier": Demo(
        dag_id="train_image_classifier",
        dataset="digits",
        generator="include.sample_data.digits",
        filename="digits.zip",
        conf={"dataset_uri": "s3://datasets/digits/", "epochs": 4, "batch_size": 64, "image_size": 32},
    ),
    "distributed": Demo(
        dag_id="train_image_classifier_distributed",
        dataset="digits",
        generator="include.sample_data.digits",
        filename="digits.zip",
        # The dev stack has no GPU: each of the 2 workers trains on one CPU.
        conf={
            "dataset_uri": "s3://datasets/digits/",
            "epochs": 3,
            "batch_size": 64,
            "image_size": 32,
            "workers": 2,
            "gpus": 0,
            "cpu": "1",
            "memory": "2Gi",
        },
    ),
    "dialogue": Demo(
        dag_id="train_dialogue_transformer",
        dataset="dialogue",
        generator="include.sample_data.dialogue",
        filename="dialogue.tsv",
        # About 4,000 generated pairs: 57 steps an epoch at batch size 64; a model this size on a
        # CPU pod learns them within the 8 epochs (val_loss far under the unigram baseline).
        conf={
            "dataset_uri": "s3://datasets/dialogue/",
            "epochs": 8,
            "batch_size": 64,
            "num_layers": 2,
            "num_heads": 4,
            "hidden_size": 64,
            "ff_size": 128,
            "max_input_length": 12,
            "max_output_length": 12,
            "sample_every_steps": 100,
            "log_every_steps": 20,
        },
    ),
}


def stack_env() -> dict[str, str]:
    sys.path.insert(0, str(REPO))
    from include.devstack.stack import Stack, StackError

    stack = Stack(Path(os.environ.get("KUBETRAIN_STACK_DIR", REPO / ".stack")))
    try:
        stack.load_state()
    except StackError as exc:
        raise SystemExit(f"error: {exc}") from None
    return stack.env()


def require_images(stack: dict[str, str]) -> dict[str, str]:
    """The trainer and sync images the dev stack's pods run, by digest; exit if one is not pushed.

    ``make demo`` pushes them first (``make stack-images``: built from trainer/Dockerfile and
    trainer/Dockerfile.sync); the stack's kubelet, like a cluster's, runs only images that are in
    its registry. Returns ``{reference: digest}``.
    """
    sys.path.insert(0, str(REPO / "plugins"))
    from kubetrain.imagebuild.oci import RegistryClient
    from kubetrain.imagebuild.products import default_image
    from kubetrain.imagebuild.reference import parse_reference

    registry = stack["KUBETRAIN_REGISTRY"]
    variant = stack.get("KUBETRAIN_TRAINER_VARIANT") or "gpu"
    wanted = [
        stack.get("KUBETRAIN_TRAINER_IMAGE") or default_image("trainer", registry, "latest", variant),
        stack.get("KUBETRAIN_SYNC_IMAGE") or default_image("sync", registry),
    ]
    digests = {}
    with RegistryClient(registry, insecure=True, timeout=30) as client:
        for image in wanted:
            ref = parse_reference(image, default_registry=registry)
            digest = client.manifest_digest(ref.repository, ref.digest or ref.tag)
            if digest is None:
                raise SystemExit(
                    f"error: {image} is not in the dev stack's registry: run `make stack-images` (make demo does)"
                )
            digests[image] = digest
    return digests


def airflow_env(stack: dict[str, str]) -> dict[str, str]:
    home = os.environ.get("AIRFLOW_HOME", str(REPO / ".airflow"))
    return {
        **os.environ,
        **stack,
        "AIRFLOW_HOME": home,
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        # kubetrain_contract (trainer/kubetrain_contract, linked at the checkout's root), which the
        # provider imports: the plugins folder on sys.path holds only kubetrain.
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
        # The DAGs that `airflow dags test` adds to the metadata DB start paused, as `make airflow`
        # creates them: a DAG left unpaused here starts its schedule's latest run the moment
        # `make airflow` starts the scheduler, next to the run the user triggers.
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
    }


def upload_dataset(demo: Demo, stack: dict[str, str]) -> str:
    """Generate the demo dataset with the trainer environment and upload it to S3."""
    DEMO_DIR.mkdir(exist_ok=True)
    path = DEMO_DIR / demo.filename
    subprocess.run([str(TRAINER_PYTHON), "-m", demo.generator, "--out", str(path)], cwd=REPO, check=True)
    key = f"{demo.dataset}/{demo.filename}"
    s3_client(stack).upload_file(str(path), "datasets", key)
    uri = f"s3://datasets/{key}"
    print(f"uploaded {path.relative_to(REPO)} ({path.stat().st_size / 1e6:.1f} MB) to {uri}", flush=True)
    return uri


def dag_runs(dag_id: str, env: dict[str, str]) -> list[dict]:
    """The DAG's runs, as ``airflow dags list-runs -o json`` reports them."""
    out = subprocess.run(
        [str(AIRFLOW), "dags", "list-runs", dag_id, "-o", "json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    if out.returncode:
        if "does not exist in 'dag' table" in out.stderr:
            return []  # a fresh metadata database: the DAG is recorded by its first run
        raise SystemExit(f"error: airflow dags list-runs {dag_id} failed: {out.stderr[-1000:]}")
    # Airflow may log warnings before the JSON document.
    start = next((i for i, line in enumerate(out.stdout.splitlines()) if line.lstrip().startswith("[")), None)
    if start is None:
        return []
    return json.loads("\n".join(out.stdout.splitlines()[start:]))


def run_outputs(dag_id: str, run_id: str, stack: dict[str, str]) -> tuple[str, dict]:
    """The run's report URI and its metrics.json, where the training tasks put them (S3)."""
    sys.path.insert(0, str(REPO / "plugins"))
    from kubetrain.s3_layout import S3Layout

    run = S3Layout(training_bucket=stack.get("KUBETRAIN_TRAINING_BUCKET") or "training").run(dag_id, run_id)
    obj = s3_client(stack).get_object(Bucket=run.bucket, Key=run.key("output", "metrics.json"))
    return f"{run.uri}/report/report.html", json.loads(obj["Body"].read())


def run_demo(name: str) -> int:
    demo = DEMOS[name]
    stack = stack_env()
    env = airflow_env(stack)
    require_images(stack)
    upload_dataset(demo, stack)
    log = DEMO_DIR / f"{demo.dag_id}.log"
    print(f"running {demo.dag_id} with `airflow dags test` (log: {log.relative_to(REPO)}) ...", flush=True)
    before = {r["run_id"] for r in dag_runs(demo.dag_id, env)}
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(AIRFLOW), "dags", "test", demo.dag_id, "-c", json.dumps(demo.conf)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for line in proc.stdout:
            out.write(line)
            if _worth_showing(line):
                print("  " + _short(line), flush=True)
        rc = proc.wait()
    runs = [r for r in dag_runs(demo.dag_id, env) if r["run_id"] not in before]
    if not runs:
        print(f"error: `airflow dags test` recorded no run of {demo.dag_id}; see {log}", file=sys.stderr)
        return 1
    run_id, state = runs[-1]["run_id"], runs[-1]["state"]
    print(f"{demo.dag_id} run {run_id}: {state} in {time.monotonic() - start:.0f} s", flush=True)
    if rc or state != "success":
        # what the terminal left out may say why: the log's last lines, then where the rest is
        for line in log.read_text(errors="replace").splitlines()[-FAILURE_TAIL:]:
            print("  | " + _short(line), file=sys.stderr)
        print(f"error: the run did not succeed; see {log}", file=sys.stderr)
        return 1
    if trained_by := _trained_before(log):
        # train once: the same dataset version, Params and image were trained by an earlier run
        print(
            f"{demo.dag_id} trained nothing new: run {trained_by} already trained this dataset version "
            "with these Params and image (train once); its outputs follow. Change the data, or trigger "
            "the DAG with force=true in `make airflow`, to train again.",
            flush=True,
        )
        run_id = trained_by
    report_uri, metrics = run_outputs(demo.dag_id, run_id, stack)
    local = DEMO_DIR / f"report-{name}.html"
    _download(report_uri, local, stack)
    summary = {
        k: metrics.get(k) for k in ("trainer", "monitor", "final", "best", "epochs", "steps", "wall_time_s")
    }
    print("\nmetrics: " + json.dumps(summary, default=str))
    print(f"report:  {report_uri}")
    print(f"         copied to {local} (open it in a browser: the plots are inlined)")
    print(
        '         or in `make airflow`: the run\'s report task, Details tab, Extra Links: "Training report"'
    )
    print("run:     on the Training page of `make airflow`, and on its model's leaderboard")
    return 0


def _trained_before(log: Path) -> str | None:
    """The run that the check_new task names when it skipped training as already done, else None."""
    found = re.search(
        r"already trained on dataset version \S+ with these parameters and image \S+ in run (\S+) ",
        log.read_text(errors="replace"),
    )
    return found.group(1) if found else None


# A line of the task log as Airflow's console logger writes it: time, [level], the event, [logger] and
# key=value fields, e.g. "2026-11-26T19:39:18.142055Z [info     ] [base] ... [kubetrain.triggers.pod.PodLogFollower]
# loc=pod.py:124". The event is everything up to the last " [logger]" that only fields follow.
_LOG_LINE = re.compile(
    r"^(?P<time>\d{4}-\d\d-\d\dT[\d:.]+Z?) \[(?P<level>\w+)\s*\] (?P<event>.*?)"
    r"(?: \[(?P<logger>[A-Za-z_][\w.]*)\](?: [\w.]+=.*)?)?$"
)
# A trainer's own line ("%(asctime)s %(levelname)s %(message)s", trainer/common/cli.py) as the task log quotes it,
# under its container: "[base] ..." from a training pod, "[chief <pod>] ..." from a distributed run's chief.
_TRAINER_LINE = re.compile(
    r"^\[(?P<source>base|chief [^\]]+)\] \d{4}-\d\d-\d\d [\d:,.]+ (?P<level>[A-Z]+) (?P<message>.*)$"
)
# The trainer's progress: one line per epoch, a resume, early stopping, the end, a distributed run's ring.
_TRAINER_PROGRESS = ("epoch ", "resumed from ", "early stopping", "done:", "collective ring")
# kubetrain's own lines worth a newcomer's eye: why a task waits, skips, what it wrote and promoted.
_TASK_NEWS = (
    "Skipping: ",
    "GPU request served on CPU",
    "FailedScheduling",
    "Distributed training:",
    "Report written",
    "Promoted s3://",
    "Not promoting",
)


def _worth_showing(line: str) -> bool:
    """The task log lines a newcomer follows: each task's end, the trainer's epochs, what was written, errors.

    The rest (Airflow's bookkeeping, the trainer's set-up chatter, TensorFlow's start-up notices)
    stays in the log file that `make demo` names.
    """
    found = _LOG_LINE.match(line.rstrip("\n"))
    if found is None:
        return False  # a continuation of a multi-line message, or not a log line
    event, level = found["event"], found["level"]
    if trainer := _TRAINER_LINE.match(event):
        return trainer["level"] in ("WARNING", "ERROR", "CRITICAL") or trainer["message"].startswith(
            _TRAINER_PROGRESS
        )
    if event.startswith("[") and not event.startswith("[DAG TEST]"):
        return level in ("error", "critical")  # another container's line (stage-in, checkpoint-sync)
    if level in ("error", "critical"):
        return True
    return event.startswith("[DAG TEST] end task") or any(k in event for k in _TASK_NEWS)


def _short(line: str) -> str:
    """A task log line as `make demo` shows it: the event only, a trainer's line as ``trainer: <message>``.

    :param line: a line of the task log.
    """
    text = line.rstrip()
    if found := _LOG_LINE.match(text):
        text = found["event"]
        if found["level"] in ("warning", "error", "critical"):
            text = f"{found['level']}: {text}"
        if trainer := _TRAINER_LINE.match(found["event"]):
            source = "trainer" if trainer["source"] == "base" else trainer["source"]
            level = "" if trainer["level"] == "INFO" else trainer["level"].lower() + ": "
            text = f"{source}: {level}{trainer['message']}"
        elif text.startswith("[DAG TEST] end task "):
            task = re.search(r"task_id=(\S+)", text)
            text = f"task {task.group(1) if task else text} finished"
    if len(text) > SHORT and not _KEEP_WHOLE.search(text):
        text = text[: SHORT - 1] + "…"
    return text


# A line is cut at SHORT characters, unless it holds a location or a result: those are shown whole.
SHORT = 160
_KEEP_WHOLE = re.compile(
    r"s3://|https?://|/output|/kubetrain/|\bdone:|[Pp]romot|[Rr]eport|leaderboard|cluster"
)


def _download(uri: str, path: Path, stack: dict[str, str]) -> None:
    bucket, _, key = uri[len("s3://") :].partition("/")
    s3_client(stack).download_file(bucket, key, str(path))


def run_ui(port: int) -> int:
    """The Airflow UI against the dev stack (`make airflow`), the demo datasets uploaded, until Ctrl-C."""
    import signal
    import socket

    from include.airflow_ui import AirflowUI, AirflowUIError

    stack = stack_env()
    with socket.socket() as sock:
        if sock.connect_ex(("127.0.0.1", port)) == 0:
            print(
                f"error: port {port} is in use; choose another with KUBETRAIN_AIRFLOW_PORT=PORT or --port",
                file=sys.stderr,
            )
            return 1
    require_images(stack)
    for demo in DEMOS.values():
        upload_dataset(demo, stack)
    # Cron schedules stay off unless asked for: unpausing a DAG would otherwise start a run for
    # the latest cron tick at once, next to the run the newcomer triggers.
    env = {
        name: os.environ.get(name, "")
        for name in ("KUBETRAIN_IMAGE_CLASSIFIER_CRON", "KUBETRAIN_IMAGE_BUILD_CRON")
    }
    ui = AirflowUI(
        Path(os.environ.get("AIRFLOW_HOME", REPO / ".airflow")),
        stack,
        port=port,
        host=os.environ.get("KUBETRAIN_AIRFLOW_HOST", "127.0.0.1"),
        seed_db=None,
        paused_at_creation=True,
        env=env,
    )

    def stop_requested(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    # Both explicitly: a shell that starts us in the background hands down SIGINT ignored.
    signal.signal(signal.SIGTERM, stop_requested)
    signal.signal(signal.SIGINT, stop_requested)
    rc = 0
    try:
        print(
            f"starting Airflow (api-server, scheduler, dag-processor, triggerer); logs in {ui.home / 'logs'} ...",
            flush=True,
        )
        ui.start()
        ui.wait_dags([demo.dag_id for demo in DEMOS.values()])
        print(f"\nAirflow UI: {ui.url}  login: {ui.username} / {ui.password}", flush=True)
        print(
            "  trigger train_image_classifier from its trigger form (the form unpauses it) and follow the run;",
            flush=True,
        )
        print(
            "  unpause watch_datasets to retrain when a new dataset version lands in s3://datasets/.",
            flush=True,
        )
        print(
            "  Training (in the navigation) lists every run, `make demo`'s among them, and each model's leaderboard.",
            flush=True,
        )
        print("  Ctrl-C stops Airflow (the dev stack keeps running: `make stack-down`).", flush=True)
        while True:
            ui.check_alive()
            time.sleep(2)
    except KeyboardInterrupt:
        print("\nstopping Airflow ...", flush=True)
    except AirflowUIError as exc:
        print(f"error: {exc}", file=sys.stderr)
        rc = 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):  # a second one must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        ui.stop()
    return rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m include.demo", description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=[*DEMOS, "ui"])
    parser.add_argument("--port", type=int, default=int(os.environ.get("KUBETRAIN_AIRFLOW_PORT", "8080")))
    args = parser.parse_args(argv)
    return run_ui(args.port) if args.what == "ui" else run_demo(args.what)


if __name__ == "__main__":
    raise SystemExit(main())
