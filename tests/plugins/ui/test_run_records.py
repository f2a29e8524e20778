"""Run records: the record, the index names, the reasons, and what the run repository writes and replaces."""

from __future__ import annotations

import json
import math
import random
from datetime import UTC, datetime, timedelta

import airflow  # noqa: F401  (importing Airflow puts its plugins folder on sys.path)
import pytest
from training_records import T0, make_record

from kubetrain.run_record import RunFacts, build_record, promotion_reason
from kubetrain.s3_layout import S3Layout
from kubetrain.store.index import (
    IndexEntry,
    LeaderboardEntry,
    index_name,
    inverted_time,
    leaderboard_name,
    promotion_name,
    record_keys,
    sortable_value,
    time_of_inverted,
    value_of_sortable,
)
from kubetrain_contract.records import RecordError
from kubetrain_contract.run import RunRecord


@pytest.mark.parametrize("mode", ["max", "min"])
def test_sortable_values_sort_best_first(mode):
    rng = random.Random(7)
    values = [0.0, -0.0, 1.0, -1.0, 1e-300, -1e-300, 1e300, -1e300, 0.5, 0.25] + [
        rng.uniform(-5, 5) for _ in range(200)
    ]
    ordered = sorted(values, key=lambda v: sortable_value(v, mode))
    assert ordered == sorted(values, reverse=(mode == "max"))
    for value in values:
        assert value_of_sortable(sortable_value(value, mode), mode) == value
    with pytest.raises(ValueError, match="metric value nan cannot be ranked"):
        sortable_value(math.nan, mode)
    with pytest.raises(ValueError, match="monitor mode 'up' is not valid"):
        sortable_value(1.0, "up")


def test_inverted_times_sort_newest_first_and_round_trip():
    times = [T0 + timedelta(milliseconds=m) for m in (0, 1, 1000, 86_400_000 * 400)]
    stamps = [inverted_time(t) for t in times]
    assert sorted(stamps) == stamps[::-1]
    assert [time_of_inverted(s) for s in stamps] == times
    with pytest.raises(ValueError, match="outside what a run index can hold"):
        inverted_time(datetime(1960, 1, 1, tzinfo=UTC))


def test_index_names_carry_the_filters_and_parse_back():
    record = RunRecord.from_dict(
        make_record(run_id="scheduled__2026-03-02T08:00:00+00:00", trial="3", version="00000000000000ff")
    )
    entry = IndexEntry.parse("index/_all/" + index_name(record))
    assert entry.model == "digits" and entry.dag == "train_image_classifier" and entry.trial == "3"
    assert entry.dataset_version == "00000000000000ff" and entry.status == "success" and entry.run_time == T0
    assert "~" not in entry.run and ":" not in entry.run  # the run id made S3-safe
    board = LeaderboardEntry.parse("x/" + leaderboard_name(record), "max")
    assert board.value == 0.9 and board.run == entry.run
    keys = record_keys(S3Layout(), record)
    assert keys[0].endswith("/trials/3/run-record.json")
    assert keys[1].startswith("index/digits/") and keys[2].startswith("index/_all/")
    assert keys[3].startswith("leaderboard/digits/val_accuracy/")


def test_a_failed_run_is_indexed_but_not_ranked():
    record = RunRecord.from_dict(make_record(run_id="manual__f", status="failed", value=None))
    assert record.to_dict()["failure"] == {"task": "train", "error": "PodFailed: OOMKilled"}
    assert record.promotion.reason == "not promoted: the run failed in train"
    assert leaderboard_name(record) is None and len(record_keys(S3Layout(), record)) == 3


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"rule": "never", "promoted": False}, "not promoted: promote=never"),
        (
            {"rule": "always", "promoted": True, "other_version": "v1"},
            "promoted: promote=always, replacing version v1",
        ),
        (
            {"rule": "if_better", "promoted": True},
            "promoted: promote=if_better and no version was promoted before",
        ),
        (
            {
                "rule": "if_better",
                "promoted": True,
                "monitor": "val_accuracy",
                "mode": "max",
                "value": 0.95,
                "other_version": "v1",
                "other_value": 0.9,
            },
            "promoted: promote=if_better, val_accuracy 0.95 > 0.9 of version v1",
        ),
        (
            {
                "rule": "if_better",
                "promoted": False,
                "monitor": "val_accuracy",
                "mode": "max",
                "value": 0.85,
                "other_version": "20260302T080000Z-1a2b3c4d",
                "other_value": 0.93,
            },
            "not promoted: promote=if_better, lost to version 20260302T080000Z-1a2b3c4d (val_accuracy 0.93; this run 0.85)",
        ),
        (
            {
                "rule": "if_better",
                "promoted": False,
                "monitor": "val_loss",
                "mode": "min",
                "other_version": "v2",
                "other_value": 0.2,
            },
            "not promoted: promote=if_better and this run has no val_loss to compare with version v2",
        ),
    ],
)
def test_promotion_reasons(kwargs, expected):
    assert promotion_reason(**kwargs) == expected


def test_records_are_read_and_refused_through_the_record():
    record = make_record(run_id="manual__s")
    assert RunRecord.from_dict(json.loads(json.dumps(record))).to_dict() == record
    with pytest.raises(RecordError, match="field 'status' is 'done', expected one of 'success', 'failed'"):
        RunRecord.from_dict({**record, "status": "done"})
    with pytest.raises(RecordError, match=r"field 'dataset.version' is 'latest', expected a string matching"):
        RunRecord.from_dict({**record, "dataset": {**record["dataset"], "version": "latest"}})
    with pytest.raises(RecordError, match="field 'promotion.reason' is missing"):
        RunRecord.from_dict(
            {**record, "promotion": {k: v for k, v in record["promotion"].items() if k != "reason"}}
        )
    with pytest.raises(RecordError, match="field 'run_time' is 'yesterday', expected an ISO 8601 date-time"):
        RunRecord.from_dict({**record, "run_time": "yesterday"})
    with pytest.raises(ValueError, match="promote='sometimes' is not valid"):
        RunFacts(
            dag_id="d",
            run_id="r",
            run=S3Layout().run("d", "r"),
            run_time=T0,
            model="m",
            promote_rule="sometimes",
        )
    with pytest.raises(ValueError, match="model name 'Bad Model' is not valid"):
        RunFacts(dag_id="d", run_id="r", run=S3Layout().run("d", "r"), run_time=T0, model="Bad Model")


