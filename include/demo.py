"""`make demo`, `make demo-dialogue` and `make airflow`: kubetrain end to end on the dev stack.

    python -m include.demo image_classifier   # digits classifier through `airflow dags test`
    python -m include.demo dialogue           # dialogue Transformer likewise
    python -m include.demo distributed        # the digits classifier on 2 workers (MultiWorkerMirroredStrategy)
    python -m include.demo ui                 # the Airflow UI, demo datasets uploaded
    python -m include.demo run DAG_ID --conf '{"epochs": 2}'   # any DAG, run as the demos run theirs

Runs in the Airflow environment (.venv) against a running dev stack (`make stack-up`). The demos'
runs go to the metadata database that `make airflow` serves (the dev stack's Postgres, one database
per Airflow home), and their task logs to that home's log folder: the Airflow UI shows them, logs
included, like the runs it started itself.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from include.demo_follow import LOG_LINE, Heartbeat, PodPhase, RunFollower, follow, lines_with_timeout
from include.devstack.stack import s3_client

REPO = Path(__file__).resolve().parents[1]
# the demos' datasets, logs and report copies (elsewhere for a test: KUBETRAIN_DEMO_DIR)
DEMO_DIR = Path(os.environ.get("KUBETRAIN_DEMO_DIR") or REPO / ".demo")
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


def airflow_home() -> Path:
    """The Airflow home that `make airflow` serves (``AIRFLOW_HOME``, else .airflow)."""
    return Path(os.environ.get("AIRFLOW_HOME", REPO / ".airflow")).resolve()


def metadata_db_env(stack: dict[str, str]) -> dict[str, str]:
    """The metadata database of `make airflow`'s Airflow, for an ``airflow`` command of the demo.

    The same database of the dev stack's Postgres that include/airflow_ui.py gives the home (made
    from the migrated template when the home has none yet), so that a demo's run, its task
    instances and XComs are the ones the UI lists, and its "Airflow run" links lead somewhere.
    """
    from include.airflow_ui import AirflowUI, AirflowUIError

    ui = AirflowUI(airflow_home(), stack)
    if ui.postgres is None:
        raise SystemExit(
            "error: the dev stack runs no Postgres (KUBETRAIN_POSTGRES_URL is not in its env file), "
            "which holds the Airflow UI's metadata database: restart it with `make stack-down stack-up`"
        )
    if ui.database is None:
        print(
            "making the Airflow metadata database on the dev stack's Postgres (once per home) ...", flush=True
        )
    try:
        with Heartbeat("making the Airflow metadata database (`airflow db migrate` the first time)"):
            ui.prepare_database()
        return {"AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": ui.sql_alchemy_conn(), **ui.postgres.env()}
    except AirflowUIError as exc:
        raise SystemExit(f"error: {exc}") from None


def airflow_env(stack: dict[str, str]) -> dict[str, str]:
    home = airflow_home()
    return {
        **os.environ,
        **stack,
        **metadata_db_env(stack),
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(home / "logs"),
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
    """Generate the demo dataset with the trainer environment and upload it to S3, unless S3 holds it already.

    The generators are seeded and write the same bytes each time: an object of the same size and
    content (its sha256 in the object's metadata, else its single-part ETag, the MD5) is not uploaded
    again, so a second demo, or `make airflow` after `make demo`, adds no dataset version.
    """
    DEMO_DIR.mkdir(exist_ok=True)
    path = DEMO_DIR / demo.filename
    subprocess.run([str(TRAINER_PYTHON), "-m", demo.generator, "--out", str(path)], cwd=REPO, check=True)
    key = f"{demo.dataset}/{demo.filename}"
    uri = f"s3://datasets/{key}"
    shown = f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path} ({path.stat().st_size / 1e6:.1f} MB)"
    s3 = s3_client(stack)
    sha256 = _file_digest(path, "sha256")
    if _holds(s3, "datasets", key, path, sha256):
        print(f"{uri} already holds {shown}: not uploaded again", flush=True)
        return uri
    s3.upload_file(str(path), "datasets", key, ExtraArgs={"Metadata": {"sha256": sha256}})
    print(f"uploaded {shown} to {uri}", flush=True)
    return uri


def _file_digest(path: Path, algorithm: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, algorithm).hexdigest()


def _holds(s3, bucket: str, key: str, path: Path, sha256: str) -> bool:
    """Whether ``s3://bucket/key`` has the bytes of ``path`` (``sha256``: their digest)."""
    from botocore.exceptions import ClientError

    try:
        head = s3.head_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return False
        raise
    if head.get("ContentLength") != path.stat().st_size:
        return False
    # S3 servers may capitalize metadata names (the dev stack's, as MinIO does)
    stored = {k.lower(): v for k, v in (head.get("Metadata") or {}).items()}.get("sha256")
    if stored:
        return stored == sha256
    etag = str(head.get("ETag") or "").strip('"')
    return "-" not in etag and etag == _file_digest(path, "md5")  # a multipart ETag is no MD5 of the bytes


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


def dags_test(
    dag_id: str, conf: dict, env: dict[str, str], log: Path, output: DemoOutput
) -> tuple[int, str | None, str | None]:
    """Run ``airflow dags test`` on the DAG, show its progress, keep its output in ``log``, and give
    each task its log file where the Airflow UI reads it (:func:`write_task_logs`).

    Returns the exit code, the run id and the run's state (``None``, ``None`` when no run was recorded).
    """
    shown_log = log.relative_to(REPO) if log.is_relative_to(REPO) else log
    print(f"running {dag_id} with `airflow dags test` (log: {shown_log}) ...", flush=True)
    with Heartbeat(f"reading {dag_id}'s runs (`airflow dags list-runs`)"):
        before = {r["run_id"] for r in dag_runs(dag_id, env)}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(AIRFLOW), "dags", "test", dag_id, "-c", json.dumps(conf)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert proc.stdout is not None

        def show(line: str) -> str | None:
            out.write(line)
            return output.feed(line)

        # a line at least every 30 s, also while the run's output says nothing worth showing
        kubeconfig = env.get("KUBECONFIG")
        # due 25 s after the last line, so that it is on the terminal within 30 s: the pod's phase is
        # looked up from the API server first (a fresh clone's quiet first demo showed a 31 s gap at 30)
        follower = RunFollower(every=25.0, pod_phase=PodPhase(kubeconfig) if kubeconfig else None)
        follow(lines_with_timeout(proc.stdout), show, follower, lambda text: print("  " + text, flush=True))
        rc = proc.wait()
    with Heartbeat("reading the run `airflow dags test` recorded (`airflow dags list-runs`)"):
        runs = [r for r in dag_runs(dag_id, env) if r["run_id"] not in before]
    if not runs:
        return rc, None, None
    run_id, state = runs[-1]["run_id"], runs[-1]["state"]
    write_task_logs(log.read_text(errors="replace").splitlines(), dag_id, run_id, airflow_home() / "logs")
    return rc, run_id, state


def run_demo(name: str) -> int:
    demo = DEMOS[name]
    stack = stack_env()
    env = airflow_env(stack)
    require_images(stack)
    upload_dataset(demo, stack)
    log = DEMO_DIR / f"{demo.dag_id}.log"
    output = DemoOutput()
    start = time.monotonic()
    rc, run_id, state = dags_test(demo.dag_id, demo.conf, env, log, output)
    if run_id is None:
        print(f"error: `airflow dags test` recorded no run of {demo.dag_id}; see {log}", file=sys.stderr)
        return 1
    print(f"{demo.dag_id} run {run_id}: {state} in {time.monotonic() - start:.0f} s", flush=True)
    if rc or state != "success":
        # what the terminal left out may say why: the log's last lines, then where the rest is
        for line in log.read_text(errors="replace").splitlines()[-FAILURE_TAIL:]:
            print("  | " + _short(line), file=sys.stderr)
        print(f"error: the run did not succeed; see {log}", file=sys.stderr)
        print_still_running(stack)
        return 1
    airflow_run = run_id
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
    print("\nmetrics:   " + json.dumps(summary, default=str))
    if output.promotion:
        print(f"promotion: {output.promotion}")
    print(f"report:    {report_uri}")
    print(f"           copied to {local} (open it in a browser: the plots are inlined)")
    print(
        '           or in `make airflow`: the run\'s report task, Details tab, Extra Links: "Training report"'
    )
    print(
        f"run:       {demo.dag_id} run {airflow_run} in `make airflow` (its tasks and their logs), on its "
        "Training page and on its model's leaderboard"
    )
    print_still_running(stack)
    return 0


def still_running(stack_dir: Path) -> list[str]:
    """What a demo leaves running, with its address, and how to stop it: the dev stack's servers."""
    from include.devstack.stack import Stack, StackError

    try:
        state = Stack(stack_dir).load_state()
    except StackError:
        return []
    ports = state.get("ports") or {}
    lines = ["still running (the dev stack, for `make airflow` and the next demo):"]
    if s3 := (state.get("s3") or {}).get("endpoint"):
        lines.append(
            f"  S3          {s3}  (buckets {', '.join((state.get('s3') or {}).get('buckets') or [])})"
        )
    if registry := state.get("registry"):
        mirror = f", its mirror of public images at {state['mirror']}" if state.get("mirror") else ""
        lines.append(f"  registry    {registry}  (the training images{mirror})")
    if kubeapi := state.get("kubeapi"):
        lines.append(f"  API server  {kubeapi}  (Kubernetes; kubeconfig {state.get('kubeconfig', '')})")
    if "postgres" in ports:
        lines.append(f"  Postgres    127.0.0.1:{ports['postgres']}  (Airflow's metadata database)")
    if "mlflow" in ports:
        lines.append(f"  MLflow      {state.get('mlflow')}")
    lines.append(
        "stop it with `make stack-down` (its data stays in .stack/ for the next `make stack-up`); "
        "`. .stack/env` points a shell at it"
    )
    return lines


def print_still_running(stack: dict[str, str]) -> None:
    stack_dir = Path(
        stack.get("KUBETRAIN_STACK_DIR") or os.environ.get("KUBETRAIN_STACK_DIR") or REPO / ".stack"
    )
    lines = still_running(stack_dir)
    if lines:
        print("\n" + "\n".join(lines), flush=True)


# -- task logs where the Airflow UI reads them -------------------------------------------------

# Airflow's [logging] log_filename_template, as the UI finds a task's log under the base log folder
_TASK_LOG_PATH = "dag_id={dag_id}/run_id={run_id}/task_id={task_id}/{map_part}attempt={attempt}.log"
_TASK_START = re.compile(r"\[DAG TEST\] starting task_id=(?P<task>\S+) map_index=(?P<map>-?\d+)")
_TASK_END = re.compile(r"\[DAG TEST\] end task task_id=(?P<task>\S+) map_index=(?P<map>-?\d+)")


def write_task_logs(lines: Iterable[str], dag_id: str, run_id: str, base: Path) -> list[Path]:
    """Give each task of a run of ``airflow dags test`` its log file, as a worker would have written it.

    ``airflow dags test`` runs the tasks one after the other in its own process and logs them to
    its console only; the UI reads a task's log from ``<base log folder>/<log_filename_template>``.
    The console lines from ``[DAG TEST] starting task_id=...`` to its ``end task`` line are that
    task's: written there as Airflow's structured log records (timestamp, level, event, logger),
    the n-th start of a task being its attempt n. Returns the files written.

    :param lines: the console output of ``airflow dags test``.
    :param dag_id: the DAG.
    :param run_id: the run it recorded.
    :param base: the base log folder of the Airflow home that `make airflow` serves.
    """
    attempts: dict[tuple[str, int], int] = {}
    records: dict[Path, list[str]] = {}
    current: Path | None = None
    stamp: str | None = None
    for raw in lines:
        line = raw.rstrip("\n")
        if start := _TASK_START.search(line):
            task, map_index = start["task"], int(start["map"])
            attempts[task, map_index] = attempt = attempts.get((task, map_index), 0) + 1
            current = base / _TASK_LOG_PATH.format(
                dag_id=dag_id,
                run_id=run_id,
                task_id=task,
                map_part=f"map_index={map_index}/" if map_index >= 0 else "",
                attempt=attempt,
            )
            records[current] = []
        if current is None:
            continue  # the DAG's parsing and the run's bookkeeping, before the first task
        if found := _LOG_LINE.match(line):
            stamp = found["time"]
            record = {"timestamp": stamp, "level": found["level"], "event": found["event"]}
            if found["logger"]:
                record["logger"] = found["logger"]
        else:  # a message's further lines (a traceback, a pod's multi-line output)
            record = {"timestamp": stamp, "event": line} if stamp else {"event": line}
        records[current].append(json.dumps(record))
        if _TASK_END.search(line):
            current = None
    for path, body in records.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(body) + "\n")
    return list(records)


