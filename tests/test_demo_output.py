"""What `make demo` prints: each epoch as the trainer reports it, the tasks' ends and what they wrote; not the
set-up noise (Airflow's bookkeeping, TensorFlow's start-up notices, pip's progress bars, an image check's --help).

The lines below are as `make demo` and `make stack-images` captured them (.demo/<dag>.log and the terminal),
cut where they repeat; the chief's line is the trainer's line as kubetrain.triggers.distributed quotes it.
The sweep's stop lines, the comparison and the promotion lines are as their modules write them (the
checkpoint-sync sidecar's trainer/sync/asha.py, the provider's pod operator, kubetrain.sweep.trial,
kubetrain.operators.report and .promote), in the console format of the lines above.
"""

from __future__ import annotations

import json
import os

import pytest

from include.demo import DemoOutput, _short, _worth_showing, still_running, write_task_logs
from include.demo_sweep import copy_leaderboard, promotion_sentence
from include.devstack.stack import s3_client
from kubetrain.imagebuild.buildah import BuildahBuilder
from kubetrain.imagebuild.builders import BuildError
from kubetrain.imagebuild.release import worth_showing

FOLLOWER = "[kubetrain.triggers.pod.PodLogFollower] loc=pod.py:124"

# (task log line, what the terminal shows of it; None: not shown)
TASK_LOG = [
    (
        "2026-11-26T19:39:01.848955Z [info     ] [DAG TEST] end task task_id=stage_dataset map_index=-1 "
        "[airflow.sdk.definitions.dag] loc=dag.py:1563",
        "task stage_dataset finished",
    ),
    (
        "2026-11-26T19:39:07.978805Z [warning  ] GPU request served on CPU: pod train-a94n8nml asked for 1 "
        "nvidia.com/gpu, but node kubetrain-dev has none [kubetrain.triggers.pod.TrainingPodTrigger] loc=pod.py:301",
        "warning: GPU request served on CPU: pod train-a94n8nml asked for 1 nvidia.com/gpu, but node "
        "kubetrain-dev has none",
    ),
    (
        "2026-11-26T19:39:18.142055Z [info     ] [base] 2026-11-26 19:39:12,093 INFO epoch 1: loss 1.7051 "
        f"accuracy 0.5043 val_loss 2.0469 val_accuracy 0.1616 (best val_accuracy so far) {FOLLOWER}",
        "trainer: epoch 1: loss 1.7051 accuracy 0.5043 val_loss 2.0469 val_accuracy 0.1616 (best val_accuracy "
        "so far)",
    ),
    (
        "2026-11-26T19:39:18.142833Z [info     ] [base] 2026-11-26 19:39:17,219 INFO done: 88 steps; exported "
        f"epoch 4, val_accuracy 0.9415; outputs in /output {FOLLOWER}",
        "trainer: done: 88 steps; exported epoch 4, val_accuracy 0.9415; outputs in /output",
    ),
    (
        "2026-11-26T20:11:02.120000Z [info     ] [chief train-dist-chief-0] 2026-11-26 20:10:58,001 INFO epoch 2: "
        "loss 0.9981 accuracy 0.8409 val_loss 0.8855 val_accuracy 0.8997 "
        "[kubetrain.triggers.distributed.DistributedJobTrigger] loc=distributed.py:195",
        "chief train-dist-chief-0: epoch 2: loss 0.9981 accuracy 0.8409 val_loss 0.8855 val_accuracy 0.8997",
    ),
    (
        "2026-11-26T19:39:02.162779Z [info     ] Skipping: already trained on dataset version 04d598435446b7e2 "
        "with these parameters and image r/kubetrain/trainer@sha256:9efd in run manual__1 (finished x); trigger "
        "with force=true to train again [airflow.task.operators.kubetrain.operators.dedupe.SkipIfTrainedOperator] "
        "loc=dedupe.py:133",
        "Skipping: already trained on dataset version 04d598435446b7e2 with these parameters and image "
        "r/kubetrain/trainer@sha256:9efd in run manual__1 (finished x); trigger with force=true to train again",
    ),
    (
        "2026-11-26T19:39:21.793991Z [info     ] Report written to s3://training/runs/d/r/report/report.html (5 "
        "files) [airflow.task.operators.kubetrain.operators.report.ReportOperator] loc=report.py:160",
        "Report written to s3://training/runs/d/r/report/report.html (5 files)",
    ),
    (  # a location is never cut, however long the line
        "2026-11-26T19:39:40.000000Z [info     ] Promoted s3://training/runs/image_classifier/manual__2026-11-29T04:"
        "14:28+00:00/output/model as s3://training/models/image-classifier/20261129T041428Z-6 (val_accuracy 0.9415 "
        "against 0.9301) [airflow.task.operators.kubetrain.operators.promote.PromoteModelOperator] loc=promote.py:9",
        "Promoted s3://training/runs/image_classifier/manual__2026-11-29T04:14:28+00:00/output/model as "
        "s3://training/models/image-classifier/20261129T041428Z-6 (val_accuracy 0.9415 against 0.9301)",
    ),
    (  # other long lines are cut, and say so
        "2026-11-26T19:39:41.000000Z [error    ] The pod failed: " + "x" * 200 + " [task] loc=pod.py:1",
        ("error: The pod failed: " + "x" * 200)[:159] + "…",
    ),
    (
        "2026-11-26T19:39:30.000000Z [error    ] Task failed with exception [task] loc=task_runner.py:1000",
        "error: Task failed with exception",
    ),
    # the set-up noise
    (
        "2026-11-26T19:38:49.657886Z [warning  ] Could not import graphviz. Rendering graph to the graphical",
        None,
    ),
    ("You might need to install the graphviz package and necessary system packages.", None),
    (
        "2026-11-26T19:38:53.766247Z [info     ] get next_dagrun_info_v2        [airflow.serialization.definitions"
        ".dag] last_automated_run_info=None loc=dag.py:453 next_info=None",
        None,
    ),
    (
        "2026-11-26T19:39:00.570486Z [info     ] Task started                   [airflow.api_fastapi.execution_api."
        "routes.task_instances] correlation_id=01a2195e hostname=vm loc=task_instances.py:226",
        None,
    ),
    (
        "2026-11-26T19:39:07.991271Z [info     ] ::group::Waiting up to 900s to get the POD scheduled... "
        "[kubetrain.triggers.pod.PodLogFollower] loc=pod_manager.py:166",
        None,
    ),
    (
        "2026-11-26T19:39:18.127558Z [info     ] [stage-in] 2026-11-26T19:39:03Z stage-in: dataset digits version "
        f"04d598435446b7e2: 1 objects, 1.4 MB from s3://datasets/digits/ {FOLLOWER}",
        None,
    ),
    (
        "2026-11-26T19:39:18.134743Z [info     ] [checkpoint-sync] 2026-11-26T19:39:17Z checkpoint-sync: SIGTERM: "
        f"final pass, 230s at most {FOLLOWER}",
        None,
    ),
    (
        "2026-11-26T19:39:18.141568Z [info     ] [base] WARNING: All log messages before absl::InitializeLog() is "
        f"called are written to STDERR {FOLLOWER}",
        None,
    ),
    (
        "2026-11-26T19:39:18.141622Z [info     ] [base] I0000 00:00:1795721945.418864       1 port.cc:153] "
        f"oneDNN custom operations are on. {FOLLOWER}",
        None,
    ),
    (
        "2026-11-26T19:39:18.141721Z [info     ] [base] 2026-11-26 19:39:07,195 INFO devices: "
        f"/physical_device:CPU:0; strategy _DefaultDistributionStrategy with 1 replica(s) {FOLLOWER}",
        None,
    ),
    (
        "2026-11-26T19:39:18.141925Z [info     ] [base] 2026-11-26 19:39:09,603 INFO step 10 epoch 1/4 batch "
        f"10/22 loss 1.9390 accuracy 0.3854 (epoch mean loss 1.9932) lr 0.001 eta 0m03s {FOLLOWER}",
        None,
    ),
    (
        "2026-11-26T19:39:18.142136Z [info     ] [base] 2026-11-26 19:39:12,150 INFO checkpoint ckpt-22 written "
        f"(end of epoch; epoch 2, batch 0) {FOLLOWER}",
        None,
    ),
    (
        "2026-11-26T19:39:23.679910Z [info     ] Marking run <DagRun train_image_classifier @ 2026-11-26 "
        "19:38:49.765467+00:00: manual__1, state:running> successful [airflow.models.dagrun.DagRun] loc=dagrun.py:1",
        None,
    ),
]


