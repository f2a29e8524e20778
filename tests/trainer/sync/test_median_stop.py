"""Median early stopping by the checkpoint-sync sidecar: the rule, and a third-party trainer stopped for real.

The integration tests run the sidecar as a subprocess (as in a pod) against the S3 server
that verifies signatures, beside a plain Python "trainer" that knows nothing of kubetrain but
the documented contract: it appends one JSON object per step to OUTPUT_DIR/metrics.jsonl and
looks for KUBETRAIN_STOP_FILE between steps.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from sync_support import REPO, s3_client
from sync_support.faultproxy import FaultProxy
from test_checkpoint import _Lines, _sidecar

from trainer.sync.errors import parse_s3_uri
from trainer.sync.median import MedianRule, MedianStopper, parse_reports, record_values, report_values
from trainer.sync.s3 import S3


@pytest.fixture(scope="module")
def s3(s3_server):
    return s3_client(s3_server)


@pytest.mark.parametrize(
    ("rule", "values", "finished", "stop"),
    [
        # running averages at report 2: 0.4, 0.6, 0.2 -> median 0.4
        (
            MedianRule("acc", "max", 3, 2),
            [0.3, 0.35],
            [[0.2, 0.6, 0.9], [0.4, 0.8, 0.9], [0.1, 0.3, 0.5]],
            (2, 0.35, 0.4),
        ),
        (
            MedianRule("acc", "max", 3, 2),
            [0.3, 0.45],
            [[0.2, 0.6, 0.9], [0.4, 0.8, 0.9], [0.1, 0.3, 0.5]],
            None,
        ),
        (
            MedianRule("acc", "max", 3, 2),
            [0.3, 0.4],
            [[0.2, 0.6, 0.9], [0.4, 0.8, 0.9], [0.1, 0.3, 0.5]],
            None,
        ),  # not strictly worse
        (MedianRule("acc", "max", 3, 3), [0.1, 0.1], [[0.9, 0.9, 0.9]] * 3, None),  # before start_step
        (MedianRule("acc", "max", 4, 1), [0.1], [[0.9]] * 3, None),  # fewer finished trials than min_trials
        (
            MedianRule("acc", "max", 1, 1),
            [0.1],
            [[0.9], [], [0.8]],
            (1, 0.1, 0.85),
        ),  # a trial without reports counts for nothing
        # a finished trial with fewer reports than the step contributes the average of all of its reports
        (MedianRule("acc", "max", 1, 3), [0.2, 0.3, 0.35], [[0.4, 0.6]], (3, 0.35, 0.5)),
        # min: the best is the lowest, worse is above the median
        (MedianRule("loss", "min", 2, 2), [2.0, 1.5], [[1.0, 0.5], [1.2, 0.8]], (2, 1.5, 0.875)),
        (MedianRule("loss", "min", 2, 2), [2.0, 0.7], [[1.0, 0.5], [1.2, 0.8]], None),
    ],
)
def test_the_rule_is_katibs_median_stop(rule, values, finished, stop):
    decision = rule.decide(values, finished)
    if stop is None:
        assert decision is None
    else:
        assert (decision.step, decision.best, decision.median) == pytest.approx(stop)


def test_reports_come_from_metrics_jsonl_else_history_csv():
    jsonl = '{"step": 1, "score": 0.5}\n{"step": 2, "score": 0.7}\n{"step": 3, "sco'
    assert report_values(parse_reports(jsonl, "epoch,score\n1,0.1\n"), "score") == [
        0.5,
        0.7,
    ]  # torn last line dropped
    # an empty cell is epoch 2's report without a usable value, not a missing epoch (issue #53 item 9)
    assert report_values(parse_reports(None, "epoch,val_accuracy\n1,0.1\n2,\n3,0.3\n"), "val_accuracy") == [
        0.1,
        None,
        0.3,
    ]
    assert report_values(parse_reports(None, None), "val_accuracy") == []
    with pytest.raises(ValueError, match="metrics.jsonl line 1 is not JSON"):
        parse_reports("not json\n{}\n", None)


def test_a_report_counts_whether_or_not_its_value_is_a_finite_number():
    # a line that has the objective's key is a report of it, whatever its value; one without it is not
    lines = [
        '{"step": 1, "score": 0.5}',
        '{"step": 2, "score": NaN}',  # what json.dumps writes for a diverged value
        '{"step": 2, "loss": 0.1}',  # a line of other metrics: no report of score
        '{"step": 3, "score": "n/a"}',
        '{"step": 4, "score": null}',
        '{"step": 5, "score": -Infinity}',
        '{"step": 6, "score": true}',
        '{"step": 7, "score": "0.7"}',
    ]
    rows = parse_reports("".join(line + "\n" for line in lines), None)
    assert report_values(rows, "score") == [0.5, None, None, None, None, None, 0.7]
    assert report_values(rows, "loss") == [0.1]
    # a finished trial's record: its history, positions kept
    record = {"history": [{"score": 0.2}, {"score": math.nan}, {"score": 0.4}]}
    assert record_values(record, "score") == [0.2, None, 0.4]


@pytest.mark.parametrize(
    ("rule", "values", "finished", "stop"),
    [
        # none of its reports is a finite number: stopped once the rule applies (Optuna's MedianPruner
        # prunes a trial whose intermediate values are all NaN)
        (MedianRule("acc", "max", 2, 2), [None, None], [[0.5] * 3, [0.5] * 3], (2, None, 0.5)),
        (MedianRule("acc", "max", 2, 3), [None, None], [[0.5] * 3, [0.5] * 3], None),  # before start_step
        (MedianRule("acc", "max", 3, 2), [None, None], [[0.5] * 3, [0.5] * 3], None),  # before min_trials
        (MedianRule("loss", "min", 2, 2), [None, None, None], [[1.0] * 3, [1.0] * 3], (3, None, 1.0)),
        # the best usable value is ranked; the report count is the step
        (MedianRule("acc", "max", 2, 2), [0.1, None], [[0.5] * 3, [0.5] * 3], (2, 0.1, 0.5)),
        (MedianRule("acc", "max", 2, 2), [0.9, None, None], [[0.5] * 3, [0.5] * 3], None),
        # a finished trial's running average is over its usable reports among the first S
        (
            MedianRule("acc", "max", 3, 2),
            [0.45, 0.45],
            [[0.5, None, 0.9], [0.7] * 3, [0.3] * 3],
            (2, 0.45, 0.5),
        ),
        # ... and one with none there does not count at S, neither in the median nor for min_trials
        (MedianRule("acc", "max", 2, 1), [0.1], [[None, 0.9], [0.5]], None),
        (MedianRule("acc", "max", 1, 1), [0.1], [[None, 0.9], [0.5]], (1, 0.1, 0.5)),
    ],
)
def test_reports_that_are_not_finite_numbers_under_the_median_rule(rule, values, finished, stop):
    decision = rule.decide(values, finished)
    if stop is None:
        assert decision is None
    else:
        step, best, median = stop
        assert (decision.step, decision.best) == (step, best) and decision.median == pytest.approx(median)
        assert decision.record(rule).to_json()  # JSON without NaN: best is null when nothing was usable


def test_a_trial_that_reports_nan_from_the_start_is_stopped_after_start_step(s3_server, s3, tmp_path):
    prefix = f"runs/unit_median/{secrets.token_hex(5)}/sweep/trials/"
    _finished_trials(s3, prefix, [[0.6, 0.8, 0.9, 0.9], [0.5, 0.7, 0.8, 0.85]])
    code, output, sidecar, key = _trial(s3_server, tmp_path, score=math.nan, steps=40, trials_prefix=prefix)
    assert code == 79, (output, sidecar)
    decision = json.loads(s3.get_object(Bucket="training", Key=f"{key}/sync/early-stop.json")["Body"].read())
    assert decision["rule"] == "median" and decision["best"] is None and 3 <= decision["step"] < 40
    assert f"score is not a finite number in any of {decision['step']} reports" in sidecar


def _finished_trials(s3, prefix: str, curves: list[list[float]], metric: str = "score") -> None:
    """Records of finished trials as the Airflow side writes them (sweep/trials/<n>.json)."""
    for number, curve in enumerate(curves):
        record = {
            "kind": "kubetrain/sweep-trial",
            "number": number,
            "status": "success",
            "stopped_early": False,
            "history": [{"step": i + 1, metric: v} for i, v in enumerate(curve)],
        }
        s3.put_object(Bucket="training", Key=f"{prefix}{number}.json", Body=json.dumps(record).encode())
    # neither a failed trial nor one stopped early counts
    s3.put_object(
        Bucket="training",
        Key=f"{prefix}{len(curves)}.json",
        Body=json.dumps({"status": "failed", "history": [{"score": 99}]}).encode(),
    )
    s3.put_object(
        Bucket="training",
        Key=f"{prefix}{len(curves) + 1}.json",
        Body=json.dumps({"status": "success", "stopped_early": True, "history": [{"score": 99}]}).encode(),
    )


THIRD_PARTY = textwrap.dedent(
    """
    import json, os, sys, time
    out, stop = os.environ["OUTPUT_DIR"], os.environ["KUBETRAIN_STOP_FILE"]
    score, steps = float(sys.argv[1]), int(sys.argv[2])
    for step in range(1, steps + 1):
        if os.path.exists(stop):
            print(f"stop file seen before step {step}", flush=True)
            sys.exit(79)
        with open(os.path.join(out, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, "score": score}) + "\\n")
        time.sleep(0.4)
    print("finished", flush=True)
    """
)


def _trial(
    s3_server,
    tmp_path: Path,
    score: float,
    steps: int,
    trials_prefix: str,
    endpoint: str | None = None,
    checkpoint: bytes | None = None,
    grace: float = 30,
) -> tuple[int, str, str, str]:
    """A third-party trainer and its sidecar with median stopping; (exit code, trainer output, sidecar output, run key).

    ``endpoint`` is the sidecar's S3 (a proxy in front of the server); ``checkpoint`` is a file
    the trainer left in CHECKPOINT_DIR before the sidecar starts; ``grace`` bounds the final pass.
    """
    key = f"runs/unit_median/{secrets.token_hex(5)}/trials/9"
    ck, out = tmp_path / "ck", tmp_path / "out"
    ck.mkdir(parents=True)
    out.mkdir(parents=True)
    if checkpoint is not None:
        (ck / "model.weights").write_bytes(checkpoint)
    stop = ck / ".kubetrain-stop"
    env = {
        **s3_server.env(),
        **({"AWS_ENDPOINT_URL": endpoint} if endpoint else {}),
        "KUBETRAIN_EARLY_STOPPING": "median",
        "KUBETRAIN_OBJECTIVE": "score",
        "KUBETRAIN_OBJECTIVE_MODE": "max",
        "KUBETRAIN_MEDIAN_MIN_TRIALS": "2",
        "KUBETRAIN_MEDIAN_START_STEP": "3",
        "KUBETRAIN_SWEEP_TRIALS_URI": f"s3://training/{trials_prefix}",
        "KUBETRAIN_STOP_FILE": str(stop),
    }
    sidecar = _sidecar(
        env, f"s3://training/{key}", ck, out, "--interval", "0.5", "--quiet", "0", "--grace", f"{grace:g}"
    )
    lines = _Lines(sidecar)
    try:
        lines.wait("median stopping of score")  # as in a pod, the sidecar runs before the trainer starts
        trainer = subprocess.run(
            [sys.executable, "-c", THIRD_PARTY, str(score), str(steps)],
            env={**os.environ, "OUTPUT_DIR": str(out), "KUBETRAIN_STOP_FILE": str(stop)},
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
    finally:
        sidecar.terminate()
        sidecar.wait(60)
        lines.thread.join(10)
    return trainer.returncode, trainer.stdout, lines.text(), key


def test_a_third_party_trainer_below_the_median_is_stopped_after_start_step(s3_server, s3, tmp_path):
    prefix = f"runs/unit_median/{secrets.token_hex(5)}/sweep/trials/"
    _finished_trials(s3, prefix, [[0.6, 0.8, 0.9, 0.9], [0.5, 0.7, 0.8, 0.85]])
    code, output, sidecar, key = _trial(s3_server, tmp_path, score=0.3, steps=40, trials_prefix=prefix)
    assert code == 79, (output, sidecar)
    step = int(output.split("stop file seen before step ")[1].split()[0])
    decision = json.loads(s3.get_object(Bucket="training", Key=f"{key}/sync/early-stop.json")["Body"].read())
    assert decision["rule"] == "median" and decision["finished_trials"] == 2
    # decided after start_step (3 reports), at the first look (about a second), long before the end
    assert 3 <= decision["step"] < step <= decision["step"] + 6 < 40, (decision, output)
    curves = [[0.6, 0.8, 0.9, 0.9], [0.5, 0.7, 0.8, 0.85]]
    averages = [sum(c[: decision["step"]]) / len(c[: decision["step"]]) for c in curves]
    assert decision["best"] == 0.3 and decision["median"] == pytest.approx(sum(averages) / 2)
    assert f"median stopping: score best 0.3 after {decision['step']} reports is below the median" in sidecar
    # the stop file is the trainer's business, never uploaded
    listed = [
        f["path"]
        for item in s3.list_objects_v2(Bucket="training", Prefix=f"{key}/sync/pass-").get("Contents", [])
        for f in json.loads(s3.get_object(Bucket="training", Key=item["Key"])["Body"].read())["files"]
    ]
    assert listed and not any(".kubetrain-stop" in path for path in listed)


def test_a_pass_stuck_on_s3_does_not_delay_the_stop(s3_server, s3, tmp_path):
    # The upload of the trainer's checkpoint gets no answer (a hung S3) for the whole trial: the
    # pass that uploads it waits on its read timeout and retries far longer than the trial's 16 s.
    # The rule has a thread of its own, so the bad trial is still stopped after start_step, as
    # fast as on an idle S3 (when it was checked only between passes, it never was).
    prefix = f"runs/unit_median/{secrets.token_hex(5)}/sweep/trials/"
    _finished_trials(s3, prefix, [[0.6, 0.8, 0.9, 0.9], [0.5, 0.7, 0.8, 0.85]])
    release = threading.Event()

    def stall(method: str, path: str) -> threading.Event | None:
        return release if method == "PUT" and "model.weights" in path else None

    try:
        with FaultProxy(s3_server.endpoint, fail_rate=0.0, stall=stall) as proxy:
            code, output, sidecar, key = _trial(
                s3_server,
                tmp_path,
                score=0.3,
                steps=40,
                trials_prefix=prefix,
                endpoint=proxy.endpoint,
                checkpoint=os.urandom(10_000),
                grace=3,  # the final pass gives up on the hung upload
            )
            release.set()
            assert proxy.stalled.is_set(), sidecar  # the pass really was stuck
    finally:
        release.set()
    assert code == 79, (output, sidecar)
    step = int(output.split("stop file seen before step ")[1].split()[0])
    decision = json.loads(s3.get_object(Bucket="training", Key=f"{key}/sync/early-stop.json")["Body"].read())
    assert 3 <= decision["step"] < step <= decision["step"] + 6 < 40, (decision, output, sidecar)


def test_a_good_trial_and_a_silent_one_are_never_stopped(s3_server, s3, tmp_path):
    prefix = f"runs/unit_median/{secrets.token_hex(5)}/sweep/trials/"
    _finished_trials(s3, prefix, [[0.6, 0.8, 0.9, 0.9], [0.5, 0.7, 0.8, 0.85]])
    code, output, sidecar, key = _trial(
        s3_server, tmp_path / "good", score=0.95, steps=8, trials_prefix=prefix
    )
    assert code == 0 and "finished" in output, (output, sidecar)
    assert "Contents" not in s3.list_objects_v2(Bucket="training", Prefix=f"{key}/sync/early-stop")
    # a container that reports nothing: the rule never has a value to judge
    silent = MedianStopper(
        S3(pool=2),
        MedianRule("score", "max", 1, 1),
        run=parse_s3_uri(f"s3://training/{key}"),
        trials=parse_s3_uri(f"s3://training/{prefix}"),
        output_dir=tmp_path / "nothing",
        stop_file=tmp_path / "stop",
    )
    assert silent.check() is None and not (tmp_path / "stop").exists()