def _trained_before(log: Path) -> str | None:
    """The run that the check_new task names when it skipped training as already done, else None."""
    found = re.search(
        r"already trained on dataset version \S+ with these parameters and image \S+ in run (\S+) ",
        log.read_text(errors="replace"),
    )
    return found.group(1) if found else None


# A line of the task log as Airflow's console logger writes it (time, [level], event, [logger], fields)
_LOG_LINE = LOG_LINE
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


class DemoOutput:
    """What the terminal shows of a run's console output, line by line (the cases are in tests/test_demo_output.py).

    Most lines stand alone (:func:`_worth_showing`, :func:`_short`); a few say more with what came
    before them, which `airflow dags test` logs first because it runs one task after the other:

    * the promotion: "Promoted <run> as <model>" or "Not promoting <run> (promote=..., is_better=...)"
      with the report's comparison with the promoted model (both figures) in words;
    * a sweep's early stop (``sweep=True``): the provider's error line for the trial's exit code 79
      is left out, and the trial's "stopped early" line says by which rule, at which epoch, and
      the figures of the decision its checkpoint-sync sidecar logged.

    :param sweep: the run is a sweep's (trials, early stops, the leaderboard).
    :param show: whether a line stands alone on the terminal (default :func:`_worth_showing`).
    """

    def __init__(self, *, sweep: bool = False, show: Callable[[str], bool] | None = None) -> None:
        self.sweep = sweep
        self.show = show or _worth_showing
        self.comparison: str | None = None  # the comparison with the promoted model, in words
        self.best_trial: str | None = None  # a sweep's best trial, as its leaderboard named it
        self.early_stop: re.Match | None = None  # the last stop decision of a trial's sidecar
        self.promotion: str | None = None  # the outcome of the promotion, in a sentence

    def feed(self, line: str) -> str | None:
        """The terminal's line for ``line`` of the console output, or None."""
        found = _LOG_LINE.match(line.rstrip("\n"))
        event = found["event"] if found else ""
        if compared := _COMPARISON.match(event):
            self.comparison = compared["reason"]
            self.best_trial = compared["trial"] or self.best_trial
        if self.sweep:
            if stop := _EARLY_STOP_DECISION.search(event):
                self.early_stop = stop
                return None
            if _STOPPED_EXIT.match(event):
                return None  # the trial's own line follows: "Trial N was stopped early ..."
            if trial := _TRIAL_STOPPED.match(event):
                return self._stop_line(trial["trial"])
        if promoted := _PROMOTED.match(event):
            whose = (
                f"trial {self.best_trial}'s model" if self.sweep and self.best_trial else "the run's model"
            )
            why = f" ({self.comparison})" if self.comparison else ""
            self.promotion = f"promoted {whose} as {promoted['model']}{why}"
            return f"Promoted {promoted['run']} as {promoted['model']}{why}"
        if not_promoted := _NOT_PROMOTED.match(event):
            if not_promoted["rule"] == "never":
                why = "promote=never"
            elif not_promoted["rule"] == "if_better" and self.comparison:
                why = self.comparison
            else:
                why = f"promote={not_promoted['rule']}, is_better={not_promoted['better']}"
            whose = (
                f"trial {self.best_trial}'s model" if self.sweep and self.best_trial else "the run's model"
            )
            self.promotion = f"{whose} not promoted: {why}"
            return f"Not promoting {not_promoted['run']}: {why}"
        if self.show(line):
            return _short(line)
        return None

    def _stop_line(self, trial: str) -> str:
        stop, self.early_stop = self.early_stop, None
        if stop is None:
            return f"trial {trial} stopped early by the sweep's early-stopping rule"
        # a rung is a number of reports: the image classifier reports once an epoch
        head = f"trial {trial} stopped early by {stop['rule']} at epoch {stop['rung']}"
        if stop["rank"] is None:
            return f"{head} ({stop['metric']} was not a finite number there)"
        return (
            f"{head} ({stop['metric']} {stop['value']} ranked {stop['rank']} of {stop['of']}; "
            f"the top {stop['top']} go on, cut-off {stop['cutoff']})"
        )


