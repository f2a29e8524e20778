"""RunStore against the S3 test server: the helpers every operator uses for S3."""

from __future__ import annotations

import json
import uuid

import pytest
from botocore.exceptions import ClientError

from kubetrain.run_store import MAX_COPY_BYTES, SyncPass, is_missing_key, parse_bool
from kubetrain.s3_layout import S3Layout


def test_missing_keys_are_told_apart_from_other_errors(client, store):
    key = f"nothing/{uuid.uuid4().hex}"
    with pytest.raises(ClientError) as missing:
        client.get_object(Bucket="training", Key=key)
    assert is_missing_key(missing.value)
    with pytest.raises(ClientError) as no_bucket:
        client.get_object(Bucket="no-such-bucket-" + uuid.uuid4().hex[:8], Key=key)
    assert not is_missing_key(no_bucket.value)  # NoSuchBucket is a misconfiguration, not a missing object
    assert not is_missing_key(ValueError("404"))
    assert store.read("training", key) is None and store.head("training", key) is None


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (True, True),
        (False, False),
        ("True", True),
        ("false", False),
        ("1", True),
        ("0", False),
        (" yes ", True),
        ("No", False),
    ],
)
def test_parse_bool(value, expected):
    assert parse_bool("flag", value) is expected


def test_parse_bool_refuses_anything_else():
    with pytest.raises(ValueError, match="flag='maybe' is not a boolean: expected true or false"):
        parse_bool("flag", "maybe")


def test_read_write_and_json(store, client):
    key = f"store/{uuid.uuid4().hex}"
    assert store.write("training", key + ".json", '{"a": 1}') == f"s3://training/{key}.json"
    assert store.read_json("training", key + ".json") == {"a": 1}
    store.write("training", key + ".html", b"<p>hi</p>", content_type="text/html; charset=utf-8")
    assert (
        client.head_object(Bucket="training", Key=key + ".html")["ContentType"] == "text/html; charset=utf-8"
    )
    store.write("training", key + ".bad", b"{broken")
    with pytest.raises(ValueError, match=rf"s3://training/{key}\.bad is not valid JSON"):
        store.read_json("training", key + ".bad")


def test_train_once_marker(store):
    fp = uuid.uuid4().hex[:24]
    assert store.trained_marker("train_x", fp) is None
    uri = store.record_trained("train_x", fp, {"run_id": "manual__1"})
    assert uri == store.marker_uri("train_x", fp) == f"s3://training/trained/train_x/{fp}.json"
    assert store.trained_marker("train_x", fp) == {"run_id": "manual__1"}


def test_promoted_metrics(store):
    model = f"m-{uuid.uuid4().hex[:8]}"
    assert store.promoted_metrics(model) == (None, None)
    layout = S3Layout()
    store.write_json("training", layout.model_latest_key(model), {"version": "v1"})
    assert store.promoted_metrics(model) == ("v1", {})  # promoted without metrics.json
    store.write_json("training", layout.model_prefix(model, "v1") + "metrics.json", {"monitor": "loss"})
    assert store.promoted_metrics(model) == ("v1", {"monitor": "loss"})
    store.write("training", layout.model_latest_key(model), json.dumps({"kind": "x"}))
    with pytest.raises(ValueError, match="names no version"):
        store.promoted_metrics(model)


def test_promotion_refuses_files_cloud_copy_cannot_take_before_copying(store):
    run = S3Layout().run("train_x", f"manual__{uuid.uuid4().hex[:6]}")
    huge = {
        "area": "output",
        "path": "model.bin",
        "key": run.key("output", "model.bin"),
        "size": MAX_COPY_BYTES + 1,
    }
    with pytest.raises(
        ValueError, match=r"CopyObject copies objects up to 5 GiB, and model.bin \(5368709121 bytes\)"
    ):
        store.promote(run, model="m", version="v1", sync_pass=SyncPass(1, "s3://x", {"files": [huge]}))
    assert list(store.list("training", S3Layout().model_prefix("m", "v1"))) == []
