"""checkpoint-sync (as a subprocess, like the sidecar) and restore against a real S3-protocol server."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sync_support import REPO, dataset_manifest, put_manifest, run_sync, s3_client, tree
from sync_support.faultproxy import FaultProxy


@pytest.fixture(scope="module")
def s3(s3_server):
    return s3_client(s3_server)


def _run_uri() -> tuple[str, str]:
    key = f"runs/unit_sync/{secrets.token_hex(5)}"
    return f"s3://training/{key}", key


class _Lines:
    """The sidecar's output, line by line as it comes, to wait on (no sleeps)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            with self.cond:
                self.lines.append(line)
                self.cond.notify_all()
        with self.cond:
            self.lines.append("")  # end of output
            self.cond.notify_all()

    def wait(self, text: str, timeout: float = 60, count: int = 1) -> None:
        """Wait until ``count`` lines containing ``text`` have been written."""
        with self.cond:
            if (
                not self.cond.wait_for(
                    lambda: sum(text in x for x in self.lines) >= count or "" in self.lines, timeout
                )
                or sum(text in x for x in self.lines) < count
            ):
                raise AssertionError(f"the sidecar never wrote {text!r}:\n{self.text()}")

    def text(self) -> str:
        return "".join(self.lines)


def _sidecar(env: dict[str, str], run: str, ck: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trainer.sync",
            "checkpoint-sync",
            "--run-uri",
            run,
            "--checkpoint-dir",
            str(ck),
            "--output-dir",
            str(out),
            *extra,
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "HOSTNAME": "unit-pod", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _passes(s3, key: str) -> dict[int, dict]:
    out = {}
    for item in s3.list_objects_v2(Bucket="training", Prefix=f"{key}/sync/").get("Contents", []):
        number = int(item["Key"].rsplit("pass-", 1)[1].split(".")[0])
        out[number] = json.loads(s3.get_object(Bucket="training", Key=item["Key"])["Body"].read())
    return out


def _wait_for(s3, key: str, predicate, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        passes = _passes(s3, key)
        if passes and predicate(passes[max(passes)]):
            return passes[max(passes)]
        time.sleep(0.1)
    raise AssertionError(f"no pass manifest under {key} met the condition in {timeout} s: {_passes(s3, key)}")


def _stop(proc: subprocess.Popen, timeout: float = 20) -> str:
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=timeout)
    return output


def _listed(manifest: dict) -> dict[str, str]:
    return {f"{f['area']}/{f['path']}": f["sha256"] for f in manifest["files"]}


def _check_bytes(s3, manifest: dict) -> None:
    """Every listed file is in S3 with the listed size and sha256, also in its metadata."""
    for f in manifest["files"]:
        obj = s3.get_object(Bucket="training", Key=f["key"])
        body = obj["Body"].read()
        assert len(body) == f["size"] and hashlib.sha256(body).hexdigest() == f["sha256"], f["key"]
        assert {k.lower(): v for k, v in obj["Metadata"].items()}["sha256"] == f["sha256"]


def _final_pass(s3, key: str, proc: subprocess.Popen, output: str) -> dict:
    """The run's last pass manifest, once the sidecar exited 0 with it final and complete."""
    assert proc.returncode == 0, output
    final = _passes(s3, key)[max(_passes(s3, key))]
    assert final["final"] and final["complete"], output
    return final


@contextlib.contextmanager
def _writing(path: Path, pause: float) -> Iterator[None]:
    """``path`` written 4 KiB at a time with ``pause`` seconds between writes, from its first write
    until the block ends."""
    stop, wrote = threading.Event(), threading.Event()

    def writer() -> None:
        with open(path, "wb") as f:
            while not stop.is_set():
                f.write(os.urandom(4096))
                f.flush()
                wrote.set()
                stop.wait(pause)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        assert wrote.wait(30)
        yield
    finally:
        stop.set()
        thread.join()


def test_final_pass_on_sigterm_lists_only_complete_files(s3_server, s3, tmp_path):
    run, key = _run_uri()
    ck, out = tmp_path / "ck", tmp_path / "out"
    (ck / "ckpt_temp_1a2b").mkdir(parents=True)
    out.mkdir()
    (ck / "ckpt-1.index").write_bytes(os.urandom(300))
    (ck / "ckpt-1.data-00000-of-00001").write_bytes(os.urandom(200_000))
    (ck / "checkpoint").write_text('model_checkpoint_path: "ckpt-1"\n')
    (ck / "checkpoint.tmp8d7f6e").write_text("half")  # TF's write-then-rename temporaries
    (ck / "ckpt_temp_1a2b" / "part-00000").write_bytes(b"shard")
    (out / "metrics.json").write_text('{"epochs": 1}')
    # a settle window well above any scheduling hiccup of the writer thread on a loaded machine
    proc = _sidecar(s3_server.env(), run, ck, out, "--interval", "0.3", "--quiet", "0.3", "--settle", "2")
    try:
        first = _wait_for(s3, key, lambda m: len(m["files"]) == 4)
        # (pass 1 may have come before every file was quiet on a loaded machine)
        assert first["complete"] and not first["final"]
        # a checkpoint file being written when SIGTERM arrives, at the pace of a slow writer
        with _writing(ck / "ckpt-2.data-00000-of-00001", pause=0.02):
            output = _stop(proc)
    finally:
        proc.kill()
    assert proc.returncode == 0, output
    passes = _passes(s3, key)
    final = passes[max(passes)]
    assert final["final"] and final["complete"] and final["pod"] == "unit-pod"
    assert sorted(passes) == list(range(1, max(passes) + 1))
    assert set(_listed(final)) == {
        "checkpoints/ckpt-1.index",
        "checkpoints/ckpt-1.data-00000-of-00001",
        "checkpoints/checkpoint",
        "output/metrics.json",
    }, output
    assert "ckpt-2.data-00000-of-00001" in output and "not listed" in output
    _check_bytes(s3, final)
    assert final["files"][0]["key"].startswith(f"{key}/checkpoints/")


def test_an_index_naming_a_checkpoint_still_written_between_pauses_keeps_the_last_complete_one(
    s3_server, s3, tmp_path
):
    """The files an index names hold still for the settle period after their uploads, all together:
    a data file written in bursts with pauses longer than its upload (so unchanged right after it)
    but shorter than the settle period keeps the new index, and itself, out of the final pass."""
    run, key = _run_uri()
    ck, out = tmp_path / "ck", tmp_path / "out"
    ck.mkdir()
    out.mkdir()
    (ck / "ckpt-1.index").write_bytes(os.urandom(300))
    (ck / "ckpt-1.data-00000-of-00001").write_bytes(os.urandom(50_000))
    first_index = 'model_checkpoint_path: "ckpt-1"\n'
    (ck / "checkpoint").write_text(first_index)
    proc = _sidecar(s3_server.env(), run, ck, out, "--interval", "0.3", "--quiet", "0.3", "--settle", "2")
    try:
        _wait_for(s3, key, lambda m: len(m["files"]) == 3)
        (ck / "ckpt-2.index").write_bytes(os.urandom(300))
        # pauses longer than an upload, shorter than the settle period
        with _writing(ck / "ckpt-2.data-00000-of-00001", pause=0.5):
            (ck / "checkpoint").write_text('model_checkpoint_path: "ckpt-2"\n')
            output = _stop(proc, timeout=60)
    finally:
        proc.kill()
    final = _final_pass(s3, key, proc, output)
    listed = _listed(final)
    assert "checkpoints/ckpt-2.data-00000-of-00001" not in listed, output
    # the index listed is the one that names the complete checkpoint, as its object in S3 holds it
    assert listed["checkpoints/checkpoint"] == hashlib.sha256(first_index.encode()).hexdigest(), output
    assert {"checkpoints/ckpt-1.index", "checkpoints/ckpt-1.data-00000-of-00001"} <= set(listed), output
    _check_bytes(s3, final)
    assert "not listed" in output


def test_a_final_pass_of_recent_files_with_one_worker_lists_them_all(s3_server, s3, tmp_path):
    """One worker (one file read and sent at a time) and every file recent when SIGTERM comes, among
    them indexes naming their checkpoints' files: the final pass lists the whole set."""
    run, key = _run_uri()
    ck, out = tmp_path / "ck", tmp_path / "out"
    (ck / "best").mkdir(parents=True)
    out.mkdir()
    proc = _sidecar(s3_server.env(), run, ck, out, "--interval", "600", "--quiet", "60", "--workers", "1")
    try:
        _wait_for(s3, key, lambda m: True)  # the start-up pass: nothing to upload yet
        for where in (ck, ck / "best"):
            (where / "ckpt-3.index").write_bytes(os.urandom(300))
            (where / "ckpt-3.data-00000-of-00001").write_bytes(os.urandom(60_000))
            (where / "checkpoint").write_text('model_checkpoint_path: "ckpt-3"\n')
        for i in range(12):
            (out / f"file-{i:02d}.json").write_text(json.dumps({"i": i}))
        output = _stop(proc, timeout=60)
    finally:
        proc.kill()
    final = _final_pass(s3, key, proc, output)
    assert set(_listed(final)) == {f"checkpoints/{k}" for k in tree(ck)} | {
        f"output/{k}" for k in tree(out)
    }, output
    _check_bytes(s3, final)


def test_sync_survives_faults_and_a_new_sidecar_continues(s3_server, s3, tmp_path):
    run, key = _run_uri()
    ck, out = tmp_path / "ck", tmp_path / "out"
    (ck / "nested").mkdir(parents=True)
    out.mkdir()
    for i in range(25):
        (ck / "nested" / f"shard-{i:02d}").write_bytes(os.urandom(1000 + 997 * i))
    (ck / "big.data").write_bytes(os.urandom(18 * 1024 * 1024))  # above the single-PUT limit: multipart
    with FaultProxy(s3_server.endpoint, fail_rate=0.2, seed=3) as proxy:
        env = {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
        # every module the sidecar imports is named in its output (python -X importtime)
        proc = _sidecar(
            {**env, "PYTHONPROFILEIMPORTTIME": "1"}, run, ck, out, "--interval", "0.3", "--quiet", "0"
        )
        try:
            _wait_for(s3, key, lambda m: len(m["files"]) == 26, timeout=60)
            (ck / "nested" / "shard-03").write_bytes(b"changed in place")
            (ck / "nested" / "shard-24").unlink()  # pruned by the trainer: drops out of the listing
            (out / "history.csv").write_text("epoch,loss\n1,0.5\n")
            new_sha = hashlib.sha256(b"changed in place").hexdigest()
            _wait_for(s3, key, lambda m: _listed(m).get("checkpoints/nested/shard-03") == new_sha, timeout=60)
            output = _stop(proc, timeout=40)
        finally:
            proc.kill()
        assert proc.returncode == 0, output
        imported = {
            line.rsplit("|", 1)[-1].strip() for line in output.splitlines() if line.startswith("import time:")
        }
        assert "awscrt.s3" in imported
        # with keys in the environment: listings, the multipart upload and the manifests through the CRT
        assert not {m for m in imported if m.split(".")[0] == "botocore"}, sorted(imported)
        output = "\n".join(line for line in output.splitlines() if not line.startswith("import time:"))
        assert {"503", "500", "reset"} <= {r.fault for r in proxy.records if r.fault}
        final = _passes(s3, key)[max(_passes(s3, key))]
        assert final["final"] and final["complete"], output
        assert _listed(final) == {f"checkpoints/{k}": v for k, v in tree(ck).items()} | {
            f"output/{k}": v for k, v in tree(out).items()
        }
        _check_bytes(s3, final)

        # a new pod's sidecar continues the numbering and uploads nothing already there
        proxy.records.clear()
        proc = _sidecar(env, run, ck, out, "--interval", "0.3", "--quiet", "0")
        lines = _Lines(proc)
        try:
            lines.wait(f"continuing after pass {final['pass']}")
            proc.send_signal(signal.SIGTERM)
            proc.wait(20)
            lines.thread.join(10)
            output = lines.text()
        finally:
            proc.kill()
        assert proc.returncode == 0, output
        passes = _passes(s3, key)
        assert passes[max(passes)]["pass"] == final["pass"] + 1
        assert _listed(passes[max(passes)]) == _listed(final)
        puts = {r.path for r in proxy.records if r.method == "PUT" and r.status == 200}
        assert puts == {f"/training/{key}/sync/pass-{final['pass'] + 1:08d}.json"}


@pytest.mark.parametrize("refused", [False, True], ids=["part-crc32c", "store-refuses-part-checksums"])
def test_a_large_file_goes_in_parts_the_store_checks(s3_server, s3, tmp_path, refused):
    """Each part with its CRC32C; where the store refuses part checksums, each signed with its SHA-256."""
    import base64

    from awscrt.checksums import crc32c

    run, key = _run_uri()
    ck, out = tmp_path / "ck", tmp_path / "out"
    ck.mkdir()
    out.mkdir()
    big = os.urandom(18 * 1024 * 1024)  # above the single-PUT limit: two parts of 16 MiB and 2 MiB
    (ck / "big.data").write_bytes(big)
    refuse = "x-amz-checksum-algorithm" if refused else None
    with FaultProxy(s3_server.endpoint, fail_rate=0.0, refuse_header=refuse) as proxy:
        proc = _sidecar(
            {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint},
            run,
            ck,
            out,
            "--interval",
            "60",
            "--quiet",
            "0",
        )
        try:
            _wait_for(s3, key, lambda m: len(m["files"]) == 1)
            output = _stop(proc)
        finally:
            proc.kill()
    final = _final_pass(s3, key, proc, output)
    _check_bytes(s3, final)
    parts = [big[: 16 * 1024 * 1024], big[16 * 1024 * 1024 :]]
    sent = [r for r in proxy.records if r.method == "PUT" and "uploadId=" in r.path and r.status == 200]
    assert len(sent) == 2, output
    if refused:
        assert "the store refused part checksums (InvalidArgument)" in output
        assert [r.headers.get("x-amz-content-sha256") for r in sent] == [
            hashlib.sha256(d).hexdigest() for d in parts
        ]
        assert not any("x-amz-checksum-crc32c" in r.headers for r in sent)
    else:
        assert "refused" not in output
        assert [r.headers.get("x-amz-checksum-crc32c") for r in sent] == [
            base64.b64encode(crc32c(d).to_bytes(4, "big")).decode() for d in parts
        ]


def test_persistent_failure_is_recorded_and_the_sidecar_keeps_going(s3_server, s3, tmp_path):
    run, key = _run_uri()
    ck, out = tmp_path / "ck", tmp_path / "out"
    ck.mkdir()
    out.mkdir()
    (ck / "good.index").write_bytes(b"good")
    (ck / "poison.data").write_bytes(b"never lands")
    with FaultProxy(s3_server.endpoint, fail_rate=0.0, always_fail="poison") as proxy:
        env = {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint, "AWS_MAX_ATTEMPTS": "2"}
        proc = _sidecar(env, run, ck, out, "--interval", "0.3", "--quiet", "0")
        try:
            failed = _wait_for(s3, key, lambda m: not m["complete"], timeout=30)
            assert proc.poll() is None  # a failed upload never kills the sidecar
            output = _stop(proc)
        finally:
            proc.kill()
    assert proc.returncode == 0, output
    assert set(_listed(failed)) == {"checkpoints/good.index"}
    assert [(e["area"], e["path"]) for e in failed["errors"]] == [("checkpoints", "poison.data")]
    assert "503" in failed["errors"][0]["error"] or "SlowDown" in failed["errors"][0]["error"]
    final = _passes(s3, key)[max(_passes(s3, key))]
    assert final["final"] and not final["complete"] and final["errors"][0]["path"] == "poison.data"
    assert "ERROR: checkpoints/poison.data could not be uploaded" in output


def _put_pass(
    s3,
    key: str,
    number: int,
    files: dict[str, bytes],
    *,
    upload: bool = True,
    complete: bool = True,
    metadata: bool = True,
) -> None:
    entries = []
    for rel, data in files.items():
        area, path = rel.split("/", 1)
        sha = hashlib.sha256(data).hexdigest()
        object_key = f"{key}/{area}/{path}"
        if upload:
            s3.put_object(
                Bucket="training", Key=object_key, Body=data, Metadata={"sha256": sha} if metadata else {}
            )
        entries.append({"area": area, "path": path, "key": object_key, "size": len(data), "sha256": sha})
    manifest = {
        "kind": "kubetrain/sync-pass",
        "format_version": 1,
        "pass": number,
        "final": False,
        "complete": complete,
        "started_at": "2026-11-22T04:00:00Z",
        "finished_at": "2026-11-22T04:00:01Z",
        "pod": "old-pod",
        "files": entries,
        "errors": [] if complete else [{"area": "checkpoints", "path": "x", "error": "boom"}],
    }
    s3.put_object(
        Bucket="training", Key=f"{key}/sync/pass-{number:08d}.json", Body=json.dumps(manifest).encode()
    )


def test_restore_never_trusts_a_pass_whose_manifest_did_not_land(s3_server, s3, tmp_path):
    run, key = _run_uri()
    a, b1 = b"a" * 1000, b"b1" * 500
    _put_pass(s3, key, 1, {"checkpoints/a.index": a})
    _put_pass(s3, key, 2, {"checkpoints/a.index": a, "checkpoints/b.data": b1, "output/metrics.json": b"{}"})
    # pass 3 replaced b.data and added c.data, then died before writing its manifest
    s3.put_object(
        Bucket="training",
        Key=f"{key}/checkpoints/b.data",
        Body=b"b3" * 500,
        Metadata={"sha256": hashlib.sha256(b"b3" * 500).hexdigest()},
    )
    s3.put_object(Bucket="training", Key=f"{key}/checkpoints/c.data", Body=b"c3")
    ck = tmp_path / "ck"
    result = run_sync(["restore", "--run-uri", run, "--checkpoint-dir", str(ck)], s3_server.env())
    assert result.returncode == 0, result.stderr
    assert "pass 2 no longer verifies" in result.stderr and "b.data" in result.stderr
    assert tree(ck) == {"a.index": hashlib.sha256(a).hexdigest()}

    # a newer manifest that says it is incomplete is skipped as well
    _put_pass(s3, key, 4, {"checkpoints/d.data": b"d"}, complete=False)
    # and content without sha256 metadata is still checked byte by byte after download
    _put_pass(s3, key, 5, {"checkpoints/e.data": b"e" * 100}, metadata=False)
    s3.put_object(Bucket="training", Key=f"{key}/checkpoints/e.data", Body=b"E" * 100)
    ck2 = tmp_path / "ck2"
    result = run_sync(["restore", "--run-uri", run, "--checkpoint-dir", str(ck2)], s3_server.env())
    assert result.returncode == 0, result.stderr
    assert "pass 5 no longer verifies" in result.stderr and "sha256 mismatch" in result.stderr
    assert "pass 4 is incomplete" in result.stderr
    assert tree(ck2) == {"a.index": hashlib.sha256(a).hexdigest()}
    assert not any(n.startswith(".kubetrain") for n in os.listdir(ck2))


def test_restore_checks_a_large_file_against_its_sha256_in_the_engine(s3_server, s3, tmp_path):
    """A file of more than one GET (8 MiB) is checked against the manifest's sha256 by the engine as
    its ranges arrive; one corrupted on the way fails its pass, and the pass before is restored."""
    run, key = _run_uri()
    index, big = b"i" * 100, os.urandom(9 * 1024 * 1024 + 4321)
    _put_pass(s3, key, 1, {"checkpoints/ckpt.index": index})
    _put_pass(s3, key, 2, {"checkpoints/ckpt.index": index, "checkpoints/ckpt.data": big})
    ck = tmp_path / "ck"
    result = run_sync(["restore", "--run-uri", run, "--checkpoint-dir", str(ck)], s3_server.env())
    assert result.returncode == 0, result.stderr
    assert (ck / "ckpt.data").read_bytes() == big

    big_key = f"{key}/checkpoints/ckpt.data"
    ck2 = tmp_path / "ck2"
    with FaultProxy(s3_server.endpoint, fail_rate=0.0, corrupt=big_key) as proxy:
        result = run_sync(
            ["restore", "--run-uri", run, "--checkpoint-dir", str(ck2)],
            {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint},
        )
        corrupted = sum(1 for r in proxy.records if r.fault == "corrupt")
    assert corrupted >= 1
    assert result.returncode == 0, result.stderr
    sha = hashlib.sha256(big).hexdigest()
    # the engine's words: Python's own check would say what the content gave
    assert (
        f"pass 2 no longer verifies (s3://training/{big_key}: sha256 mismatch: the content does not give "
        f"the manifest's sha256 {sha}; refused)" in result.stderr
    )
    assert tree(ck2) == {"ckpt.index": hashlib.sha256(index).hexdigest()}
    assert not any(n.startswith(".kubetrain") for n in os.listdir(ck2))


def test_restore_areas_and_stage_in_resume(s3_server, s3, tmp_path):
    run, key = _run_uri()
    files = {
        "checkpoints/ckpt-3.index": os.urandom(100),
        "checkpoints/sub/ckpt-3.data": os.urandom(5000),
        "output/metrics.json": b'{"final": {}}',
    }
    _put_pass(s3, key, 7, files)
    ck, out = tmp_path / "ck", tmp_path / "out"
    result = run_sync(
        [
            "restore",
            "--run-uri",
            run,
            "--checkpoint-dir",
            str(ck),
            "--output-dir",
            str(out),
            "--area",
            "checkpoints",
            "--area",
            "output",
        ],
        s3_server.env(),
    )
    assert result.returncode == 0, result.stderr
    assert tree(ck) == {
        k.split("/", 1)[1]: hashlib.sha256(v).hexdigest() for k, v in files.items() if "ckpt" in k
    }
    assert tree(out) == {"metrics.json": hashlib.sha256(files["output/metrics.json"]).hexdigest()}
    assert "restore: done: 3 objects" in result.stderr

    # stage-in restores the checkpoints area of KUBETRAIN_RUN_URI after the dataset
    prefix = f"tiny-{secrets.token_hex(3)}/"
    s3.put_object(Bucket="datasets", Key=f"{prefix}x.csv", Body=b"a,b\n1,2\n")
    manifest = put_manifest(s3, dataset_manifest(s3, "datasets", prefix, "tiny"))
    data, ck2 = tmp_path / "data", tmp_path / "ck2"
    env = {
        **s3_server.env(),
        "KUBETRAIN_DATASET_MANIFEST": manifest,
        "KUBETRAIN_RUN_URI": run,
        "DATA_DIR": str(data),
        "CHECKPOINT_DIR": str(ck2),
    }
    result = run_sync(["stage-in"], env)
    assert result.returncode == 0, result.stderr
    assert tree(data) == {"x.csv": hashlib.sha256(b"a,b\n1,2\n").hexdigest()}
    assert tree(ck2) == tree(ck)
