"""PromoteModelOperator against the S3 test server: verification, the deferred wait, promotion, pruning."""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import uuid
import warnings
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import airflow  # noqa: F401  (importing Airflow puts its plugins folder on sys.path)
import pytest
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred

from kubetrain.operators.promote import PromoteModelOperator
from kubetrain.run_store import FinalPassPending, SyncVerificationError, checkpoint_group
from kubetrain.s3_layout import S3Layout
from kubetrain.triggers.sync import FinalSyncPassTrigger

RUN_AFTER = datetime(2026, 11, 22, 4, 0, tzinfo=UTC)
PASS_SCHEMA = (
    Path(__file__).resolve().parents[3] / "trainer" / "kubetrain_contract" / "schemas" / "sync-pass.v1.json"
)


def check_schema(document: dict) -> None:
    """Pass manifests, ours and the test's stand-ins for the sidecar's, follow the pod side's schema."""
    import jsonschema

    jsonschema.validate(document, json.loads(PASS_SCHEMA.read_text()))


class Run:
    """A training run in S3 as the checkpoint-sync sidecar leaves it."""

    def __init__(self, client):
        self.client = client
        self.dag_id = f"train_{uuid.uuid4().hex[:8]}"
        self.run_id = "scheduled__2026-11-22T04:00:00+00:00"
        self.location = S3Layout().run(self.dag_id, self.run_id)
        self.model = f"model-{uuid.uuid4().hex[:6]}"

    def upload(self, area: str, path: str, body: bytes, *, with_sha: bool = True) -> dict:
        key = self.location.key(area, path)
        sha = hashlib.sha256(body).hexdigest()
        self.client.put_object(
            Bucket="training", Key=key, Body=body, Metadata={"sha256": sha} if with_sha else {}
        )
        return {"area": area, "path": path, "key": key, "size": len(body), "sha256": sha}

    def commit(
        self, number: int, files: list[dict], *, final: bool = True, complete: bool = True, errors=()
    ) -> None:
        doc = {
            "kind": "kubetrain/sync-pass",
            "format_version": 1,
            "pass": number,
            "final": final,
            "complete": complete,
            "started_at": "2026-11-22T04:10:00Z",
            "finished_at": "2026-11-22T04:10:01Z",
            "pod": "train-abc",
            "files": files,
            "errors": list(errors),
        }
        check_schema(doc)
        self.client.put_object(
            Bucket="training", Key=self.location.pass_key(number), Body=json.dumps(doc).encode()
        )

    def standard(self) -> list[dict]:
        """Checkpoints ckpt-1..5 uploaded over time; the pod kept the newest two; an exported model."""
        older = [self.upload("checkpoints", f"ckpt-{n}.index", b"i%d" % n) for n in (1, 2, 3)]
        older += [self.upload("checkpoints", f"ckpt-{n}.data-00000-of-00001", b"d" * n) for n in (1, 2, 3)]
        files = [self.upload("checkpoints", "checkpoint", b'model_checkpoint_path: "ckpt-5"\n')]
        for n in (4, 5):
            files.append(self.upload("checkpoints", f"ckpt-{n}.index", b"i%d" % n))
            files.append(self.upload("checkpoints", f"ckpt-{n}.data-00000-of-00001", b"d" * n))
        files.append(self.upload("output", "model.keras", b"keras zip bytes"))
        files.append(self.upload("output", "saved_model/saved_model.pb", b"pb bytes", with_sha=False))
        files.append(self.upload("output", "metrics.json", b'{"monitor": "val_accuracy"}'))
        self.commit(1, older[:2])
        self.commit(2, files)
        return files

    def keys(self, prefix: str) -> list[str]:
        listing = self.client.list_objects_v2(Bucket="training", Prefix=prefix).get("Contents", [])
        return sorted(o["Key"] for o in listing)

    def read(self, key: str) -> bytes:
        return self.client.get_object(Bucket="training", Key=key)["Body"].read()

    def context(self) -> dict:
        ti = SimpleNamespace(dag_id=self.dag_id, task_id="promote", map_index=-1, try_number=1)
        return {"ti": ti, "run_id": self.run_id, "dag_run": SimpleNamespace(run_after=RUN_AFTER)}

    def operator(self, **kwargs) -> PromoteModelOperator:
        kwargs.setdefault("final_pass_timeout", 0)
        return PromoteModelOperator(task_id="promote", model=self.model, **kwargs)

    def execute(self, **kwargs):
        op = self.operator(**kwargs)
        return op, op.execute(self.context())


@pytest.fixture
def run(client):
    return Run(client)


