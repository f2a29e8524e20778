"""The checkpoint layouts the run store's pass rules recognise (kubetrain.store.passes.checkpoint_group).

A checkpoint's step is read from its name in the sync pass manifests: for the run record's "resumed
from step", the report's "resumed at step" of a preemption, and the promote step's pruning. Each
writer's layout is a row of the table; the store tests then read the steps back from real pass
manifests in the test S3 server.
"""

from __future__ import annotations

import hashlib
import uuid

import pytest

from kubetrain.s3_layout import S3Layout
from kubetrain.store.passes import checkpoint_group
from kubetrain_contract.manifests import SyncPassRecord

# (writer, path under /checkpoints, ((directory, family), step) or None when it is no checkpoint)
LAYOUTS = [
    # kubetrain's own trainers: TensorFlow's CheckpointManager
    ("tf checkpoint index", "ckpt-12.index", (("", "ckpt"), 12)),
    ("tf checkpoint shard", "ckpt-12.data-00000-of-00001", (("", "ckpt"), 12)),
    ("tf checkpoint state file", "checkpoint", None),
    # numbered Keras files (ModelCheckpoint's "epoch-{epoch:04d}.weights.h5" and the like)
    ("keras weights in a folder", "best/epoch-0003.weights.h5", (("best/", "epoch"), 3)),
    ("underscored family", "weights_epoch_5.h5", (("", "weights_epoch"), 5)),
    # the kit's Keras callback: one folder a checkpoint, named after the optimizer step
    ("callback weights", "keras/step-0000000012/model.weights.h5", (("keras/", "step"), 12)),
    ("callback state", "keras/step-0000000012/state.json", (("keras/", "step"), 12)),
    ("callback at step 0", "keras/step-0000000000/state.json", (("keras/", "step"), 0)),
    ("callback being written", "keras/.tmp-step-0000000012-4242/state.json", None),
    ("callback set aside", "keras/.damaged-step-0000000012/model.weights.h5", None),
    # a kit script's own folder checkpoints (docs/extending.md: name them <name>-<step>)
    ("script folder at the root", "step-40/weights.bin", (("", "step"), 40)),
    ("script folder, nested files", "run/ckpt_7/params/a.bin", (("run/", "ckpt"), 7)),
    # not checkpoints
    ("tensorboard events", "events.out.tfevents.1700000000.host", None),
    ("the stop file", ".kubetrain-stop", None),
    ("unnumbered folder", "keras/latest/state.json", None),
]


@pytest.mark.parametrize(("path", "group"), [row[1:] for row in LAYOUTS], ids=[row[0] for row in LAYOUTS])
def test_checkpoint_layouts(path, group):
    assert checkpoint_group(path) == group


def _file(run, path: str, body: bytes = b"x") -> dict:
    return {
        "area": "checkpoints",
        "path": path,
        "key": run.key("checkpoints", path),
        "size": len(body),
        "sha256": hashlib.sha256(body).hexdigest(),
    }


def _write_pass(store, run, number: int, pod: str, paths: list[str], *, final: bool) -> None:
    record = SyncPassRecord.from_dict(
        {
            "kind": "kubetrain/sync-pass",
            "format_version": 1,
            "pass": number,
            "final": final,
            "complete": True,
            "started_at": "2026-03-02T08:00:00Z",
            "finished_at": "2026-03-02T08:00:01Z",
            "pod": pod,
            "files": [_file(run, p) for p in paths],
            "errors": [],
        }
    )
    store.write(run.bucket, run.pass_key(number), record.to_json())


def _callback_checkpoint(step: int) -> list[str]:
    folder = f"keras/step-{step:010d}"
    return [f"{folder}/model.weights.h5", f"{folder}/state.json"]


def test_a_keras_callback_run_gives_its_resume_step_and_the_steps_lost(store):
    """A pod preempted after its callback saved step 35, then a pod that resumed there and finished."""
    run = S3Layout().run("example_keras_model", f"manual__{uuid.uuid4().hex[:6]}")
    first, second = "train-abc-1", "train-abc-2"
    _write_pass(store, run, 1, first, _callback_checkpoint(22), final=False)
    # its shutdown pass: the checkpoint written at SIGTERM, a half-written one skipped by the sidecar
    _write_pass(store, run, 2, first, _callback_checkpoint(22) + _callback_checkpoint(35), final=True)
    _write_pass(store, run, 3, second, _callback_checkpoint(35) + _callback_checkpoint(44), final=False)
    _write_pass(store, run, 4, second, _callback_checkpoint(44) + _callback_checkpoint(66), final=True)

    assert store.passes.resumed_from_step(run) == 35
    assert store.passes.last_checkpoints(run, [first, second]) == {first: (35, True), second: (66, True)}


def test_a_run_whose_first_pod_saved_only_unnumbered_files_resumes_at_an_unknown_step(store):
    run = S3Layout().run("example_keras_model", f"manual__{uuid.uuid4().hex[:6]}")
    _write_pass(store, run, 1, "train-x-1", ["keras/latest/state.json"], final=True)
    _write_pass(store, run, 2, "train-x-2", _callback_checkpoint(10), final=True)
    assert store.passes.resumed_from_step(run) is None
    assert store.passes.last_checkpoints(run, ["train-x-1"]) == {"train-x-1": (None, True)}


def test_pruning_keeps_or_deletes_a_callback_checkpoint_folder_whole(store):
    run = S3Layout().run("example_keras_model", f"manual__{uuid.uuid4().hex[:6]}")
    files = [_file(run, p) for step in (12, 24, 36) for p in _callback_checkpoint(step)]
    for entry in files:
        store.write(run.bucket, entry["key"], b"x")
    deleted, kept = store.passes.prune(run, files, keep=2)
    assert sorted(deleted) == sorted(run.key("checkpoints", p) for p in _callback_checkpoint(12))
    assert [entry["path"] for entry in kept] == _callback_checkpoint(24) + _callback_checkpoint(36)
    left = sorted(item["Key"] for item in store.list(run.bucket, run.area_prefix("checkpoints")))
    assert left == sorted(entry["key"] for entry in kept)
