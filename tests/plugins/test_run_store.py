"""RunStore against the S3 test server: the S3 gateway every operator and repository uses."""

from __future__ import annotations

import uuid

import pytest
from botocore.exceptions import ClientError

from kubetrain.run_store import is_missing_key, parse_bool


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


def test_copy_delete_and_listings(store):
    prefix = f"store/{uuid.uuid4().hex}/"
    store.write_json("training", prefix + "a/1.json", {"n": 1})
    store.write_json("training", prefix + "b/2.json", {"n": 2})
    assert store.copy("training", prefix + "a/1.json", "training", prefix + "a/3.json") == (
        f"s3://training/{prefix}a/3.json"
    )
    assert store.list_keys("training", prefix) == [prefix + k for k in ("a/1.json", "a/3.json", "b/2.json")]
    assert store.list_keys("training", prefix, start_after=prefix + "a/1.json", max_keys=1) == [
        prefix + "a/3.json"
    ]
    assert store.list_prefixes("training", prefix) == [prefix + "a/", prefix + "b/"]
    store.delete("training", [prefix + "a/1.json", prefix + "b/2.json"])
    assert [item["Key"] for item in store.list("training", prefix)] == [prefix + "a/3.json"]


def test_read_many_keeps_the_order(store):
    prefix = f"store/{uuid.uuid4().hex}/"
    keys = [f"{prefix}{n:03d}.json" for n in range(40)]
    for n, key in enumerate(keys):
        store.write_json("training", key, {"n": n})
    found = store.read_many("training", [*keys, prefix + "missing.json"], workers=8)
    assert found == [*({"n": n} for n in range(40)), None]
    assert store.read_many("training", []) == []
    store.write("training", prefix + "bad.json", b"{broken")
    with pytest.raises(ValueError, match=rf"s3://training/{prefix}bad\.json is not valid JSON"):
        store.read_many("training", [keys[0], prefix + "bad.json"])


def test_typed_and_parallel_writes_keep_the_hooks_upload_arguments(client):
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

    from kubetrain.run_store import RunStore
    from kubetrain.s3_layout import S3Layout

    # a connection's upload arguments (here user metadata) apply to every object, typed or not
    store = RunStore(
        S3Hook(aws_conn_id="aws_default", extra_args={"Metadata": {"team": "vision"}}), S3Layout()
    )
    prefix = f"store/{uuid.uuid4().hex}/"
    files = [(prefix + f"{n}.png", bytes([n]) * (n + 1), "image/png") for n in range(6)]
    store.write_files(
        "training", [*files, (prefix + "r.html", "<p>r</p>", "text/html"), (prefix + "raw", b"x", None)]
    )

    def metadata(head):  # names as the server keeps them ("Team" here)
        return {name.lower(): value for name, value in head["Metadata"].items()}

    for key, body, content_type in files:
        head = client.head_object(Bucket="training", Key=key)
        assert (head["ContentType"], metadata(head), head["ContentLength"]) == (
            content_type,
            {"team": "vision"},
            len(body),
        )
    html = client.head_object(Bucket="training", Key=prefix + "r.html")
    assert (html["ContentType"], metadata(html)) == ("text/html", {"team": "vision"})
    assert metadata(client.head_object(Bucket="training", Key=prefix + "raw")) == {"team": "vision"}
    bodies = store.read_files("training", [files[2][0], prefix + "missing", files[2][0]])
    assert bodies == {files[2][0]: files[2][1], prefix + "missing": None}
    heads = store.head_many("training", [files[0][0], prefix + "missing"])
    assert heads[files[0][0]]["ContentLength"] == 1 and heads[prefix + "missing"] is None


def test_the_repositories_hang_off_the_store(store):
    from kubetrain.store.manifests import ManifestRepository
    from kubetrain.store.markers import MarkerRepository
    from kubetrain.store.models import ModelRepository
    from kubetrain.store.passes import PassRepository
    from kubetrain.store.promotions import PromotionRepository
    from kubetrain.store.reports import ReportRepository
    from kubetrain.store.runs import RunRepository

    expected = {
        "passes": PassRepository,
        "models": ModelRepository,
        "promotions": PromotionRepository,
        "runs": RunRepository,
        "markers": MarkerRepository,
        "manifests": ManifestRepository,
        "reports": ReportRepository,
    }
    for name, cls in expected.items():
        repository = getattr(store, name)
        assert isinstance(repository, cls) and repository.store is store, name