def test_promotes_the_model_with_latest_written_last(run):
    run.standard()
    op = run.operator(keep_checkpoints=None)
    writes: list[tuple[str, str]] = []
    op.hook.conn.meta.events.register(
        "before-parameter-build.s3",
        lambda model, params, **_: writes.append((model.name, params.get("Key", ""))),
    )
    context = run.context()
    result = op.execute(context)

    version = result["model_version"]
    assert version.startswith("20261122T040000Z-")
    prefix = f"models/{run.model}/{version}/"
    assert result["promoted"] is True and result["model_uri"] == f"s3://training/{prefix}"
    assert run.keys(prefix) == [
        prefix + p for p in ("metrics.json", "model.keras", "saved_model/saved_model.pb")
    ]
    assert run.read(prefix + "model.keras") == b"keras zip bytes"
    pointer = json.loads(run.read(f"models/{run.model}/latest"))
    assert pointer["version"] == version and pointer["uri"] == result["model_uri"]
    assert pointer["run_uri"] == run.location.uri and pointer["sync_pass"] == 2

    model_writes = [
        key for name, key in writes if name in ("PutObject", "CopyObject") and key.startswith("models/")
    ]
    assert model_writes[-1] == f"models/{run.model}/latest"
    assert len(model_writes) == 4

    # A retry of the task promotes to the same version, not a second one.
    assert op.execute(context)["model_version"] == version
    assert [k for k in run.keys(f"models/{run.model}/") if not k.endswith("/latest")] == run.keys(prefix)


def test_complete_pass_is_verified_with_and_without_sha_metadata(run, store):
    files = run.standard()
    final = store.passes.final(run.location)
    assert final.number == 2 and len(final.files) == len(files)


def test_missing_manifest_is_pending_not_wrong(run):
    with pytest.raises(FinalPassPending, match=f"no sync pass manifest under {run.location.uri}/sync/"):
        run.execute()


def test_incomplete_final_pass_fails_naming_the_file(run):
    files = run.standard()
    run.commit(
        3, files, complete=False, errors=[{"area": "output", "path": "model.keras", "error": "timed out"}]
    )
    with pytest.raises(
        SyncVerificationError, match=r"pass-00000003\.json is incomplete: output/model\.keras: timed out"
    ) as info:
        run.execute()
    assert isinstance(info.value, AirflowFailException)  # retrying cannot make S3 match
    assert run.keys(f"models/{run.model}/") == []


def test_pass_that_is_not_final_is_pending(run):
    files = run.standard()
    run.commit(3, files, final=False)
    with pytest.raises(FinalPassPending, match=r"\(pass 3\) is not final"):
        run.execute()


def first_event(trigger):
    async def run():
        async for event in trigger.run():
            return event.payload

    return asyncio.run(run())


def test_a_final_pass_that_lands_late_is_waited_for_in_the_triggerer(run):
    """The sidecar's shutdown pass may land after the training task ends: the task defers, it does not sleep."""
    files = run.standard()
    run.commit(3, files, final=False)
    op = run.operator(final_pass_timeout=60, poll_interval=0.2)
    context = run.context()
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(context)
    classpath, kwargs = deferred.value.trigger.serialize()
    assert classpath == "kubetrain.triggers.sync.FinalSyncPassTrigger"
    assert kwargs == {
        "run_uri": run.location.uri,
        "aws_conn_id": "aws_default",
        "timeout": 60,
        "poll_interval": 0.2,
    }
    trigger = FinalSyncPassTrigger(**kwargs)  # as the triggerer builds it from plain arguments

    landed = threading.Event()

    def land():
        run.commit(4, files)
        landed.set()

    timer = threading.Timer(1.0, land)
    timer.start()
    try:
        event = first_event(trigger)
    finally:
        timer.join()
    assert landed.is_set() and event == {"status": "final", "pass": 4}
    result = getattr(op, deferred.value.method_name)(context, event)
    assert result["sync_pass"] == 4 and result["promoted"] is True


def test_a_final_pass_that_never_lands_fails_after_the_wait(run):
    files = run.standard()
    run.commit(3, files, final=False)
    event = first_event(
        FinalSyncPassTrigger(
            run_uri=run.location.uri, aws_conn_id="aws_default", timeout=0.5, poll_interval=0.1
        )
    )
    assert event["status"] == "timeout" and "the newest pass is 3, not final" in event["message"]
    op = run.operator()
    with pytest.raises(SyncVerificationError, match="no final sync pass under .* within 0.5 s"):
        op.execute_complete(run.context(), event)
    assert run.keys(f"models/{run.model}/") == []


