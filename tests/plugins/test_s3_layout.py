"""The S3 layout: keys, run prefixes, safe segments and bucket settings."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace

import airflow  # noqa: F401  (importing Airflow puts its plugins folder on sys.path)
import pytest

from kubetrain.s3_layout import (
    RunLocation,
    S3Layout,
    model_version,
    run_from_context,
    safe_segment,
)
from kubetrain_contract.s3uri import parse_s3_uri


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("scheduled__2026-11-22", "scheduled__2026-11-22"),
        ("manual__2026-11-22T04:00:00+00:00", "manual__2026-11-22T04_00_00_00_00-"),
        ("a b/c", "a_b_c-"),
        ("..", "..-"),
    ],
)
def test_safe_segment(value, expected):
    segment = safe_segment(value)
    assert segment.startswith(expected)
    assert all(c.isalnum() or c in "._-" for c in segment)
    if segment != value:
        assert len(segment) == len(expected) + 8  # the hash suffix keeps distinct ids distinct


def test_safe_segments_of_similar_ids_differ():
    assert safe_segment("run:1") != safe_segment("run_1")
    assert safe_segment("run:1") != safe_segment("run+1")


@pytest.mark.parametrize("bad", ["", "   ", None])
def test_safe_segment_refuses_empty(bad):
    with pytest.raises(ValueError, match="non-empty"):
        safe_segment(bad)


def test_keys_of_the_layout():
    layout = S3Layout("datasets", "training")
    assert layout.dataset_uri("digits") == "s3://datasets/digits/"
    assert (
        layout.manifest_uri("digits", "3f2a9c0d1e4b5a69")
        == "s3://training/manifests/digits/3f2a9c0d1e4b5a69.json"
    )
    run = layout.run("train_digits", "manual__2026-11-22T04:00:00+00:00")
    assert run.uri.startswith("s3://training/runs/train_digits/manual__2026-11-22T04_00_00_00_00-")
    assert not run.uri.endswith("/")
    assert run.key("checkpoints", "ckpt-1.index") == f"{run.prefix}/checkpoints/ckpt-1.index"
    assert run.pass_key(12) == f"{run.prefix}/sync/pass-00000012.json"
    assert RunLocation.pass_number(run.pass_key(12)) == 12
    assert RunLocation.pass_number(f"{run.prefix}/sync/notes.json") is None
    assert layout.run("d", "r", trial="3").prefix == "runs/d/r/trials/3"
    assert (
        layout.model_prefix("digits-cnn", "20261122T040000Z-ab12cd34")
        == "models/digits-cnn/20261122T040000Z-ab12cd34/"
    )
    assert layout.model_latest_key("digits-cnn") == "models/digits-cnn/latest"


def test_run_location_round_trips_its_uri():
    run = S3Layout().run("dag", "manual__x")
    assert RunLocation.from_uri(run.uri) == run
    assert RunLocation.from_uri(run.uri + "/") == run


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda layout: layout.manifest_key("Digits", "3f2a9c0d1e4b5a69"), "dataset name 'Digits'"),
        (lambda layout: layout.manifest_key("digits", "xyz"), "dataset version 'xyz'"),
        (lambda layout: layout.model_latest_key("../x"), "model name '../x'"),
        (lambda layout: layout.run("d", "r").key("output", "../secret"), "not a plain relative path"),
        (lambda layout: layout.run("d", "r").area_prefix("logs"), "unknown run area 'logs'"),
        (lambda layout: layout.run("d", "r").pass_key(-1), "sync pass number -1"),
        (lambda layout: S3Layout("Bad_Bucket", "training"), "bucket name 'Bad_Bucket'"),
        (lambda layout: parse_s3_uri("https://x/y"), "'https://x/y' is not an S3 URI"),
    ],
)
def test_bad_values_are_named(call, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        call(S3Layout())


def test_buckets_from_variable_then_env_then_default(monkeypatch):
    monkeypatch.delenv("KUBETRAIN_TRAINING_BUCKET", raising=False)
    monkeypatch.delenv("AIRFLOW_VAR_KUBETRAIN_TRAINING_BUCKET", raising=False)
    assert S3Layout.from_environment().training_bucket == "training"
    monkeypatch.setenv("KUBETRAIN_TRAINING_BUCKET", "env-bucket")
    assert S3Layout.from_environment().training_bucket == "env-bucket"
    monkeypatch.setenv("AIRFLOW_VAR_KUBETRAIN_TRAINING_BUCKET", "var-bucket")
    assert S3Layout.from_environment().training_bucket == "var-bucket"
    assert S3Layout.from_environment(training_bucket="explicit").training_bucket == "explicit"


def test_run_from_context_is_stable_across_tries_and_separates_mapped_tasks(monkeypatch):
    monkeypatch.delenv("KUBETRAIN_TRAINING_BUCKET", raising=False)
    monkeypatch.delenv("AIRFLOW_VAR_KUBETRAIN_TRAINING_BUCKET", raising=False)

    def context(try_number, map_index=-1):
        ti = SimpleNamespace(
            dag_id="train_digits", task_id="train", try_number=try_number, map_index=map_index
        )
        return {"ti": ti, "run_id": "scheduled__2026-11-22"}

    first, retry = run_from_context(context(1)), run_from_context(context(2))
    assert first == retry
    assert first.uri == "s3://training/runs/train_digits/scheduled__2026-11-22"
    assert run_from_context(context(1, map_index=4)).uri == first.uri + "/trials/4"
    assert run_from_context(context(1), run_uri="s3://other/runs/x/y").uri == "s3://other/runs/x/y"


def test_model_version_is_sortable_and_stable():
    run = S3Layout().run("d", "r")
    when = datetime(2026, 11, 22, 4, 0, 0, tzinfo=UTC)
    assert model_version(run, when) == model_version(run, when)
    assert model_version(run, when).startswith("20261122T040000Z-")
    assert model_version(run, when) != model_version(S3Layout().run("d", "r2"), when)