@pytest.mark.parametrize(("line", "shown"), TASK_LOG, ids=range(len(TASK_LOG)))
def test_make_demo_shows_progress_and_hides_the_set_up(line, shown):
    assert _worth_showing(line + "\n") is (shown is not None)
    if shown is not None:
        assert _short(line + "\n") == shown


def test_a_whole_run_reads_as_its_epochs():
    shown = [_short(line) for line, _ in TASK_LOG if _worth_showing(line)]
    assert [s for s in shown if s.startswith(("trainer: epoch", "chief"))], shown
    assert len(shown) == sum(1 for _, s in TASK_LOG if s is not None)


# `make stack-images`' output, as the build prints it (buildah's steps, pip inside a RUN step)
BUILD_OUTPUT = [
    ("STEP 5/13: RUN python3 -m pip install -r /tmp/requirements-image.txt ${TENSORFLOW_PACKAGE}", True),
    ("Collecting boto3==1.44.5", True),
    ("  Downloading boto3-1.44.5-py3-none-any.whl (140 kB)", True),
    ("     ━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━ 140.2/140.2 kB 971.2 kB/s eta 0:00:00", False),
    ("     ━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━ 4.4/4.4 MB 15.3 MB/s eta 0:00:00", False),
    ("     ━━━━━━━━━━━━━━━━━━━━╸━━━━━━━━━━━━━━━━━━ 137.2/273.8 MB 277.7 MB/s eta 0:00:01", False),
    ("     |████████████████████████████████| 4.4 MB 15.3 MB/s", False),
    (
        "Successfully installed awscrt-0.38.0 boto3-1.44.5 botocore-1.44.8 jmespath-1.1.0 pillow-12.0.0",
        True,
    ),
    (
        "WARNING: Running pip as the 'root' user can result in broken permissions and conflicting behaviour with "
        "the system package manager. It is recommended to use a virtual environment instead: "
        "https://pip.pypa.io/warnings/venv",
        False,
    ),
    ("[notice] A new release of pip is available: 24.0 -> 25.3", False),
    ("--> Using cache fc321c5ba4aa7583aad0067c62ed0141d29452bbcd52c5503f9d37b0792c6087", True),
    ("COMMIT localhost/kubetrain/trainer:trainer-cpu", True),
    ("checking localhost/kubetrain/trainer:trainer-cpu: python3 -m trainer.image_classifier --help", True),
    ("pushing sync to 127.0.0.1:5000/kubetrain/sync:latest", True),
]