def test_size_mismatch_fails(run):
    run.standard()
    run.upload("output", "model.keras", b"truncated")
    with pytest.raises(
        SyncVerificationError, match=r"output/model\.keras: size in S3 is 9, the manifest says 15"
    ):
        run.execute()
    assert run.keys(f"models/{run.model}/") == []


def test_content_mismatch_without_metadata_is_found_by_reading(run):
    run.standard()
    run.upload("output", "saved_model/saved_model.pb", b"PB BYTES", with_sha=False)  # same size, other bytes
    with pytest.raises(
        SyncVerificationError, match=r"output/saved_model/saved_model\.pb: sha256 in S3 is [0-9a-f]{64}"
    ):
        run.execute()


def test_missing_file_fails(run, client):
    files = run.standard()
    client.delete_object(Bucket="training", Key=files[1]["key"])
    with pytest.raises(
        SyncVerificationError, match=r"checkpoints/ckpt-4\.index: missing from s3://training/"
    ):
        run.execute()


def test_pruning_keeps_the_newest_prefixes_and_records_a_pass(run, store):
    run.standard()
    _, result = run.execute(keep_checkpoints=1, promote="never")

    assert result["promoted"] is False and run.keys(f"models/{run.model}/") == []
    prefix = run.location.area_prefix("checkpoints")
    assert run.keys(prefix) == [
        prefix + p for p in ("checkpoint", "ckpt-5.data-00000-of-00001", "ckpt-5.index")
    ]
    assert result["pruned"] == 8 and result["sync_pass"] == 3
    final = store.passes.final(run.location)  # the newest pass matches S3 again
    assert final.number == 3
    check_schema(final.document)
    assert sorted(f["path"] for f in final.files if f["area"] == "checkpoints") == [
        "checkpoint",
        "ckpt-5.data-00000-of-00001",
        "ckpt-5.index",
    ]


def test_pruning_keeps_everything_the_pass_lists_when_k_covers_it(run):
    run.standard()
    _, result = run.execute(keep_checkpoints="3", promote="never")
    prefix = run.location.area_prefix("checkpoints")
    kept = [k.removeprefix(prefix) for k in run.keys(prefix)]
    assert kept == [
        "checkpoint",
        "ckpt-4.data-00000-of-00001",
        "ckpt-4.index",
        "ckpt-5.data-00000-of-00001",
        "ckpt-5.index",
    ]
    assert result["sync_pass"] == 2  # nothing listed was deleted: no new pass


@pytest.mark.parametrize(("is_better", "promoted"), [(False, False), (True, True)])
def test_promotion_gated_on_the_report(run, is_better, promoted):
    run.standard()
    _, result = run.execute(promote="if_better", is_better=is_better, keep_checkpoints=None)
    assert result["promoted"] is promoted
    assert bool(run.keys(f"models/{run.model}/")) is promoted


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"promote": "sometimes"}, "promote='sometimes' is not valid"),
        ({"promote": "if_better"}, "promote='if_better' needs is_better"),
        ({"promote": "if_better", "is_better": None}, "promote='if_better' needs is_better"),
        ({"promote": "if_better", "is_better": "maybe"}, "is_better='maybe' is not a boolean"),
        ({"keep_checkpoints": -2}, "keep_checkpoints=-2 is not valid"),
    ],
)
def test_bad_settings_fail_before_touching_s3(run, kwargs, message):
    run.standard()
    with pytest.raises(ValueError, match=message):
        run.execute(**kwargs)
    assert len(run.keys(run.location.area_prefix("checkpoints"))) == 11
    assert len(run.keys(run.location.area_prefix("sync"))) == 2
    assert run.keys(f"models/{run.model}/") == []


@pytest.mark.parametrize(
    ("path", "group"),
    [
        ("ckpt-12.index", (("", "ckpt"), 12)),
        ("ckpt-12.data-00000-of-00001", (("", "ckpt"), 12)),
        ("best/epoch-0003.weights.h5", (("best/", "epoch"), 3)),
        ("weights_epoch_5.h5", (("", "weights_epoch"), 5)),
        ("checkpoint", None),
        ("events.out.tfevents.1700000000.host", None),
    ],
)
def test_checkpoint_groups(path, group):
    assert checkpoint_group(path) == group


def test_the_old_name_still_works_with_a_deprecation_warning(run):
    from kubetrain.operators.sync import SyncCheckpointsOperator

    run.standard()
    with pytest.warns(
        DeprecationWarning, match="SyncCheckpointsOperator is deprecated.*PromoteModelOperator"
    ):
        op = SyncCheckpointsOperator(task_id="sync", model=run.model, final_pass_timeout=0)
    assert isinstance(op, PromoteModelOperator)
    assert op.execute(run.context())["promoted"] is True
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        run.operator()  # the new name warns about nothing
