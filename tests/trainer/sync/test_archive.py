"""Safe archive extraction: every unsafe case is refused, naming the member, and leaves nothing."""

from __future__ import annotations

import io
import os
import stat
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
from sync_support import dataset_manifest, put_manifest, run_sync, s3_client, tree

from trainer.sync.archive import ArchiveError, ExtractLimits, extract


def _zip(path: Path, members: list[tuple[str, bytes, int]]) -> None:
    """members: (name, data, unix mode including the file type bits)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data, mode in members:
            info = zipfile.ZipInfo(name)
            info.external_attr = mode << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data)


def _tar(path: Path, members: list[tarfile.TarInfo | tuple[str, bytes]], mode: str = "w:gz") -> None:
    with tarfile.open(path, mode) as tf:
        for m in members:
            if isinstance(m, tarfile.TarInfo):
                tf.addfile(m)
            else:
                info = tarfile.TarInfo(m[0])
                info.size = len(m[1])
                tf.addfile(info, io.BytesIO(m[1]))


def _special(name: str, kind: bytes, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    return info


REG = stat.S_IFREG | 0o644
GOOD = ("ok/first.txt", b"fine\n")

CASES: list[tuple[str, str, Callable[[Path], None], str, str]] = [
    # id, archive name, builder, member named in the error, reason in the error
    (
        "zip-absolute",
        "a.zip",
        lambda p: _zip(p, [(*GOOD, REG), ("/tmp/evil", b"x", REG)]),
        "/tmp/evil",
        "absolute path",
    ),
    (
        "zip-dotdot",
        "a.zip",
        lambda p: _zip(p, [(*GOOD, REG), ("ok/../../evil", b"x", REG)]),
        "ok/../../evil",
        "'..'",
    ),
    ("zip-backslash-dotdot", "a.zip", lambda p: _zip(p, [("..\\evil", b"x", REG)]), "..\\evil", "'..'"),
    (
        "zip-symlink-escape",
        "a.zip",
        lambda p: _zip(p, [(*GOOD, REG), ("ok/link", b"../../etc", stat.S_IFLNK | 0o777)]),
        "ok/link",
        "escapes the target",
    ),
    (
        "zip-symlink-absolute",
        "a.zip",
        lambda p: _zip(p, [("link", b"/etc/passwd", stat.S_IFLNK | 0o777)]),
        "link",
        "escapes the target",
    ),
    (
        "zip-fifo",
        "a.zip",
        lambda p: _zip(p, [(*GOOD, REG), ("pipe", b"", stat.S_IFIFO | 0o644)]),
        "pipe",
        "FIFO",
    ),
    (
        "zip-bomb-ratio",
        "a.zip",
        lambda p: _zip(p, [(*GOOD, REG), ("zeros.bin", bytes(20 * 1024 * 1024), REG)]),
        "zeros.bin",
        "ratio limit",
    ),
    (
        "tar-absolute",
        "a.tar.gz",
        lambda p: _tar(p, [GOOD, ("/etc/evil", b"x")]),
        "/etc/evil",
        "absolute path",
    ),
    ("tar-dotdot", "a.tgz", lambda p: _tar(p, [GOOD, ("../evil", b"x")]), "../evil", "'..'"),
    (
        "tar-symlink-escape",
        "a.tar",
        lambda p: _tar(p, [GOOD, _special("ok/up", tarfile.SYMTYPE, "../../..")], "w"),
        "ok/up",
        "escapes the target",
    ),
    (
        "tar-symlink-absolute",
        "a.tar.gz",
        lambda p: _tar(p, [_special("etc", tarfile.SYMTYPE, "/etc")]),
        "etc",
        "escapes the target",
    ),
    (
        "tar-write-through-link",
        "a.tar.gz",
        lambda p: _tar(p, [GOOD, _special("here", tarfile.SYMTYPE, "ok"), ("here/x.txt", b"x")]),
        "here/x.txt",
        "goes through the link here",
    ),
    (
        "tar-hardlink-escape",
        "a.tar.gz",
        lambda p: _tar(p, [GOOD, _special("ok/passwd", tarfile.LNKTYPE, "/etc/passwd")]),
        "ok/passwd",
        "hard link to '/etc/passwd'",
    ),
    (
        "tar-char-device",
        "a.tar.gz",
        lambda p: _tar(p, [GOOD, _special("dev/null", tarfile.CHRTYPE)]),
        "dev/null",
        "device file",
    ),
    (
        "tar-block-device",
        "a.tar.gz",
        lambda p: _tar(p, [_special("dev/sda", tarfile.BLKTYPE)]),
        "dev/sda",
        "device file",
    ),
    ("tar-fifo", "a.tar.gz", lambda p: _tar(p, [GOOD, _special("pipe", tarfile.FIFOTYPE)]), "pipe", "FIFO"),
    (
        "tar-gz-bomb-ratio",
        "a.tar.gz",
        lambda p: _tar(p, [GOOD, ("zeros.bin", bytes(30 * 1024 * 1024))]),
        "zeros.bin",
        "ratio limit",
    ),
]


@pytest.mark.parametrize(
    ("name", "builder", "member", "reason"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_unsafe_archives_are_refused(tmp_path, name, builder, member, reason):
    target = tmp_path / "target"
    target.mkdir()
    archive = target / name
    builder(archive)
    with pytest.raises(ArchiveError) as err:
        extract(archive, ExtractLimits())
    message = str(err.value)
    assert f"member {member!r}" in message and reason in message and "refused" in message
    assert os.listdir(target) == [name]  # nothing extracted, no temporary directory left
    assert os.listdir(tmp_path) == ["target"]  # nothing written beside the target either


def test_total_size_limit(tmp_path):
    archive = tmp_path / "big.tar"
    _tar(archive, [("a.bin", os.urandom(700_000)), ("b.bin", os.urandom(700_000))], "w")
    with pytest.raises(ArchiveError, match=r"member 'b.bin'.*size limit"):
        extract(archive, ExtractLimits(max_bytes=1_000_000))
    assert os.listdir(tmp_path) == ["big.tar"]


def test_member_count_limit(tmp_path):
    archive = tmp_path / "many.zip"
    _zip(archive, [(f"f{i}", b"x", REG) for i in range(5)])
    with pytest.raises(ArchiveError, match=r"member 'f3'.*more than 3 members"):
        extract(archive, ExtractLimits(max_members=3))


def test_safe_archive_with_inner_link_extracts(tmp_path):
    archive = tmp_path / "good.tar.gz"
    _tar(
        archive,
        [
            ("d/a.txt", b"a"),
            _special("d/alias.txt", tarfile.SYMTYPE, "a.txt"),
            _special("d/hard.txt", tarfile.LNKTYPE, "d/a.txt"),
            ("d/e/b.txt", b"b"),
        ],
    )
    assert extract(archive, ExtractLimits()) == 4
    assert (tmp_path / "d/alias.txt").read_text() == "a" and os.readlink(tmp_path / "d/alias.txt") == "a.txt"
    assert (tmp_path / "d/hard.txt").read_text() == "a"
    assert (tmp_path / "d/e/b.txt").read_text() == "b"


def test_stage_in_with_an_unsafe_archive_changes_nothing(s3_server, tmp_path):
    s3 = s3_client(s3_server)
    bad = tmp_path / "bad.zip"
    _zip(bad, [(*GOOD, REG), ("../../outside.txt", b"x", REG)])
    prefix = f"unsafe-{os.getpid()}/"
    s3.put_object(Bucket="datasets", Key=f"{prefix}plain.txt", Body=b"plain")
    s3.put_object(Bucket="datasets", Key=f"{prefix}bad.zip", Body=bad.read_bytes())
    uri = put_manifest(s3, dataset_manifest(s3, "datasets", prefix, "unsafe"))
    data = tmp_path / "data"
    data.mkdir()
    (data / "kept.txt").write_text("kept")
    result = run_sync(["stage-in", "--manifest", uri, "--data-dir", str(data)], s3_server.env())
    assert result.returncode == 1
    assert "archive bad.zip: member '../../outside.txt': path with '..'; refused" in result.stderr
    assert tree(data) == {"kept.txt": tree(data)["kept.txt"]} and os.listdir(data) == ["kept.txt"]
    assert not (tmp_path / "outside.txt").exists()