@pytest.mark.parametrize(("line", "shown"), BUILD_OUTPUT, ids=range(len(BUILD_OUTPUT)))
def test_make_images_hides_pips_progress_and_root_warning(line, shown):
    assert worth_showing(line) is shown


def test_an_image_check_keeps_its_output_to_itself_unless_it_fails(tmp_path):
    """The check of an image (its --help) runs quietly: nothing logged when it passes, its last lines when not."""
    logged: list[str] = []
    builder = BuildahBuilder(tmp_path / "store", log=logged.append)
    usage = "usage: python -m trainer.image_classifier [-h] [--data-dir DIR]"
    tail = builder.run(
        ["sh", "-c", f"echo '{usage}'; echo '  -h, --help'"], dict(os.environ), "x", quiet=True
    )
    assert tail == [usage, "  -h, --help"] and logged == []
    with pytest.raises(BuildError, match="the check of trainer-cpu failed with exit code 3") as failed:
        builder.run(
            ["sh", "-c", f"echo '{usage}'; exit 3"], dict(os.environ), "the check of trainer-cpu", quiet=True
        )
    assert usage in str(failed.value) and logged == []
    builder.run(["sh", "-c", "echo STEP 1/2: FROM base"], dict(os.environ), "a build")
    assert logged == ["STEP 1/2: FROM base"]


