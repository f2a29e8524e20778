"""The run index database: its queries on generated records, and how it keeps in step with S3's records."""

from __future__ import annotations

import random
from datetime import timedelta

import airflow  # noqa: F401  (importing Airflow puts its plugins folder on sys.path)
import pytest
from training_records import T0, make_record

from kubetrain.s3_layout import S3Layout, safe_segment
from kubetrain.store import runs_db
from kubetrain.store.index import index_name, record_keys
from kubetrain.store.runs_db import Query, RunsDb, RunsIndex
from kubetrain.ui.queries import RunFilter, TrainingQueries
from kubetrain_contract.run import RunRecord

DAGS = ["train_image_classifier", "train_custom_container", "retrain_nightly"]
MODELS = ["digits", "faces", "churn"]
VERSIONS = ["000000000000000a", "000000000000000b", "000000000000000c"]


def generated(count: int, seed: int = 3) -> list[dict]:
    rng = random.Random(seed)
    records = []
    for i in range(count):
        failed = rng.random() < 0.2
        records.append(
            make_record(
                dag_id=DAGS[i % 3],
                run_id=f"scheduled__{i:05d}",
                model=MODELS[(i // 3) % 3],
                when=T0 + timedelta(minutes=i),
                value=None if failed else rng.uniform(0.5, 0.9),
                status="failed" if failed else "success",
                version=rng.choice(VERSIONS),
            )
        )
    return records


def entry(record: dict) -> str:
    return index_name(RunRecord.from_dict(record))


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return generated(400)


@pytest.fixture(scope="module")
def db(records) -> RunsDb:
    db = RunsDb()
    for record in records:
        db.upsert(entry(record), record, 1)
    # what a page keeps is a snapshot read back
    return RunsDb(db.serialize())


def expected(records, readable, **where) -> list[str]:
    rows = [
        r
        for r in records
        if safe_segment(r["dag_id"]) in readable
        and all(
            r[{"model": "model", "dag": "dag_id", "status": "status"}.get(k, k)] == v
            if k != "dataset_version"
            else r["dataset"]["version"] == v
            for k, v in where.items()
        )
    ]
    return [r["run_id"] for r in sorted(rows, key=entry)]


@pytest.mark.parametrize(
    "where",
    [
        {},
        {"model": "faces"},
        {"dag": "train_custom_container"},
        {"dataset_version": "000000000000000b"},
        {"status": "failed"},
        {"model": "digits", "status": "failed"},
        {"dag": "retrain_nightly", "status": "success", "dataset_version": "000000000000000a"},
        {
            "model": "churn",
            "dag": "train_image_classifier",
            "dataset_version": "000000000000000c",
            "status": "failed",
        },
        {"dataset_version": "ffffffffffffffff"},  # matches nothing
        {"model": "faces", "dag": "not_a_dag"},  # matches nothing
    ],
)
def test_every_filter_and_combination_answers_completely_newest_first(db, records, where):
    readable = frozenset(DAGS[:2])  # retrain_nightly is not readable
    want = expected(records, readable, **where)
    got, after = [], None
    while True:
        page, more = db.runs(Query(readable=readable, after=after, limit=50, **where))
        got += [record["run_id"] for _, record in page]
        if not more:
            break
        after = page[-1][0]
    assert got == want
    if "dag" not in where or where["dag"] in readable:
        assert (
            len(want) > 0 or where.get("dataset_version") == "ffffffffffffffff" or "not_a_dag" in str(where)
        )


def test_pages_are_newest_first_and_continue_after_an_entry(db, records):
    readable = frozenset(DAGS)
    first, more = db.runs(Query(readable=readable, limit=50))
    assert more and [r["run_id"] for _, r in first] == [f"scheduled__{i:05d}" for i in range(399, 349, -1)]
    second, _ = db.runs(Query(readable=readable, after=first[-1][0], limit=50))
    assert second[0][1]["run_id"] == "scheduled__00349"
    last, more = db.runs(Query(readable=readable, after=entry(records[3]), limit=50))
    assert [r["run_id"] for _, r in last] == ["scheduled__00002", "scheduled__00001", "scheduled__00000"]
    assert not more


def test_the_record_comes_back_whole(db, records):
    (found,), _ = db.runs(Query(readable=frozenset(DAGS), limit=1))
    assert found == (entry(records[-1]), records[-1])


def test_models_only_of_readable_dags(records):
    db = RunsDb()
    for record in records[:30]:
        db.upsert(entry(record), record, 1)
    hidden = make_record(dag_id="secret_dag", run_id="s", model="secret-model")
    db.upsert(entry(hidden), hidden, 1)
    assert db.models({safe_segment(d) for d in DAGS}) == sorted(MODELS)
    assert not db.has_model("secret-model", DAGS) and db.has_model("secret-model", ["secret_dag"])


def test_a_later_write_of_a_run_wins_in_any_order():
    failed = make_record(run_id="again", status="failed", value=None)
    succeeded = make_record(run_id="again", status="success", value=0.8)
    for order in ([(failed, 1), (succeeded, 2)], [(succeeded, 2), (failed, 1)]):
        db = RunsDb()
        for record, written in order:
            db.upsert(entry(record), record, written)
        assert db.count() == 1
        (only,), _ = db.runs(Query(readable=frozenset(DAGS), limit=5))
        assert only[1]["status"] == "success"
        assert db.runs(Query(readable=frozenset(DAGS), status="failed"))[0] == []


def test_a_snapshot_that_is_no_database_is_refused():
    with pytest.raises(runs_db.IndexUnavailable, match="not a database of runs"):
        RunsDb(b"not sqlite at all" * 100)


def test_delta_keys_sort_newest_first():
    older, newer = runs_db.delta_key(1_000), runs_db.delta_key(2_000)
    assert newer < older and runs_db.delta_time(newer) == 2_000 and runs_db.delta_time("x") is None


# -- in step with S3 -------------------------------------------------------------------------------


def names(page) -> list[str]:
    return [r["run_id"] for r in page.runs]


def test_the_page_picks_up_a_new_record_on_refresh_and_agrees_with_the_key_walk(store, seeded, client):
    runs_db.rebuild(store)
    index = RunsIndex(store)
    readable = ["train_image_classifier", "train_custom_container", "train_dialogue_transformer"]
    digits = seeded["digits"]
    for filt in (
        RunFilter(model=digits),
        RunFilter(model=digits, status="failed"),
        RunFilter(model=digits, dataset_version="0000000000000002", dag_id="train_image_classifier"),
        RunFilter(model=seeded["chat"]),
        RunFilter(model=digits, dataset_version="00000000000000ff"),
    ):
        by_db = TrainingQueries(store, readable, index).runs(filt)
        by_keys = TrainingQueries(store, readable).runs(filt)
        assert by_db.source == "db" and by_keys.source == "keys"
        assert by_db.runs == by_keys.runs and by_db.next_after == by_keys.next_after

    # a record written after the snapshot: the next request lists its delta and reads it
    new = make_record(run_id=f"manual__{seeded['tag']}-8", model=digits, when=T0 + timedelta(hours=5))
    store.runs.write(new)
    calls = _count_requests(client_of(store))
    page = TrainingQueries(store, readable, index).runs(RunFilter(model=digits))
    assert names(page)[0] == new["run_id"] and page.source == "db"
    assert calls == {"ListObjectsV2": 1, "GetObject": 1}
    # nothing new: one list, no read
    calls.clear()
    TrainingQueries(store, readable, index).runs(RunFilter(model=digits, status="failed"))
    assert calls == {"ListObjectsV2": 1}
    # the run written again (a cleared and re-run DAG run that failed) is listed once, as its last write says
    store.runs.write(
        make_record(
            run_id=new["run_id"], model=digits, when=T0 + timedelta(hours=5), status="failed", value=None
        )
    )
    rows = TrainingQueries(store, readable, index).runs(RunFilter(model=digits)).runs
    assert [r["status"] for r in rows if r["run_id"] == new["run_id"]] == ["failed"]
    assert set(TrainingQueries(store, readable, index).models()) >= {digits, seeded["chat"]}
    assert seeded["digits"] in TrainingQueries(store, readable).models()  # the key walk skips index/_db/


def client_of(store):
    return store.hook.conn


def _count_requests(client) -> dict[str, int]:
    counts: dict[str, int] = {}

    def count(model, **_):
        counts[model.name] = counts.get(model.name, 0) + 1

    client.meta.events.register("before-call.s3", lambda model, **kw: count(model))
    return counts


def test_a_record_the_database_lacks_is_found_by_check_and_restored_by_rebuild(store, client):
    import uuid

    runs_db.rebuild(store)
    tag = uuid.uuid4().hex[:6]
    record = RunRecord.from_dict(make_record(run_id=f"manual__{tag}", model=f"lost-{tag}"))
    # the record step stopped after the record and its index copies, before its delta
    body = (record.to_json(indent=1) + "\n").encode()
    for key in record_keys(S3Layout(), record):
        client.put_object(Bucket="training", Key=key, Body=body)
    found = runs_db.check(store)
    assert found.missing == [index_name(record)] and not found.agree
    q = TrainingQueries(store, ["train_image_classifier"], RunsIndex(store))
    assert q.runs(RunFilter(model=f"lost-{tag}")).runs == []
    runs_db.rebuild(store)
    assert runs_db.check(store).agree
    q = TrainingQueries(store, ["train_image_classifier"], RunsIndex(store))
    assert names(q.runs(RunFilter(model=f"lost-{tag}"))) == [f"manual__{tag}"]


def test_compaction_folds_the_deltas_into_the_snapshot(store):
    import uuid

    runs_db.rebuild(store)
    model = f"compact-{uuid.uuid4().hex[:6]}"
    for i in range(3):
        store.runs.write(
            make_record(run_id=f"manual__{model}-{i}", model=model, when=T0 + timedelta(minutes=i))
        )
    db = runs_db.compact(store)
    assert db.has_model(model, ["train_image_classifier"])
    fresh = RunsIndex(store)
    q = TrainingQueries(store, ["train_image_classifier"], fresh)
    assert names(q.runs(RunFilter(model=model))) == [f"manual__{model}-{i}" for i in (2, 1, 0)]


def test_without_a_snapshot_the_page_walks_the_keys(store, client, seeded):
    runs_db.rebuild(store)
    saved = client.get_object(Bucket="training", Key=runs_db.SNAPSHOT_KEY)["Body"].read()
    client.delete_object(Bucket="training", Key=runs_db.SNAPSHOT_KEY)
    try:
        q = TrainingQueries(store, ["train_image_classifier"], RunsIndex(store))
        page = q.runs(RunFilter(model=seeded["digits"], status="failed"))
        assert page.source == "keys" and names(page) == [f"manual__{seeded['tag']}-3"]
    finally:
        client.put_object(Bucket="training", Key=runs_db.SNAPSHOT_KEY, Body=saved)


# -- upkeep: the kubetrain_run_index DAG --------------------------------------------------------------


def maintain_task():
    """The kubetrain_run_index DAG's task, as its DAG file defines it."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "dags" / "kubetrain_run_index.py"
    spec = importlib.util.spec_from_file_location("dagfile_kubetrain_run_index", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    dag = module.kubetrain_run_index()  # the @dag function makes the DAG the file defines
    assert dag.dag_id == "kubetrain_run_index" and dag.max_active_runs == 1
    return dag.task_dict["maintain"].python_callable


def test_the_upkeep_rebuilds_without_a_snapshot_compacts_and_rebuilds_what_disagrees(store, client):
    import uuid

    maintain = maintain_task()
    # a bucket whose runs were recorded before the database: no snapshot, so it is rebuilt
    client.delete_object(Bucket="training", Key=runs_db.SNAPSHOT_KEY)
    done = maintain()
    assert done["action"] == "rebuilt" and "no snapshot" in done["reason"], done
    assert runs_db.check(store).agree
    # runs recorded since: their deltas are folded into the snapshot, which a fresh reader finds
    model = f"upkeep-{uuid.uuid4().hex[:6]}"
    for i in range(2):
        store.runs.write(
            make_record(run_id=f"manual__{model}-{i}", model=model, when=T0 + timedelta(minutes=i))
        )
    done = maintain()
    assert done["action"] == "compacted" and done["missing"] == done["extra"] == 0, done
    snapshot = RunsDb(client.get_object(Bucket="training", Key=runs_db.SNAPSHOT_KEY)["Body"].read())
    assert snapshot.has_model(model, ["train_image_classifier"]) and snapshot.count() == done["runs"]
    # a record whose delta was lost (the record step stopped after its index copies): rebuilt
    record = RunRecord.from_dict(make_record(run_id=f"manual__{model}-lost", model=model))
    body = (record.to_json(indent=1) + "\n").encode()
    for key in record_keys(S3Layout(), record):
        client.put_object(Bucket="training", Key=key, Body=body)
    done = maintain()
    assert (done["action"], done["missing"], done["extra"]) == ("rebuilt", 1, 0), done
    assert runs_db.check(store).agree
    q = TrainingQueries(store, ["train_image_classifier"], RunsIndex(store))
    assert f"manual__{model}-lost" in names(q.runs(RunFilter(model=model)))