def test_the_generated_schema_accepts_what_the_record_writes_and_refuses_what_it_refuses():
    import jsonschema

    validator = jsonschema.Draft202012Validator(RunRecord.json_schema())
    record = make_record(run_id="manual__schema", trial="2", sweep={"id": "s/r", "trial": "2"})
    validator.validate(record)
    for bad in (
        {"status": "done"},
        {"dataset": {**record["dataset"], "version": "latest"}},
        {"image": {**record["image"], "digest": "md5:x"}},
        {"epochs": -1},
        {"metrics": {**record["metrics"], "value": "0.9"}},
    ):
        assert not validator.is_valid(record | bad), bad


def test_nan_and_infinite_metrics_become_null():
    record = build_record(
        RunFacts(
            dag_id="d",
            run_id="r",
            run=S3Layout().run("d", "r"),
            run_time=T0,
            model="m",
            metrics={
                "monitor": "val_loss",
                "monitor_mode": "min",
                "final": {"val_loss": math.nan, "loss": math.inf},
            },
        )
    )
    assert record.metrics.final == {"val_loss": None, "loss": None} and record.metrics.value is None
    assert leaderboard_name(record) is None
    json.loads(record.to_json())  # strict JSON: no NaN left


def test_rewriting_a_run_replaces_its_index_entries(store, client):
    failed = make_record(
        run_id="manual__rewrite", model="rewrite-m", status="failed", value=None, version="0000000000000009"
    )
    store.runs.write(failed)
    succeeded = make_record(
        run_id="manual__rewrite", model="rewrite-m", value=0.93, version="0000000000000009"
    )
    uri = store.runs.write(succeeded)
    again = make_record(run_id="manual__rewrite", model="rewrite-m", value=0.97, version="0000000000000009")
    store.runs.write(again)

    def listed(prefix):
        return [
            o["Key"] for o in client.list_objects_v2(Bucket="training", Prefix=prefix).get("Contents", [])
        ]

    assert uri == "s3://training/runs/train_image_classifier/manual__rewrite/run-record.json"
    (entry,) = listed("index/rewrite-m/")
    assert entry.endswith("~success.json")
    assert len([k for k in listed("index/_all/") if "~rewrite-m~" in k]) == 1
    (board,) = listed("leaderboard/rewrite-m/val_accuracy/")
    assert LeaderboardEntry.parse(board, "max").value == 0.97
    stored = json.loads(client.get_object(Bucket="training", Key=entry)["Body"].read())
    assert stored == json.loads(
        client.get_object(Bucket="training", Key=uri[len("s3://training/") :])["Body"].read()
    )
    assert stored["metrics"]["value"] == 0.97


def test_a_record_outside_the_training_bucket_is_refused(store):
    record = make_record(run_id="manual__b")
    record["run_uri"] = "s3://elsewhere/runs/train_image_classifier/manual__b"
    with pytest.raises(ValueError, match="is not in the training bucket training"):
        store.runs.write(record)


def _pass(client, run, number, pod, steps):
    files = [
        {
            "area": "checkpoints",
            "path": f"ckpt-{s}.index",
            "key": run.key("checkpoints", f"ckpt-{s}.index"),
            "size": 1,
            "sha256": "0" * 64,
        }
        for s in steps
    ]
    document = {
        "kind": "kubetrain/sync-pass",
        "format_version": 1,
        "pass": number,
        "final": False,
        "complete": True,
        "started_at": "x",
        "finished_at": "x",
        "pod": pod,
        "files": files,
        "errors": [],
    }
    client.put_object(Bucket=run.bucket, Key=run.pass_key(number), Body=json.dumps(document).encode())


def test_resumed_from_step_is_found_in_the_sync_passes(store, client):
    """For containers that do not say so: the last pod's first pass, and the checkpoint the pod before it left."""
    fresh = S3Layout().run("third_party", "manual__fresh")
    for number in range(1, 6):
        _pass(client, fresh, number, "pod-a", [number * 10])
    assert store.passes.resumed_from_step(fresh) == 0

    resumed = S3Layout().run("third_party", "manual__resumed")
    for number in range(1, 40):
        _pass(client, resumed, number, "pod-a" if number < 23 else "pod-b", [number * 10, number * 10 - 5])
    _pass(
        client, resumed, 40, "airflow:third_party/promote", [390]
    )  # the promote step's rewrite after pruning
    assert store.passes.resumed_from_step(resumed) == 220
    assert store.passes.resumed_from_step(S3Layout().run("third_party", "manual__none")) is None


def test_two_promotions_within_one_second_sort_newest_first():
    # promoted_at has whole seconds; the entry's name orders by the time it is written (ms)
    written = datetime(2026, 3, 2, 8, 12, 0, 200_000, tzinfo=UTC)
    names = [
        promotion_name("20260303T000000Z-bbbbbbbb", written),
        promotion_name("20260302T000000Z-aaaaaaaa", written + timedelta(milliseconds=250)),
    ]
    assert sorted(names) == names[::-1]
    assert names[1].endswith("20260302T000000Z-aaaaaaaa.json")
