"""What `make demo` prints: each epoch as the trainer reports it, the tasks' ends and what they wrote; not the
set-up noise (Airflow's bookkeeping, TensorFlow's start-up notices, pip's progress bars, an image check's --help).

The lines below are as `make demo` and `make stack-images` captured them (.demo/<dag>.log and the terminal),
cut where they repeat; the chief's line is the trainer's line as kubetrain.triggers.distributed quotes it.
"""

from __future__ import annotations

import os

import pytest

from include.demo import _short, _worth_showing
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