# -- lines that say more with what came before them (include.demo.DemoOutput) ----------------------------------

SIDECAR = "[kubetrain.triggers.pod.PodLogFollower] loc=pod.py:124"
TRIAL_TASK = "[airflow.task.operators.kubetrain.sweep.trial.TrialPodOperator]"
PROMOTE_TASK = "[airflow.task.operators.kubetrain.operators.promote.PromoteModelOperator] loc=promote.py:165"


def _log(time: str, level: str, event: str, tail: str) -> str:
    return f"2026-11-29T05:{time}Z [{level:<9}] {event} {tail}\n"


# A sweep's trial stopped by asha, as the task log has it: the checkpoint-sync sidecar's decision
# (trainer/sync/asha.py), the provider's line for the trainer's exit code 79, the trial task's line.
ASHA_STOP = [
    _log(
        "01:09.100000",
        "info",
        "[checkpoint-sync] 2026-11-29T05:01:09Z checkpoint-sync: asha: val_accuracy 0.101562 at rung 1 ranks 3 of 4, "
        "outside the top 1 (cut-off 0.851562): stopping the trial (/checkpoints/STOP)",
        SIDECAR,
    ),
    _log(
        "01:12.000000",
        "error",
        "Container 'base': state='TERMINATED', reason='Error', exit_code=79, message='None'",
        f"{TRIAL_TASK} loc=pod.py:1471",
    ),
    _log(
        "01:12.100000",
        "info",
        "Trial 3 was stopped early by the sweep's early-stopping rule (exit code 79): a success",
        f"{TRIAL_TASK} loc=trial.py:285",
    ),
]


def test_a_sweeps_early_stop_reads_as_a_stop_with_its_figures():
    output = DemoOutput(sweep=True)
    assert [output.feed(line) for line in ASHA_STOP] == [
        None,
        None,
        "trial 3 stopped early by asha at epoch 1 (val_accuracy 0.101562 ranked 3 of 4; the top 1 go on, "
        "cut-off 0.851562)",
    ]
    # a stop whose decision the log did not quote still reads as a stop, not as an error
    assert output.feed(ASHA_STOP[2]) == "trial 3 stopped early by the sweep's early-stopping rule"


def test_an_unranked_stop_says_why():
    unranked = _log(
        "01:09.100000",
        "info",
        "[checkpoint-sync] 2026-11-29T05:01:09Z checkpoint-sync: asha: val_loss at rung 3 is not a finite number "
        "(NaN, infinite or not a number): stopping the trial unranked (/checkpoints/STOP)",
        SIDECAR,
    )
    output = DemoOutput(sweep=True)
    assert [output.feed(line) for line in (unranked, *ASHA_STOP[1:])] == [
        None,
        None,
        "trial 3 stopped early by asha at epoch 3 (val_loss was not a finite number there)",
    ]


def test_exit_code_79_outside_a_sweep_stays_an_error():
    assert DemoOutput().feed(ASHA_STOP[1]) == (
        "error: Container 'base': state='TERMINATED', reason='Error', exit_code=79, message='None'"
    )


RUN = "s3://training/runs/train_image_classifier_distributed/manual__2026-11-29T05:00:00+00:00"
COMPARED = _log(
    "02:00.000000",
    "info",
    "Comparison with the promoted image-classifier: val_accuracy 0.8997 is not better than the promoted 0.9415 (max)",
    "[airflow.task.operators.kubetrain.operators.report.ReportOperator] loc=report.py:189",
)