# The report's (or a sweep leaderboard's) comparison with the promoted model (kubetrain.report.inputs.compare)
_COMPARISON = re.compile(
    r"^(?:Comparison with the promoted \S+|Best trial (?P<trial>\S+) against the promoted \S+): (?P<reason>.+)$"
)
# kubetrain.operators.promote: "Promoted <run> as <model uri> (...)", "Not promoting <run> (promote=.., is_better=..)"
_PROMOTED = re.compile(r"^Promoted (?P<run>s3://\S+) as (?P<model>s3://\S+)")
_NOT_PROMOTED = re.compile(
    r"^Not promoting (?P<run>\S+) \(promote=(?P<rule>\w+), is_better=(?P<better>\w+)\)"
)
# The checkpoint-sync sidecar's stop decision (trainer/sync/asha.py), as the task log quotes the container's line
_EARLY_STOP_DECISION = re.compile(
    r"checkpoint-sync: (?P<rule>\w+): (?P<metric>\S+) (?:(?P<value>\S+) )?at rung (?P<rung>\d+) "
    r"(?:ranks (?P<rank>\d+) of (?P<of>\d+), outside the top (?P<top>\d+) \(cut-off (?P<cutoff>\S+)\): )?"
    r"(?:is not a finite number.*)?stopping the trial"
)
# The provider's line for a container that exited 79 (kubetrain_contract.exit_codes.EXIT_STOPPED)
_STOPPED_EXIT = re.compile(r"^Container 'base': state='TERMINATED', reason='\w+', exit_code=79\b")
_TRIAL_STOPPED = re.compile(r"^Trial (?P<trial>\S+) was stopped early by the sweep's early-stopping rule")


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
    for demo in {(d.dataset, d.filename): d for d in DEMOS.values()}.values():  # digits serves two demos
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


