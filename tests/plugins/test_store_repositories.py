"""The run store's repositories against the S3 test server: each one's document type and keys."""

from __future__ import annotations

import hashlib
import json
import uuid

import pytest

from kubetrain.run_record import promotion_event
from kubetrain.s3_layout import S3Layout
from kubetrain.store.models import MAX_COPY_BYTES
from kubetrain.store.passes import SyncPass, SyncVerificationError
from kubetrain_contract.manifests import SyncPassRecord


def test_train_once_markers(store):
    fp = uuid.uuid4().hex[:24]
    assert store.markers.get("train_x", fp) is None
    uri = store.markers.write("train_x", fp, {"run_id": "manual__1"})
    assert uri == store.markers.uri("train_x", fp) == f"s3://training/trained/train_x/{fp}.json"
    assert store.markers.get("train_x", fp) == {"run_id": "manual__1"}


def test_promoted_metrics_and_pointer(store):
    model = f"m-{uuid.uuid4().hex[:8]}"
    assert store.models.promoted_metrics(model) == (None, None) and store.models.pointer(model) is None
    layout = S3Layout()
    store.write_json("training", layout.model_latest_key(model), {"version": "v1"})
    assert store.models.promoted_metrics(model) == ("v1", {})  # promoted without metrics.json
    assert store.models.pointer(model) == {"version": "v1"}
    store.write_json("training", layout.model_prefix(model, "v1") + "metrics.json", {"monitor": "loss"})
    assert store.models.promoted_metrics(model) == ("v1", {"monitor": "loss"})
    store.write("training", layout.model_latest_key(model), json.dumps({"kind": "x"}))
    with pytest.raises(ValueError, match="names no version"):
        store.models.promoted_metrics(model)


def _pass(run, files, number=1):
    return SyncPassRecord.from_dict(
        {
            "kind": "kubetrain/sync-pass",
            "format_version": 1,
            "pass": number,
            "final": True,
            "complete": True,
            "started_at": "2026-03-02T08:00:00Z",
            "finished_at": "2026-03-02T08:00:01Z",
            "pod": "train-abc",
            "files": files,
            "errors": [],
        }
    )


def _file(run, area, path, body=b"x", size=None):
    return {
        "area": area,
        "path": path,
        "key": run.key(area, path),
        "size": len(body) if size is None else size,
        "sha256": hashlib.sha256(body).hexdigest(),
    }


def test_promotion_refuses_files_cloud_copy_cannot_take_before_copying(store):
    run = S3Layout().run("train_x", f"manual__{uuid.uuid4().hex[:6]}")
    huge = _file(run, "output", "model.bin", size=MAX_COPY_BYTES + 1)
    with pytest.raises(
        ValueError, match=r"CopyObject copies objects up to 5 GiB, and model.bin \(5368709121 bytes\)"
    ):
        store.models.promote(
            run, model="m", version="v1", sync_pass=SyncPass(1, "s3://x", _pass(run, [huge]))
        )
    assert list(store.list("training", S3Layout().model_prefix("m", "v1"))) == []


def test_promotion_copies_the_output_and_writes_the_pointer_last(store):
    run = S3Layout().run("train_x", f"manual__{uuid.uuid4().hex[:6]}")
    model = f"m-{uuid.uuid4().hex[:8]}"
    files = [_file(run, "output", "model.keras", b"keras"), _file(run, "checkpoints", "ckpt-1.index", b"i")]
    for entry, body in zip(files, (b"keras", b"i"), strict=True):
        store.write("training", entry["key"], body)
    pointer = store.models.promote(
        run, model=model, version="v1", sync_pass=SyncPass(4, "s3://x", _pass(run, files))
    )
    assert pointer["files"] == ["model.keras"] and pointer["sync_pass"] == 4 and pointer["run_uri"] == run.uri
    assert store.read("training", S3Layout().model_prefix(model, "v1") + "model.keras") == b"keras"
    assert store.models.pointer(model) == pointer


