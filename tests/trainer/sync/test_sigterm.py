"""The final checkpoint pass on SIGTERM when S3 hangs, and the work a kill loses.

A pod deleted while its sidecar waits on an S3 request that never answers (a stalled
connection: the server, a proxy or the network) must still commit the trainer's SIGTERM
checkpoint within seconds; and a sidecar killed without a final pass must have committed
a checkpoint that the retried pod can resume from, even when the trainer rewrites its
``checkpoint`` index more often than the sidecar's quiet period.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import signal
import threading
import time
from pathlib import Path

import pytest
from sync_support import run_sync, s3_client, tree
from sync_support.faultproxy import FaultProxy
from test_checkpoint import _Lines, _listed, _passes, _sidecar


@pytest.fixture(scope="module")
def s3(s3_server):
    return s3_client(s3_server)


def _run_uri() -> tuple[str, str]:
    key = f"runs/unit_sigterm/{secrets.token_hex(5)}"
    return f"s3://training/{key}", key


def _checkpoint(ck: Path, step: int) -> None:
    """Files as tf.train.CheckpointManager writes them: data and index, then the index file by rename."""
    (ck / f"ckpt-{step}.data-00000-of-00001").write_bytes(os.urandom(50_000))
    (ck / f"ckpt-{step}.index").write_bytes(os.urandom(300))
    tmp = ck / "checkpoint.tmp1234"
    tmp.write_text(f'model_checkpoint_path: "ckpt-{step}"\nall_model_checkpoint_paths: "ckpt-{step}"\n')
    os.replace(tmp, ck / "checkpoint")


def test_sigterm_while_s3_hangs_still_commits_the_last_checkpoint_within_seconds(s3_server, s3, tmp_path):
    run, key = _run_uri()
    ck, out = tmp_path / "ck", tmp_path / "out"
    ck.mkdir()
    out.mkdir()
    _checkpoint(ck, 1)
    done, held = threading.Event(), []

    def stall(method: str, path: str) -> threading.Event | None:
        # the first upload of ckpt-1's data never gets an answer, until the test ends
        if method == "PUT" and "ckpt-1.data" in path and not held:
            held.append(path)
            return done
        return None

    with FaultProxy(s3_server.endpoint, fail_rate=0.0, stall=stall) as proxy:
        env = {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
        proc = _sidecar(env, run, ck, out, "--interval", "0.3", "--quiet", "0", "--grace", "60")
        lines = _Lines(proc)
        try:
            assert proxy.stalled.wait(60), lines.text()
            # the trainer is preempted: its SIGTERM checkpoint, then the pod's SIGTERM to the sidecar
            _checkpoint(ck, 2)
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            # the stalled request is still held: the final pass must not wait for it
            proc.wait(30)
            took = time.monotonic() - sent
            lines.thread.join(10)
        finally:
            done.set()
            proc.kill()
    output = lines.text()
    assert proc.returncode == 0, output
    assert "SIGTERM while waiting on S3: that pass is abandoned" in output
    final = _passes(s3, key)[max(_passes(s3, key))]
    assert final["final"] and final["complete"] and not final["timed_out"], output
    assert _listed(final) == {f"checkpoints/{k}": v for k, v in tree(ck).items()}, output
    assert re.search(r"final pass \d+ committed in [\d.]+s: 5/5 files uploaded", output), output
    print(f"final pass committed {took:.1f} s after SIGTERM while an S3 request hung")


def test_a_final_pass_that_runs_out_of_time_says_so(s3_server, s3, tmp_path):
    run, key = _run_uri()
    ck, out = tmp_path / "ck", tmp_path / "out"
    ck.mkdir()
    out.mkdir()
    (ck / "small.index").write_bytes(b"ok")
    _checkpoint(ck, 1)
    release = threading.Event()

    def stall(method: str, path: str) -> threading.Event | None:  # the data of ckpt-2 never lands
        return release if method == "PUT" and "ckpt-2.data" in path else None

    with FaultProxy(s3_server.endpoint, fail_rate=0.0, stall=stall) as proxy:
        env = {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
        proc = _sidecar(env, run, ck, out, "--interval", "0.3", "--quiet", "0", "--grace", "4")
        lines = _Lines(proc)
        try:
            lines.wait("pass 1 committed")
            _checkpoint(ck, 2)
            assert proxy.stalled.wait(60), lines.text()
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
            lines.thread.join(10)
        finally:
            release.set()
            proc.kill()
    output = lines.text()
    final = _passes(s3, key)[max(_passes(s3, key))]
    assert final["final"] and not final["complete"] and final["timed_out"], output
    # the index naming ckpt-2 waits for ckpt-2's files, so it is not uploaded either
    assert {e["path"] for e in final["errors"]} == {"ckpt-2.data-00000-of-00001", "checkpoint"}
    assert "not uploaded before the grace period ended" in final["errors"][0]["error"]
    assert "ran out of the grace period" in output
    # readers never take it: restore falls back to the last complete pass
    restored = tmp_path / "restored"
    result = run_sync(["restore", "--run-uri", run, "--checkpoint-dir", str(restored)], s3_server.env())
    assert result.returncode == 0, result.stderr
    assert f"pass {final['pass']} is incomplete" in result.stderr


def test_work_lost_to_a_kill_is_bounded_by_the_sync_interval(s3_server, s3, tmp_path):
    """A trainer that checkpoints every 0.3 s (more often than the 1 s quiet period), SIGKILLed
    with its sidecar (no final pass): the retried pod resumes from a committed checkpoint."""
    run, key = _run_uri()
    ck, out = tmp_path / "ck", tmp_path / "out"
    ck.mkdir()
    out.mkdir()
    stop, step = threading.Event(), [0]

    def trainer() -> None:
        while not stop.is_set():
            step[0] += 1
            _checkpoint(ck, step[0])
            for old in ck.glob(f"ckpt-{step[0] - 3}.*"):  # max_to_keep=3
                old.unlink()
            stop.wait(0.3)

    thread = threading.Thread(target=trainer)
    thread.start()
    interval = 0.5
    proc = _sidecar(
        s3_server.env(), run, ck, out, "--interval", str(interval), "--quiet", "1", "--settle", "0.05"
    )
    lines = _Lines(proc)
    try:
        lines.wait("committed", count=3)  # three passes committed, then the node dies
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        killed_at = step[0]
    finally:
        stop.set()
        thread.join()
        proc.kill()
    passes = _passes(s3, key)
    assert any("checkpoints/checkpoint" in _listed(m) for m in passes.values()), lines.text()
    restored = tmp_path / "restored"
    result = run_sync(["restore", "--run-uri", run, "--checkpoint-dir", str(restored)], s3_server.env())
    assert result.returncode == 0, result.stderr
    assert (restored / "checkpoint").exists(), (
        result.stderr,
        {n: sorted(_listed(m)) for n, m in passes.items()},
    )
    index = (restored / "checkpoint").read_text()
    resumed = int(re.search(r'model_checkpoint_path: "ckpt-(\d+)"', index).group(1))
    # the checkpoint the index names came back whole, as the manifest restore took lists it
    used = passes[int(re.search(r"pass (\d+): \d+ files", result.stderr).group(1))]
    for suffix in (".index", ".data-00000-of-00001"):
        f = next((f for f in used["files"] if f["path"] == f"ckpt-{resumed}{suffix}"), None)
        assert f is not None, (index, sorted(_listed(used)), lines.text())
        assert hashlib.sha256((restored / f["path"]).read_bytes()).hexdigest() == f["sha256"]
    assert resumed > 0
    lost = killed_at - resumed
    # steps of 0.3 s: what the last interval, one quiet deferral and the pass in flight can hold
    print(json.dumps({"killed_at_step": killed_at, "resumed_at_step": resumed, "steps_lost": lost}))
    assert lost <= 3 * (interval + 1 + 0.5) / 0.3 + 1, lines.text()


def test_an_index_rewritten_after_the_scan_goes_with_the_checkpoint_it_names(
    s3_server, tmp_path, monkeypatch, capfd
):
    """The trainer saves ckpt-2 between a pass's scan and its read of the ``checkpoint``
    index: the pass that lists the new index also lists ckpt-2's files, so a restore from it
    resumes from ckpt-2 and not from an index naming files it does not have."""
    from trainer.sync.errors import parse_s3_uri
    from trainer.sync.s3 import S3
    from trainer.sync.sidecar import Sidecar, SyncConfig

    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    run, key = _run_uri()
    ck = tmp_path / "ck"
    ck.mkdir()
    _checkpoint(ck, 1)
    sidecar = Sidecar(S3(), SyncConfig(run=parse_s3_uri(run), dirs={"checkpoints": ck}, quiet=0, settle=0))
    sidecar.start()
    scan = sidecar.scan

    def scan_then_save():  # the scan sees ckpt-1; the trainer then saves ckpt-2
        found = scan()
        _checkpoint(ck, 2)
        return found

    monkeypatch.setattr(sidecar, "scan", scan_then_save)
    manifest = sidecar.run_pass(final=False)
    listed = {f.path for f in manifest.files}
    assert manifest.complete and "checkpoint" in listed, listed
    assert {"ckpt-2.index", "ckpt-2.data-00000-of-00001"} <= listed, listed
    restored = tmp_path / "restored"
    result = run_sync(["restore", "--run-uri", run, "--checkpoint-dir", str(restored)], s3_server.env())
    assert result.returncode == 0, result.stderr
    assert 'model_checkpoint_path: "ckpt-2"' in (restored / "checkpoint").read_text()
    assert tree(restored)["ckpt-2.index"] == tree(ck)["ckpt-2.index"]

    # an index naming a checkpoint whose files are gone is not uploaded: the pass keeps
    # listing the index version that S3 holds, which names ckpt-2
    monkeypatch.setattr(sidecar, "scan", scan)
    index_sha = next(f.sha256 for f in manifest.files if f.path == "checkpoint")
    (ck / "checkpoint").write_text('model_checkpoint_path: "ckpt-7"\n')
    final = sidecar.run_pass(final=True)
    assert next(f.sha256 for f in final.files if f.path == "checkpoint") == index_sha
    assert "checkpoints/checkpoint names ckpt-7, whose files are gone" in capfd.readouterr().err
    result = run_sync(
        ["restore", "--run-uri", run, "--checkpoint-dir", str(tmp_path / "again")], s3_server.env()
    )
    assert result.returncode == 0 and f"pass {final.number}: " in result.stderr, result.stderr
    assert 'model_checkpoint_path: "ckpt-2"' in (tmp_path / "again" / "checkpoint").read_text()


def test_every_sidecar_call_has_timeouts_and_bounded_retries(s3_server, monkeypatch):
    from trainer.sync.__main__ import sidecar_s3
    from trainer.sync.s3 import CONNECT_TIMEOUT, READ_TIMEOUT

    for name, value in {**s3_server.env(), "AWS_MAX_ATTEMPTS": "3"}.items():
        monkeypatch.setenv(name, value)
    s3 = sidecar_s3(8)  # as the sidecar makes it
    # keys in the environment: every call through the CRT, each bounded by the read timeout and
    # its reads sent again (tests/trainer/sync/test_put.py stalls them)
    assert s3.small_calls_on_crt
    assert (s3.connect_timeout, s3.read_timeout, s3.max_attempts) == (CONNECT_TIMEOUT, READ_TIMEOUT, 3)
    config = s3.client.meta.config  # botocore, under workload identity
    assert (config.connect_timeout, config.read_timeout) == (CONNECT_TIMEOUT, READ_TIMEOUT)
    assert config.retries["total_max_attempts"] == 3
    assert CONNECT_TIMEOUT <= 10 and READ_TIMEOUT <= 30