def test_a_run_not_promoted_says_both_figures():
    output = DemoOutput()
    not_promoting = _log(
        "02:05.000000",
        "info",
        f"Not promoting {RUN}/output (promote=if_better, is_better=False)",
        PROMOTE_TASK,
    )
    assert output.feed(COMPARED) is None
    assert output.feed(not_promoting) == (
        f"Not promoting {RUN}/output: val_accuracy 0.8997 is not better than the promoted 0.9415 (max)"
    )
    assert output.promotion == (
        "the run's model not promoted: val_accuracy 0.8997 is not better than the promoted 0.9415 (max)"
    )


def test_a_promotion_reads_as_a_sentence_with_the_comparison():
    output = DemoOutput()
    model = "s3://training/models/image-classifier/20261129T050000Z-6"
    better = COMPARED.replace("0.8997 is not better", "0.9512 is better")
    promoted = _log("02:05.000000", "info", f"Promoted {RUN} as {model} (latest)", PROMOTE_TASK)
    assert output.feed(better) is None
    assert output.feed(promoted) == (
        f"Promoted {RUN} as {model} (val_accuracy 0.9512 is better than the promoted 0.9415 (max))"
    )
    assert output.promotion == (
        f"promoted the run's model as {model} (val_accuracy 0.9512 is better than the promoted 0.9415 (max))"
    )


def test_a_sweeps_promotion_names_the_best_trial():
    output = DemoOutput(sweep=True)
    model = "s3://training/models/image-classifier-sweep/20261129T050000Z-9"
    best = _log(
        "03:00.000000",
        "info",
        "Best trial 4 against the promoted image-classifier-sweep: no model is promoted yet",
        "[airflow.task.operators.kubetrain.sweep.leaderboard.SweepReportOperator] loc=leaderboard.py:130",
    )
    output.feed(best)
    output.feed(_log("03:05.000000", "info", f"Promoted {RUN}/trials/4 as {model} (latest)", PROMOTE_TASK))
    assert output.promotion == f"promoted trial 4's model as {model} (no model is promoted yet)"


SWEEP_RECORD = {
    "best": {"best_trial": 4, "best_run_uri": f"{RUN}/trials/4", "best_value": 0.93},
    "comparison": {
        "better_than_promoted": True,
        "reason": "val_accuracy 0.93 is better than the promoted 0.9 (max)",
    },
    "promotion": {
        "promoted": True,
        "model_uri": "s3://training/models/image-classifier-sweep/20261129T050000Z-9",
        "model_version": "20261129T050000Z-9",
    },
}


def test_the_sweeps_promotion_in_its_summary_is_a_sentence():
    assert promotion_sentence(SWEEP_RECORD) == (
        "promoted trial 4's model as s3://training/models/image-classifier-sweep/20261129T050000Z-9 "
        "(version 20261129T050000Z-9): val_accuracy 0.93 is better than the promoted 0.9 (max)"
    )
    not_better = {
        **SWEEP_RECORD,
        "comparison": {
            "better_than_promoted": False,
            "reason": "val_accuracy 0.88 is not better than the promoted 0.9 (max)",
        },
        "promotion": {"promoted": False, "model_uri": None},
    }
    assert promotion_sentence(not_better) == (
        "trial 4's model not promoted: val_accuracy 0.88 is not better than the promoted 0.9 (max)"
    )


# -- the ending: what is still running, and how to stop it ---------------------------------------------------