def test_the_newest_pass_is_read_through_the_record(store, client):
    run = S3Layout().run("train_x", f"manual__{uuid.uuid4().hex[:6]}")
    assert store.passes.newest(run) is None
    entry = _file(run, "output", "metrics.json", b"{}")
    store.write("training", entry["key"], b"{}")
    store.write("training", run.pass_key(1), _pass(run, [entry], 1).to_json())
    store.write("training", run.pass_key(2), _pass(run, [entry], 2).to_json())
    found = store.passes.final(run)
    assert found.number == 2 and found.files == [entry] and found.uri.endswith("pass-00000002.json")
    client.put_object(Bucket="training", Key=run.pass_key(3), Body=json.dumps({"kind": "other"}).encode())
    with pytest.raises(SyncVerificationError, match="unknown kind 'other', expected 'kubetrain/sync-pass'"):
        store.passes.newest(run)
    bad = _pass(run, [entry], 4).to_dict()
    bad["files"][0]["sha256"] = "not a digest"
    client.put_object(Bucket="training", Key=run.pass_key(4), Body=json.dumps(bad).encode())
    with pytest.raises(
        SyncVerificationError, match=r"pass-00000004\.json: files\[0\]: sha256 'not a digest' is not 64"
    ):
        store.passes.newest(run)


def test_the_promote_step_records_a_pass_after_pruning(store):
    run = S3Layout().run("train_x", f"manual__{uuid.uuid4().hex[:6]}")
    entry = _file(run, "output", "metrics.json", b"{}")
    previous = SyncPass(3, "s3://x", _pass(run, [entry, _file(run, "checkpoints", "ckpt-1.index")], 3))
    recorded = store.passes.record(run, previous, [entry], writer="airflow:train_x/promote")
    assert recorded.number == 4 and recorded.uri == f"s3://training/{run.pass_key(4)}"
    assert store.passes.newest(run).record == recorded.record
    assert recorded.record.pod == "airflow:train_x/promote" and recorded.files == [entry]


def test_promotion_history_newest_first(store):
    model = f"m-{uuid.uuid4().hex[:8]}"
    facts = {
        "model": model,
        "dag_id": "train_x",
        "run_id": "manual__1",
        "trial": None,
        "run_uri": "s3://training/runs/train_x/manual__1",
        "rule": "always",
        "reason": "promoted: promote=always",
        "monitor": "val_accuracy",
        "value": 0.9,
        "previous_version": None,
        "previous_value": None,
    }
    for version in ("v1", "v2"):
        event = promotion_event(
            version=version, model_uri=f"s3://training/models/{model}/{version}/", **facts
        )
        uri = store.promotions.record(event)
        assert uri.startswith(f"s3://training/promotions/{model}/") and uri.endswith(f"~{version}.json")
    history = store.promotions.newest(model)
    assert [p["version"] for p in history] == ["v2", "v1"] and history[0]["kind"] == "kubetrain/promotion"
    assert history[0] == event.to_dict()
    assert store.promotions.has(model, "v1") and not store.promotions.has(model, "v3")
    with pytest.raises(ValueError, match="promote='never' does not promote"):
        promotion_event(version="v3", model_uri="s3://training/models/m/v3/", **(facts | {"rule": "never"}))


def test_reports_keep_their_content_type(store, client):
    run = S3Layout().run("train_x", f"manual__{uuid.uuid4().hex[:6]}")
    uri = store.reports.write(
        run, {"report.html": b"<p>", "report.md": b"#", "loss.png": b"png", "x.bin": b""}
    )
    assert uri == f"s3://training/{run.key('report', 'report.html')}"
    types = {
        name: client.head_object(Bucket="training", Key=run.key("report", name))["ContentType"]
        for name in ("report.html", "report.md", "loss.png", "x.bin")
    }
    assert types == {
        "report.html": "text/html; charset=utf-8",
        "report.md": "text/markdown; charset=utf-8",
        "loss.png": "image/png",
        "x.bin": "application/octet-stream",
    }


def test_staged_manifests(store, client):
    from kubetrain.manifest import ManifestObject, build_manifest

    dataset = f"ds-{uuid.uuid4().hex[:6]}"
    manifest = build_manifest(
        dataset,
        f"s3://datasets/{dataset}/",
        [ManifestObject("datasets", f"{dataset}/a.csv", "a.csv", 3, '"e"')],
    )
    assert store.manifests.staged(dataset, manifest["version"]) is None
    uri = store.manifests.stage(manifest)
    assert uri == S3Layout().manifest_uri(dataset, manifest["version"])
    assert store.manifests.staged(dataset, manifest["version"]) == manifest
    key = S3Layout().manifest_key(dataset, manifest["version"])
    client.put_object(Bucket="training", Key=key, Body=json.dumps({**manifest, "total_bytes": 9}).encode())
    with pytest.raises(ValueError, match="exists but is not a valid dataset manifest"):
        store.manifests.staged(dataset, manifest["version"])
