"""StageDatasetOperator against the S3 test server."""

from __future__ import annotations

import json
import uuid

import pytest
from airflow.sdk.exceptions import AirflowSkipException
from airflow.sdk.execution_time.context import OutletEventAccessors

from kubetrain.operators.stage import DatasetRefused, StageDatasetOperator, StageFailed, dataset_asset


@pytest.fixture
def dataset(client):
    name = f"digits-{uuid.uuid4().hex[:8]}"
    client.put_object(Bucket="datasets", Key=f"{name}/digits.csv", Body=b"label,p0\n3,0.5\n")
    client.put_object(Bucket="datasets", Key=f"{name}/README", Body=b"tiny")
    return name


def manifests(client, dataset: str) -> dict[str, bytes]:
    listing = client.list_objects_v2(Bucket="training", Prefix=f"manifests/{dataset}/").get("Contents", [])
    return {o["Key"]: client.get_object(Bucket="training", Key=o["Key"])["Body"].read() for o in listing}


def stage(uri: str, **kwargs):
    operator = StageDatasetOperator(task_id="stage", source_uri=uri, **kwargs)
    events = OutletEventAccessors()
    return operator, operator.execute({"outlet_events": events}), events


def test_stage_writes_the_manifest_and_emits_the_asset_event(client, dataset):
    uri = f"s3://datasets/{dataset}/"
    operator, result, events = stage(uri)

    assert result["dataset"] == dataset
    assert result["manifest_uri"] == f"s3://training/manifests/{dataset}/{result['version']}.json"
    assert (result["objects"], result["total_bytes"], result["new"]) == (
        2,
        len(b"label,p0\n3,0.5\n") + 4,
        True,
    )
    stored = manifests(client, dataset)
    assert list(stored) == [f"manifests/{dataset}/{result['version']}.json"]
    manifest = json.loads(stored[f"manifests/{dataset}/{result['version']}.json"])
    assert manifest["version"] == result["version"]
    assert sorted(o["path"] for o in manifest["objects"]) == ["README", "digits.csv"]

    assert operator.outlets == [dataset_asset(uri)]
    assert events[dataset_asset(uri)].extra == {
        "dataset": dataset,
        "version": result["version"],
        "manifest": result["manifest_uri"],
    }


def test_restaging_an_unchanged_dataset_writes_nothing(client, dataset):
    uri = f"s3://datasets/{dataset}/"
    _, first, _ = stage(uri)
    before = manifests(client, dataset)
    key = next(iter(before))
    last_modified = client.head_object(Bucket="training", Key=key)["LastModified"]

    _, again, events = stage(uri)

    assert again["version"] == first["version"] and again["new"] is False
    assert manifests(client, dataset) == before  # same keys, same bytes (created_at of the first staging)
    assert client.head_object(Bucket="training", Key=key)["LastModified"] == last_modified
    assert events[dataset_asset(uri)].extra["version"] == first["version"]


def test_the_prepared_copies_of_the_version_are_counted_for_the_pods_data_volume(client, dataset):
    uri = f"s3://datasets/{dataset}/"
    _, first, _ = stage(uri)
    assert first["prepared_bytes"] == 0  # a version's first run: no copy yet

    prefix = f"prepared/{dataset}/{first['version']}/"
    client.put_object(Bucket="training", Key=prefix + "224px-3ch-abc/shard-00000.bin", Body=b"x" * 3000)
    client.put_object(Bucket="training", Key=prefix + "224px-3ch-abc/manifest.json", Body=b"{}")
    client.put_object(Bucket="training", Key=prefix + "64px-3ch-def/shard-00000.bin", Body=b"y" * 500)
    # another version's copy is not this one's
    client.put_object(Bucket="training", Key=f"prepared/{dataset}/other/shard-00000.bin", Body=b"z" * 9000)

    _, again, _ = stage(uri)

    assert again["version"] == first["version"]
    assert again["prepared_bytes"] == 3000 + 2 + 500