def test_the_demo_ends_with_what_is_still_running(tmp_path):
    assert still_running(tmp_path) == []  # no stack there: nothing to say
    state = {  # as include.devstack.stack.Stack.up writes it
        "ports": {"s3": 9000, "registry": 5000, "mirror": 5001, "kubeapi": 6443, "postgres": 5432},
        "components": {},
        "s3": {"endpoint": "http://127.0.0.1:9000", "buckets": ["datasets", "training"]},
        "registry": "127.0.0.1:5000",
        "mirror": "127.0.0.1:5001",
        "kubeapi": "https://127.0.0.1:6443",
        "kubeconfig": str(tmp_path / "kubeconfig"),
        "postgres": {"url": "postgresql://airflow@127.0.0.1:5432", "pgpass": str(tmp_path / "pgpass")},
    }
    (tmp_path / "state.json").write_text(json.dumps(state))
    lines = still_running(tmp_path)
    text = "\n".join(lines)
    for address in ("http://127.0.0.1:9000", "127.0.0.1:5000", "https://127.0.0.1:6443", "127.0.0.1:5432"):
        assert address in text, text
    assert [line.split()[0] for line in lines[1:5]] == ["S3", "registry", "API", "Postgres"]
    assert "make stack-down" in lines[-1]


# -- the task logs of a run of `airflow dags test`, where the UI reads them -----------------------------------

DAG_TEST = "[airflow.sdk.definitions.dag] loc=dag.py:1501"
CONSOLE = [
    _log(
        "00:00.000000", "info", "Filling up the DagBag from /work/main/dags", "[airflow.models.dagbag.DagBag]"
    ),
    _log("00:01.000000", "info", "[DAG TEST] starting task_id=stage_dataset map_index=-1", DAG_TEST),
    _log(
        "00:02.000000",
        "info",
        "Staged 1 object",
        "[airflow.task.operators.kubetrain.operators.stage.StageOperator]",
    ),
    _log("00:03.000000", "info", "[DAG TEST] end task task_id=stage_dataset map_index=-1", DAG_TEST),
    _log("00:04.000000", "info", "[DAG TEST] starting task_id=trial map_index=0", DAG_TEST),
    _log("00:05.000000", "error", "Task failed with exception", "[task] loc=task_runner.py:1000"),
    "Traceback (most recent call last):\n",
    '  File "x.py", line 1, in <module>\n',
    _log("00:06.000000", "info", "[DAG TEST] end task task_id=trial map_index=0", DAG_TEST),
    _log("00:07.000000", "info", "[DAG TEST] starting task_id=trial map_index=0", DAG_TEST),
    _log("00:08.000000", "info", "[DAG TEST] end task task_id=trial map_index=0", DAG_TEST),
    _log("00:09.000000", "info", "Marking run successful", "[airflow.models.dagrun.DagRun] loc=dagrun.py:1"),
]


def test_each_task_of_a_dags_test_run_gets_its_log_file(tmp_path):
    from airflow.utils.log.file_task_handler import StructuredLogMessage

    run = "manual__2026-11-29T05:00:00+00:00"
    written = write_task_logs(CONSOLE, "train", run, tmp_path)
    folder = tmp_path / "dag_id=train" / f"run_id={run}"
    assert written == [
        folder / "task_id=stage_dataset" / "attempt=1.log",
        folder / "task_id=trial" / "map_index=0" / "attempt=1.log",
        folder / "task_id=trial" / "map_index=0" / "attempt=2.log",
    ]
    stage = [StructuredLogMessage.model_validate_json(line) for line in written[0].read_text().splitlines()]
    assert [m.event for m in stage] == [
        "[DAG TEST] starting task_id=stage_dataset map_index=-1",
        "Staged 1 object",
        "[DAG TEST] end task task_id=stage_dataset map_index=-1",
    ]
    assert stage[1].timestamp.isoformat() == "2026-11-29T05:00:02+00:00"
    assert stage[1].model_extra["logger"] == "airflow.task.operators.kubetrain.operators.stage.StageOperator"
    failed = [json.loads(line) for line in written[1].read_text().splitlines()]
    # a traceback's lines keep their place, under the time of the record they belong to
    assert [(r["event"], r.get("level"), r["timestamp"]) for r in failed[1:4]] == [
        ("Task failed with exception", "error", "2026-11-29T05:00:05.000000Z"),
        ("Traceback (most recent call last):", None, "2026-11-29T05:00:05.000000Z"),
        ('  File "x.py", line 1, in <module>', None, "2026-11-29T05:00:05.000000Z"),
    ]
    assert "Marking run successful" not in "".join(p.read_text() for p in written)


