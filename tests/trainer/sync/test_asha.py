"""ASHA and Hyperband stopping by the checkpoint-sync sidecar: the rung rule on hand-made report tables,
Hyperband's bracket assignment, and the stopper against the S3 server (rung reports of running trials,
records of finished ones, the decision in early-stop.json, and a third-party trainer stopped for real).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from sync_support import REPO, s3_client
from test_checkpoint import _Lines, _sidecar
from test_median_stop import THIRD_PARTY

from kubetrain_contract.early_stop import (
    EarlyStopRecord,
    RungReportRecord,
    hyperband_allocation,
    hyperband_bracket,
    hyperband_brackets,
)
from trainer.sync.asha import RungRule, RungStopper
from trainer.sync.errors import parse_s3_uri
from trainer.sync.s3 import S3

ASHA = RungRule("acc", "max")  # min_resource 1, eta 3: rungs at 1, 3, 9, 27 ... reports
LOSS = RungRule("loss", "min")


@pytest.mark.parametrize(
    ("rule", "reports", "rungs"),
    [
        (ASHA, 0, []),
        (ASHA, 1, [1]),
        (ASHA, 8, [1, 3]),
        (ASHA, 30, [1, 3, 9, 27]),
        (RungRule("acc", min_resource=2, reduction_factor=2), 20, [2, 4, 8, 16]),
        # grace: no rung below it is judged
        (RungRule("acc", grace=3), 10, [3, 9]),
        (RungRule("acc", grace=4), 10, [9]),
        # the budget: a trial at its full training has finished, no rung at or above it
        (RungRule("acc", max_resource=9), 30, [1, 3]),
        (RungRule("acc", max_resource=10), 30, [1, 3, 9]),
        # hyperband: bracket b starts at min_resource * eta**b
        (RungRule("acc", bracket=1, brackets=3, name="hyperband"), 30, [3, 9, 27]),
        (RungRule("acc", bracket=2, brackets=3, name="hyperband", max_resource=9), 30, []),
    ],
)
def test_rungs_are_at_min_resource_times_eta_to_the_k(rule, reports, rungs):
    assert rule.rungs(reports) == rungs


# (rule, this trial's values, the competitors' values, judged after, [(rung, rank, of, promoted, cutoff)])
TABLE = [
    # the first trial at a rung always goes on (1 of 1); it reaches rungs 1 and 3 in one look
    (ASHA, [0.2, 0.3, 0.4], [], 0, [(1, 1, 1, True, 0.2), (3, 1, 1, True, 0.4)]),
    # fewer than eta at the rung: only the best so far goes on (Optuna's promotable_idx = 0)
    (ASHA, [0.5], [[0.6]], 0, [(1, 2, 2, False, 0.6)]),
    (ASHA, [0.7], [[0.6]], 0, [(1, 1, 2, True, 0.7)]),
    # a tie with the cut-off goes on
    (ASHA, [0.6], [[0.6]], 0, [(1, 1, 2, True, 0.6)]),
    (ASHA, [0.6], [[0.6], [0.6], [0.1]], 0, [(1, 1, 4, True, 0.6)]),
    # n = 6, eta 3: the top 6 // 3 = 2 go on; rank is 1 + the trials strictly better
    (ASHA, [0.5], [[0.9], [0.8], [0.4], [0.3], [0.2]], 0, [(1, 3, 6, False, 0.8)]),
    (ASHA, [0.85], [[0.9], [0.8], [0.4], [0.3], [0.2]], 0, [(1, 2, 6, True, 0.85)]),
    (ASHA, [0.8], [[0.9], [0.8], [0.4], [0.3], [0.2]], 0, [(1, 2, 6, True, 0.8)]),  # tied at the cut-off
    # promoted at rung 1, stopped at rung 3: ranked there by its value at report 3 only, against the
    # trials that reached report 3 (the two still before it do not count)
    (
        ASHA,
        [0.9, 0.5, 0.55],
        [[0.1, 0.6, 0.7, 0.8], [0.2, 0.7, 0.8], [0.3], [0.4, 0.5]],
        0,
        [(1, 1, 5, True, 0.9), (3, 3, 3, False, 0.8)],
    ),
    # the value at the rung's report, not the best so far nor the latest (a late look)
    (ASHA, [0.9, 0.1, 0.2, 0.95], [[0.5, 0.5, 0.5]], 1, [(3, 2, 2, False, 0.5)]),
    # a rung passed before is not judged again, even when the later competitors beat the trial there
    (ASHA, [0.2, 0.3, 0.9], [[0.9, 0.1, 0.1]] * 5, 1, [(3, 1, 6, True, 0.1)]),
    # asynchronous arrivals: the same trial at rung 1 as competitors arrive there
    (ASHA, [0.5], [], 0, [(1, 1, 1, True, 0.5)]),
    (ASHA, [0.5], [[0.4, 0.4]], 0, [(1, 1, 2, True, 0.5)]),
    (ASHA, [0.5], [[0.4, 0.4], [0.6]], 0, [(1, 2, 3, False, 0.6)]),
    # min objectives: lower is better
    (LOSS, [1.0], [[0.5]], 0, [(1, 2, 2, False, 0.5)]),
    (LOSS, [0.4], [[0.5], [0.9], [1.2], [2.0], [0.6]], 0, [(1, 1, 6, True, 0.5)]),
    (LOSS, [0.55], [[0.5], [0.9], [1.2], [2.0], [0.6]], 0, [(1, 2, 6, True, 0.55)]),
    (LOSS, [0.7], [[0.5], [0.9], [1.2], [2.0], [0.6]], 0, [(1, 3, 6, False, 0.6)]),
    # eta 2: the top half
    (RungRule("acc", reduction_factor=2), [0.5], [[0.9], [0.1], [0.2]], 0, [(1, 2, 4, True, 0.5)]),
    (RungRule("acc", reduction_factor=2), [0.15], [[0.9], [0.1], [0.2]], 0, [(1, 3, 4, False, 0.2)]),
    # grace 2 skips rung 1: the trial is first judged at rung 3
    (RungRule("acc", grace=2), [0.1, 0.1], [[0.9, 0.9, 0.9]], 0, []),
    (RungRule("acc", grace=2), [0.1, 0.1, 0.1], [[0.9, 0.9, 0.9]], 0, [(3, 2, 2, False, 0.9)]),
    # a value that is not a finite number (None as the reports are read; NaN or an infinity handed in
    # as such) is not ranked and does not go on, even alone at the rung (Optuna prunes a NaN there)
    (ASHA, [None], [], 0, [(1, None, 0, False, None)]),
    (ASHA, [None, 0.9, 0.9], [[0.5] * 3], 0, [(1, None, 1, False, 0.5)]),
    (LOSS, [math.inf], [[0.5]], 0, [(1, None, 1, False, 0.5)]),
    (ASHA, [math.nan], [[0.5], [0.4]], 0, [(1, None, 2, False, 0.5)]),
    # a report's position counts: rung 3 is the third report (0.95), not the third number (0.1)
    (ASHA, [0.9, None, 0.95, 0.1], [[0.5] * 4], 0, [(1, 1, 2, True, 0.9), (3, 1, 2, True, 0.95)]),
    (ASHA, [0.9, 0.8, None, 0.95], [[0.5] * 4], 1, [(3, None, 1, False, 0.5)]),
    # a competitor's value that is not a finite number at the rung is not ranked: 3 values, not 4,
    # so only the top 3 // 2 = 1 goes on (counted as the worst, 0.5 would be 2nd of the top 2)
    (RungRule("acc", reduction_factor=2), [0.5], [[None], [0.6], [0.4]], 0, [(1, 2, 3, False, 0.6)]),
    (RungRule("acc", reduction_factor=2), [0.5], [[math.nan], [0.6], [0.4]], 0, [(1, 2, 3, False, 0.6)]),
    # ... and a NaN after the rung's report is no business of the rung
    (ASHA, [0.5], [[0.6, None], [0.4, math.nan]], 0, [(1, 2, 3, False, 0.6)]),
    # a hyperband bracket 1 trial: its first rung is 3
    (RungRule("acc", bracket=1, brackets=2, name="hyperband"), [0.1, 0.1], [[0.9] * 3], 0, []),
    (
        RungRule("acc", bracket=1, brackets=2, name="hyperband"),
        [0.1] * 3,
        [[0.9] * 3],
        0,
        [(3, 2, 2, False, 0.9)],
    ),
]


@pytest.mark.parametrize(("rule", "values", "competitors", "after", "expected"), TABLE)
def test_the_rung_rule_promotes_the_top_one_in_eta(rule, values, competitors, after, expected):
    decisions = rule.judge(values, competitors, after=after)
    got = [(d.rung, d.rank, d.trials, d.promoted, d.cutoff) for d in decisions]
    assert got == [(r, k, n, p, pytest.approx(c)) for r, k, n, p, c in expected]
    # no rung is judged after a stop
    assert all(d.promoted for d in decisions[:-1])


def test_a_stop_is_recorded_with_its_rung_rank_and_cut_off():
    rule = RungRule("acc", "max", min_resource=1, reduction_factor=3, grace=1)
    (decision,) = rule.judge([0.5, 0.52], [[0.9], [0.8], [0.4], [0.3], [0.2]])
    record = rule.record(decision, [0.5, 0.52])
    doc = json.loads(record.to_json())
    assert doc["rule"] == "asha" and doc["rung"] == 1 and doc["rank"] == 3 and doc["rung_trials"] == 6
    assert doc["promoted"] == 2 and doc["cutoff"] == 0.8 and doc["value"] == 0.5
    assert doc["step"] == 2 and doc["best"] == 0.52 and doc["start_step"] == 1
    assert doc["reduction_factor"] == 3 and doc["min_resource"] == 1 and doc["bracket"] is None
    assert doc["median"] is None and doc["min_trials"] is None
    assert EarlyStopRecord.from_json(record.to_json()) == record


def test_a_stop_on_a_value_that_is_not_a_finite_number_is_recorded_unranked():
    rule = RungRule("acc", "max")
    (decision,) = rule.judge([None, None], [])
    assert (decision.rung, decision.value, decision.rank, decision.promoted) == (1, None, None, False)
    record = rule.record(decision, [None, None])
    doc = json.loads(record.to_json())  # JSON without NaN
    assert (doc["rung"], doc["value"], doc["rank"], doc["rung_trials"], doc["promoted"], doc["cutoff"]) == (
        1,
        None,
        None,
        None,
        None,
        None,
    )
    assert doc["best"] is None and doc["step"] == 2
    assert EarlyStopRecord.from_json(record.to_json()) == record
    # with others ranked there: how many, how many go on, and the cut-off; its best is its best usable value
    (decision,) = rule.judge([0.9, 0.9, None], [[0.5] * 3, [0.4] * 3], after=1)
    doc = json.loads(rule.record(decision, [0.9, 0.9, None]).to_json())
    assert (doc["rung"], doc["rank"], doc["rung_trials"], doc["promoted"], doc["cutoff"], doc["best"]) == (
        3,
        None,
        2,
        1,
        0.5,
        0.9,
    )


def test_an_early_stop_record_of_the_median_rule_written_before_the_rung_fields_still_reads():
    old = {
        "kind": "kubetrain/early-stop",
        "format_version": 1,
        "rule": "median",
        "objective": "val_accuracy",
        "mode": "max",
        "start_step": 4,
        "min_trials": 3,
        "step": 5,
        "best": 0.4,
        "median": 0.6,
        "finished_trials": 3,
        "decided_at": "2026-01-02T03:04:05.000000Z",
    }
    record = EarlyStopRecord.from_json(json.dumps(old))
    assert record.median == 0.6 and record.rung is None and record.rank is None


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"min_resource": 0}, "min_resource 0 is not valid: expected an integer >= 1"),
        ({"reduction_factor": 1}, "reduction_factor 1 is not valid: expected an integer >= 2"),
        ({"grace": 0}, "grace 0 is not valid"),
        ({"max_resource": 0}, "max_resource 0 is not valid"),
        ({"mode": "up"}, "objective mode 'up' is not valid"),
        ({"bracket": 3, "brackets": 3, "name": "hyperband"}, "bracket 3 is not valid"),
        ({"name": "median"}, "rule 'median' is not a rung rule"),
    ],
)
def test_bad_settings_are_refused_naming_the_value(settings, message):
    with pytest.raises(ValueError, match=message):
        RungRule("acc", **settings)


def test_hyperband_brackets_follow_optunas_allocation_interleaved():
    # Optuna: bracket b gets ceil(B * eta**s / (s + 1)), s = B - 1 - b
    assert hyperband_allocation(3, 3) == [9, 5, 3]
    assert hyperband_allocation(1, 3) == [1]
    brackets = [hyperband_bracket(n, 3, 3) for n in range(17)]
    assert brackets[:4] == [0, 1, 0, 2]  # the first trials already spread over the brackets
    assert [brackets.count(b) for b in range(3)] == [9, 5, 3]  # each cycle of 17 in those proportions
    assert [hyperband_bracket(n, 3, 3) for n in range(17, 34)] == brackets  # deterministic, by number
    assert {hyperband_bracket(n, 1, 3) for n in range(10)} == {0}  # asha: one bracket
    # as many brackets as the budget allows: floor(log_eta(max / min)) + 1
    assert [hyperband_brackets(1, m, 3) for m in (1, 2, 3, 8, 9, 26, 27)] == [1, 1, 2, 2, 3, 3, 4]
    assert hyperband_brackets(2, 18, 3) == 3 and hyperband_brackets(1, None, 3) == 3
    with pytest.raises(ValueError, match="trial number -1"):
        hyperband_bracket(-1, 3, 3)


# -- the stopper against S3 -------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3(s3_server):
    return s3_client(s3_server)


def _sweep(s3, curves: dict[int, list[float]], reports: dict[int, tuple[int, list[float]]]) -> str:
    """A sweep prefix with trial records (``curves``: number -> values) and rung reports
    (``reports``: number -> (bracket, values)) as the Airflow side and the sidecars write them."""
    sweep = f"runs/unit_asha/{secrets.token_hex(5)}"
    for number, curve in curves.items():
        record = {
            "kind": "kubetrain/sweep-trial",
            "number": number,
            "status": "success",
            "stopped_early": False,
            "history": [{"step": i + 1, "score": v} for i, v in enumerate(curve)],
        }
        s3.put_object(
            Bucket="training", Key=f"{sweep}/sweep/trials/{number}.json", Body=json.dumps(record).encode()
        )
    for number, (bracket, values) in reports.items():
        body = RungReportRecord(trial=number, bracket=bracket, objective="score", values=values).to_json()
        s3.put_object(Bucket="training", Key=f"{sweep}/sweep/rungs/{number}.json", Body=body.encode())
    return sweep


def _stopper(
    s3_server, monkeypatch, sweep: str, tmp_path: Path, rule: RungRule, trial: int = 5
) -> RungStopper:
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    (tmp_path / "out").mkdir(exist_ok=True)
    (tmp_path / "ck").mkdir(exist_ok=True)
    return RungStopper(
        S3(),
        rule,
        trial=trial,
        run=parse_s3_uri(f"s3://training/{sweep}/trials/{trial}"),
        trials=parse_s3_uri(f"s3://training/{sweep}/sweep/trials/"),
        rungs=parse_s3_uri(f"s3://training/{sweep}/sweep/rungs/"),
        output_dir=tmp_path / "out",
        stop_file=tmp_path / "ck" / ".kubetrain-stop",
    )


def _report(tmp_path: Path, values: list[float]) -> None:
    lines = "".join(json.dumps({"step": i + 1, "score": v}) + "\n" for i, v in enumerate(values))
    (tmp_path / "out" / "metrics.jsonl").write_text(lines)


def test_the_stopper_ranks_against_running_and_finished_trials_and_publishes_its_reports(
    s3_server, s3, tmp_path, monkeypatch
):
    # trial 0 finished (record), trials 1 and 2 still running (rung reports); trial 3's report is of
    # another bracket and does not count
    sweep = _sweep(
        s3,
        {0: [0.9, 0.9, 0.9]},
        {1: (0, [0.8, 0.85, 0.9]), 2: (0, [0.3]), 3: (1, [0.99, 0.99, 0.99])},
    )
    stopper = _stopper(s3_server, monkeypatch, sweep, tmp_path, RungRule("score", "max"))
    _report(tmp_path, [0.5])
    # rung 1: 0.9, 0.8, 0.3 and 0.5: the top 4 // 3 = 1 goes on; 0.5 ranks 3
    decision = stopper.check()
    assert decision is not None and (decision.rung, decision.rank, decision.trials) == (1, 3, 4)
    assert (tmp_path / "ck" / ".kubetrain-stop").exists()
    doc = json.loads(
        s3.get_object(Bucket="training", Key=f"{sweep}/trials/5/sync/early-stop.json")["Body"].read()
    )
    assert doc["rule"] == "asha" and doc["rung"] == 1 and doc["cutoff"] == 0.9 and doc["rank"] == 3
    # its own reports were published before the decision, for the other trials' sidecars
    own = RungReportRecord.from_json(
        s3.get_object(Bucket="training", Key=f"{sweep}/sweep/rungs/5.json")["Body"].read()
    )
    assert (own.trial, own.bracket, own.values, own.promoted_at) == (5, 0, [0.5], 0)
    assert stopper.check() is decision  # once taken, the decision stands


def test_a_trial_whose_report_is_not_a_number_at_its_rung_is_stopped_and_publishes_null(
    s3_server, s3, tmp_path, monkeypatch
):
    # trial 1's rung report has no finite value at report 1 (null): it is not ranked there
    sweep = _sweep(s3, {0: [0.5] * 4}, {1: (0, [None, 0.9])})
    stopper = _stopper(s3_server, monkeypatch, sweep, tmp_path, RungRule("score", "max"))
    _report(tmp_path, [0.9, math.nan])
    assert stopper.check() is None and stopper.judged == 1  # rung 1: 0.9 first of 2
    _report(tmp_path, [0.9, math.nan, "n/a"])
    decision = stopper.check()
    assert decision is not None and (decision.rung, decision.value, decision.rank) == (3, None, None)
    assert (tmp_path / "ck" / ".kubetrain-stop").exists()
    own = RungReportRecord.from_json(
        s3.get_object(Bucket="training", Key=f"{sweep}/sweep/rungs/5.json")["Body"].read()
    )
    assert own.values == [0.9, None, None]  # positions kept, JSON without NaN
    doc = json.loads(
        s3.get_object(Bucket="training", Key=f"{sweep}/trials/5/sync/early-stop.json")["Body"].read()
    )
    assert (doc["rung"], doc["value"], doc["rank"], doc["best"], doc["step"]) == (3, None, None, 0.9, 3)
    assert (doc["rung_trials"], doc["cutoff"]) == (1, 0.5)  # trial 0's record; trial 1 never reached 3


def test_a_promoted_trial_resumes_at_its_rung_after_a_restart(s3_server, s3, tmp_path, monkeypatch):
    sweep = _sweep(s3, {}, {})
    rule = RungRule("score", "max")
    first = _stopper(s3_server, monkeypatch, sweep, tmp_path, rule)
    _report(tmp_path, [0.5, 0.5, 0.5])
    assert first.check() is None and first.judged == 3  # alone at rungs 1 and 3: promoted
    # better trials reach rung 1 afterwards; a restarted sidecar does not judge the trial there again
    for number in (1, 2, 3):
        body = RungReportRecord(trial=number, bracket=0, objective="score", values=[0.9]).to_json()
        s3.put_object(Bucket="training", Key=f"{sweep}/sweep/rungs/{number}.json", Body=body.encode())
    again = _stopper(s3_server, monkeypatch, sweep, tmp_path, rule)
    _report(tmp_path, [0.5, 0.5, 0.5, 0.6])
    assert again.check() is None and again.judged == 3
    assert not (tmp_path / "ck" / ".kubetrain-stop").exists()


def test_hyperband_compares_only_within_the_trials_bracket(s3_server, s3, tmp_path, monkeypatch):
    # trial 1 is in bracket 1 of 3 (eta 3): its first rung is 3. Its competitors there: the records and
    # reports of bracket 1 trials only (numbers 5 and 9 are bracket 1; 0 and 2 are bracket 0)
    assert [hyperband_bracket(n, 3, 3) for n in (0, 1, 2, 5, 9)] == [0, 1, 0, 1, 1]
    sweep = _sweep(s3, {0: [0.99] * 3, 5: [0.2, 0.3, 0.4]}, {2: (0, [0.99] * 3), 9: (1, [0.1, 0.2, 0.3])})
    rule = RungRule("score", "max", bracket=1, brackets=3, name="hyperband")
    stopper = _stopper(s3_server, monkeypatch, sweep, tmp_path, rule, trial=1)
    _report(tmp_path, [0.3, 0.35])
    assert stopper.check() is None  # before its first rung
    _report(tmp_path, [0.3, 0.35, 0.45])
    assert stopper.check() is None and stopper.judged == 3  # 0.45 beats 0.4 and 0.3 at rung 3


def test_a_third_party_trainer_outside_the_top_is_stopped_at_its_rung(s3_server, s3, tmp_path):
    sweep = _sweep(s3, {0: [0.9] * 4, 1: [0.8] * 4}, {2: (0, [0.7] * 3)})
    ck, out = tmp_path / "ck", tmp_path / "out"
    ck.mkdir()
    out.mkdir()
    stop = ck / ".kubetrain-stop"
    env = {
        **s3_server.env(),
        "KUBETRAIN_EARLY_STOPPING": "asha",
        "KUBETRAIN_OBJECTIVE": "score",
        "KUBETRAIN_OBJECTIVE_MODE": "max",
        "KUBETRAIN_ASHA_MIN_RESOURCE": "3",
        "KUBETRAIN_ASHA_REDUCTION_FACTOR": "3",
        "KUBETRAIN_SWEEP_TRIALS_URI": f"s3://training/{sweep}/sweep/trials/",
        "KUBETRAIN_SWEEP_RUNGS_URI": f"s3://training/{sweep}/sweep/rungs/",
        "KUBETRAIN_SWEEP_TRIAL": "3",
        "KUBETRAIN_STOP_FILE": str(stop),
    }
    sidecar = _sidecar(
        env, f"s3://training/{sweep}/trials/3", ck, out, "--interval", "0.5", "--quiet", "0", "--grace", "30"
    )
    lines = _Lines(sidecar)
    try:
        lines.wait("asha stopping of score")
        trainer = subprocess.run(
            [sys.executable, "-c", THIRD_PARTY, "0.3", "40"],
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
    assert trainer.returncode == 79, (trainer.stdout, lines.text())
    step = int(trainer.stdout.split("stop file seen before step ")[1].split()[0])
    doc = json.loads(
        s3.get_object(Bucket="training", Key=f"{sweep}/trials/3/sync/early-stop.json")["Body"].read()
    )
    # rung 3: 0.9, 0.8, 0.7 and 0.3: the top 1 goes on
    assert (doc["rule"], doc["rung"], doc["rank"], doc["rung_trials"], doc["cutoff"]) == (
        "asha",
        3,
        4,
        4,
        0.9,
    )
    assert 3 <= doc["step"] < step <= doc["step"] + 6 < 40, (doc, trainer.stdout)