def test_watching_skips_an_unchanged_dataset_without_an_event(client, dataset):
    uri = f"s3://datasets/{dataset}/"
    _, first, _ = stage(uri, skip_if_unchanged=True)
    assert first["new"] is True
    operator = StageDatasetOperator(task_id="stage", source_uri=uri, skip_if_unchanged=True)
    events = OutletEventAccessors()
    with pytest.raises(AirflowSkipException, match=f"{uri} is unchanged since version {first['version']}"):
        operator.execute({"outlet_events": events})
    assert events[dataset_asset(uri)].extra == {}
    assert len(manifests(client, dataset)) == 1


def test_a_changed_dataset_gets_a_new_version_and_keeps_the_old(client, dataset):
    uri = f"s3://datasets/{dataset}/"
    _, first, _ = stage(uri)
    client.put_object(Bucket="datasets", Key=f"{dataset}/more.csv", Body=b"label,p0\n1,0.1\n")
    _, second, _ = stage(uri)

    assert second["version"] != first["version"] and second["new"] is True
    assert sorted(manifests(client, dataset)) == sorted(
        f"manifests/{dataset}/{r['version']}.json" for r in (first, second)
    )


def test_missing_dataset_fails_with_the_uri_and_writes_nothing(client):
    name = f"absent-{uuid.uuid4().hex[:8]}"
    uri = f"s3://datasets/{name}/"
    with pytest.raises(StageFailed, match=f"nothing to stage at {uri}") as failed:
        stage(uri)
    assert not isinstance(failed.value, DatasetRefused)  # retried: the data may yet land
    assert manifests(client, name) == {}


def test_a_dataset_outside_the_prefixes_ends_the_task_in_one_line_without_a_retry(monkeypatch):
    from airflow.sdk import RetryAction

    monkeypatch.setenv("KUBETRAIN_DATASET_PREFIXES", "s3://datasets/team-a/")
    operator = StageDatasetOperator(task_id="stage", source_uri="s3://datasets/team-b/x/")
    with pytest.raises(DatasetRefused) as refused:
        operator.execute({"outlet_events": OutletEventAccessors()})
    message = "dataset 's3://datasets/team-b/x/' is outside the deployment's dataset prefixes"
    # A SystemExit: Airflow's task runner logs "Task exited", not the exception's traceback.
    assert isinstance(refused.value, SystemExit) and str(refused.value).startswith(message)
    assert refused.value.__cause__ is None and refused.value.__suppress_context__
    decision = operator.retry_policy.evaluate(refused.value, try_number=1, max_tries=3)
    assert decision.action == RetryAction.FAIL
    missing = operator.retry_policy.evaluate(StageFailed("nothing to stage"), try_number=1, max_tries=3)
    assert missing.action == RetryAction.DEFAULT


def test_explicit_dataset_name_and_single_archive(client):
    key = f"uploads/{uuid.uuid4().hex[:8]}.zip"
    client.put_object(Bucket="datasets", Key=key, Body=b"PK\x05\x06" + b"\0" * 18)
    _, result, _ = stage(f"s3://datasets/{key}", dataset="chat-corpus")
    manifest = json.loads(manifests(client, "chat-corpus")[f"manifests/chat-corpus/{result['version']}.json"])
    assert manifest["source"] == f"s3://datasets/{key}"
    assert [o["path"] for o in manifest["objects"]] == [key.rsplit("/", 1)[1]]


def test_bad_dataset_name_is_refused_before_any_write(client, dataset):
    with pytest.raises(ValueError, match="dataset name 'Digits Set'"):
        stage(f"s3://datasets/{dataset}/", dataset="Digits Set")
    assert manifests(client, "Digits Set") == {}


def test_foreign_file_under_the_manifest_key_is_refused(client, dataset):
    uri = f"s3://datasets/{dataset}/"
    _, result, _ = stage(uri)
    key = result["manifest_uri"].removeprefix("s3://training/")
    client.put_object(Bucket="training", Key=key, Body=b'{"kind": "something/else"}')
    with pytest.raises(ValueError, match=f"s3://training/{key} exists but is not a valid dataset manifest"):
        stage(uri)


def test_templated_uri_leaves_outlets_to_the_dag():
    operator = StageDatasetOperator(task_id="stage", source_uri="{{ params.dataset_uri }}")
    assert operator.outlets == []
    assert "source_uri" in operator.template_fields