def run_dag(dag_id: str, conf: dict) -> int:
    """Any DAG, run as the demos run theirs (`make airflow`'s metadata DB, task logs where its UI reads
    them, the progress on the terminal): ``python -m include.demo run DAG_ID --conf JSON``."""
    stack = stack_env()
    env = airflow_env(stack)
    DEMO_DIR.mkdir(exist_ok=True)
    log = DEMO_DIR / f"{dag_id}.log"
    start = time.monotonic()
    output = DemoOutput()
    rc, run_id, state = dags_test(dag_id, conf, env, log, output)
    if run_id is None:
        print(f"error: `airflow dags test` recorded no run of {dag_id}; see {log}", file=sys.stderr)
        return rc or 1
    print(
        f"{dag_id} run {run_id}: {state} in {time.monotonic() - start:.0f} s (in `make airflow`)", flush=True
    )
    if output.promotion:
        print(f"promotion: {output.promotion}")
    return 0 if rc == 0 and state == "success" else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m include.demo", description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=[*DEMOS, "ui", "run"])
    parser.add_argument("dag_id", nargs="?", help="run: the DAG to run")
    parser.add_argument("--conf", default="{}", help="run: the run's conf, a JSON object")
    parser.add_argument("--port", type=int, default=int(os.environ.get("KUBETRAIN_AIRFLOW_PORT", "8080")))
    args = parser.parse_args(argv)
    if args.what == "run":
        if not args.dag_id:
            parser.error("run needs the DAG's id: python -m include.demo run DAG_ID [--conf JSON]")
        try:
            conf = json.loads(args.conf)
        except ValueError as exc:
            parser.error(f"--conf {args.conf!r} is not valid: expected a JSON object ({exc})")
        if not isinstance(conf, dict):
            parser.error(f"--conf {args.conf!r} is not valid: expected a JSON object")
        return run_dag(args.dag_id, conf)
    if args.dag_id:
        parser.error(f"{args.what} takes no DAG id (only `run` does)")
    return run_ui(args.port) if args.what == "ui" else run_demo(args.what)


if __name__ == "__main__":
    raise SystemExit(main())