# -- the dataset is uploaded once ---------------------------------------------------------------------------


def test_an_identical_dataset_is_not_uploaded_again(s3_server, tmp_path, monkeypatch, capsys):
    import include.demo as demo

    stack = {
        "KUBETRAIN_S3_ENDPOINT": s3_server.endpoint,
        "KUBETRAIN_S3_ACCESS_KEY_ID": s3_server.access_key_id,
        "KUBETRAIN_S3_SECRET_ACCESS_KEY": s3_server.secret_access_key,
    }
    monkeypatch.setattr(demo, "DEMO_DIR", tmp_path)
    dialogue = demo.DEMOS["dialogue"]
    key = f"{dialogue.dataset}/{dialogue.filename}"
    s3 = s3_client(stack)
    s3.delete_object(Bucket="datasets", Key=key)
    demo.upload_dataset(dialogue, stack)
    first = s3.head_object(Bucket="datasets", Key=key)
    assert "uploaded" in capsys.readouterr().out
    demo.upload_dataset(dialogue, stack)
    assert "already holds" in capsys.readouterr().out
    assert s3.head_object(Bucket="datasets", Key=key)["LastModified"] == first["LastModified"]
    # without its sha256 (an object put by another client, or user metadata lost in a restart): the ETag decides
    s3.put_object(Bucket="datasets", Key=key, Body=(tmp_path / dialogue.filename).read_bytes())
    demo.upload_dataset(dialogue, stack)
    assert "already holds" in capsys.readouterr().out
    # other bytes of the same size are uploaded over
    body = bytearray((tmp_path / dialogue.filename).read_bytes())
    body[0] ^= 1
    s3.put_object(Bucket="datasets", Key=key, Body=bytes(body), Metadata={"sha256": "0" * 64})
    demo.upload_dataset(dialogue, stack)
    assert "uploaded" in capsys.readouterr().out
    got = s3.get_object(Bucket="datasets", Key=key)["Body"].read()
    assert got == (tmp_path / dialogue.filename).read_bytes()


# -- the sweep's leaderboard copy links its trials' reports as files ---------------------------------------------


def test_the_local_leaderboard_links_copies_of_the_trial_reports(s3_server, tmp_path):
    stack = {
        "KUBETRAIN_S3_ENDPOINT": s3_server.endpoint,
        "KUBETRAIN_S3_ACCESS_KEY_ID": s3_server.access_key_id,
        "KUBETRAIN_S3_SECRET_ACCESS_KEY": s3_server.secret_access_key,
    }
    s3 = s3_client(stack)
    prefix = "runs/sweep_image_classifier/manual__2026-11-29T05_00_00_00_00"
    url = "/kubetrain/reports/sweep_image_classifier/training/" + prefix + "/trials/2/report/report.html"
    s3.put_object(
        Bucket="training",
        Key=f"{prefix}/report/report.html",
        Body=f'<table><tr><td>2</td><td><a href="{url}">report</a></td></tr></table>'.encode(),
    )
    s3.put_object(Bucket="training", Key=f"{prefix}/report/objective.png", Body=b"png")
    s3.put_object(Bucket="training", Key=f"{prefix}/trials/2/report/report.html", Body=b"<h1>trial 2</h1>")
    record = {
        "trials": [
            {
                "number": 2,
                "report_uri": f"s3://training/{prefix}/trials/2/report/report.html",
                "report_url": url,
            },
            {"number": 5, "report_uri": None, "report_url": None},  # a trial that failed before its report
        ]
    }
    local = tmp_path / "sweep-leaderboard"
    assert copy_leaderboard(s3, record, "training", prefix, local) == ["2"]
    page = (local / "report.html").read_text()
    assert 'href="trials/2/report.html"' in page and url not in page
    assert (local / "trials" / "2" / "report.html").read_text() == "<h1>trial 2</h1>"
    assert (local / "objective.png").read_bytes() == b"png"
