"""Safe archive extraction: every unsafe case is refused, naming the member, and leaves nothing."""

from __future__ import annotations

import gzip
import io
import os
import stat
import struct
import tarfile
import tracemalloc
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


# -- issue #31: hostile archives from the outside review -----------------------------------------

DEPTH = 12  # deep enough that, from any DATA_DIR up to 12 levels down, the chain reaches "/"
DEEP = "/".join(f"d{i}" for i in range(1, DEPTH + 1))
UPS = "/".join([".."] * DEPTH)
# each link passes a check on its text alone: up -> the extraction root, root -> DEEP/up/.. x 12,
# which reads as "d1" but, through up, climbs 12 levels above the extraction root
CHAIN = [(f"{DEEP}/up", UPS), ("root", f"{DEEP}/up/{UPS}")]


def _links_outside(root: Path) -> list[str]:
    """Every link below ``root`` that resolves outside it."""
    real = os.path.realpath(root)
    out = []
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            if os.path.islink(p) and os.path.commonpath([real, os.path.realpath(p)]) != real:
                out.append(p)
    return out


def _chain_archive(path: Path, links: list[tuple[str, str]]) -> None:
    if path.name.endswith(".zip"):
        _zip(path, [(*GOOD, REG), *((name, t.encode(), stat.S_IFLNK | 0o777) for name, t in links)])
    else:
        _tar(path, [GOOD, *(_special(name, tarfile.SYMTYPE, t) for name, t in links)])


@pytest.mark.parametrize("name", ["chain.tar.gz", "chain.zip"])
@pytest.mark.parametrize("order", ["up-first", "root-first"])
def test_symlink_chain_escape_is_refused(tmp_path, name, order):
    data = tmp_path / "data"
    data.mkdir()
    links = CHAIN if order == "up-first" else CHAIN[::-1]
    _chain_archive(data / name, links)
    with pytest.raises(ArchiveError) as err:
        extract(data / name, ExtractLimits())
    # root-first: root is checked again once up exists, before anything is moved into place
    message = str(err.value)
    assert (
        f"member 'root': link to {CHAIN[1][1]!r} escapes the target through the link '{DEEP}/up'" in message
    )
    assert os.listdir(data) == [name] and os.listdir(tmp_path) == ["data"]
    assert _links_outside(tmp_path) == []


def test_symlink_chain_across_two_archives_is_refused(tmp_path):
    """The second archive's link would redirect the first one's (or go through it): refused either way."""
    for first, second, member in ((CHAIN[0], CHAIN[1], "root"), (CHAIN[1], CHAIN[0], f"{DEEP}/up")):
        data = tmp_path / member.replace("/", "_")
        data.mkdir()
        _chain_archive(data / "one.tar", [first])
        _chain_archive(data / "two.zip", [second])
        extract(data / "one.tar", ExtractLimits())
        before = sorted(os.listdir(data))
        with pytest.raises(ArchiveError, match=f"archive two.zip: member '{member}': .*escape") as err:
            extract(data / "two.zip", ExtractLimits())
        assert "escapes the target" in str(err.value)
        assert sorted(os.listdir(data)) == before
        assert not os.path.lexists(data / second[0])
        assert _links_outside(tmp_path) == []


def test_links_through_links_inside_the_target_still_extract(tmp_path):
    archive = tmp_path / "ok.tar.gz"
    _tar(
        archive,
        [
            ("real/a.txt", b"a"),
            _special("d1/d2/up", tarfile.SYMTYPE, "../.."),
            _special("alias", tarfile.SYMTYPE, "d1/d2/up/real/a.txt"),
        ],
    )
    assert extract(archive, ExtractLimits()) == 3
    assert (tmp_path / "alias").read_text() == "a"
    assert _links_outside(tmp_path) == []


def _pax_tar(path: Path, name: str, pax: dict[str, str], link: str | None = None) -> None:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        tf.addfile(tarfile.TarInfo(GOOD[0]), io.BytesIO(b""))
        info = tarfile.TarInfo(name)
        info.pax_headers = pax
        if link is None:
            info.size = 1
            tf.addfile(info, io.BytesIO(b"x"))
        else:
            info.type, info.linkname = tarfile.SYMTYPE, link
            tf.addfile(info)


NUL_CASES = [
    # id, archive name, builder, member, reason
    (
        "tar-pax-path",
        "a.tar",
        lambda p: _pax_tar(p, "x.txt", {"path": "ok/a\x00b.txt"}),
        "ok/a\x00b.txt",
        "NUL byte in the name",
    ),
    (
        "tar-pax-linkpath",
        "a.tar",
        lambda p: _pax_tar(p, "ok/l", {"linkpath": "first.txt\x00/../../etc"}, link="x"),
        "ok/l",
        "NUL byte in the link target 'first.txt\\x00/../../etc'",
    ),
    (
        "zip-link-target",
        "a.zip",
        lambda p: _zip(p, [(*GOOD, REG), ("ok/l", b"first.txt\x00/../../etc", stat.S_IFLNK | 0o777)]),
        "ok/l",
        "NUL byte in the link target 'first.txt\\x00/../../etc'",
    ),
]


@pytest.mark.parametrize(
    ("name", "builder", "member", "reason"), [c[1:] for c in NUL_CASES], ids=[c[0] for c in NUL_CASES]
)
def test_nul_bytes_are_refused_naming_the_member(tmp_path, name, builder, member, reason):
    archive = tmp_path / name
    builder(archive)
    with pytest.raises(ArchiveError) as err:
        extract(archive, ExtractLimits())
    assert f"member {member!r}: {reason}; refused" in str(err.value)
    assert os.listdir(tmp_path) == [name]


def test_zip_link_target_is_read_only_up_to_the_limit(tmp_path, monkeypatch):
    """A link entry is read up to its limit (+1 byte to see it is longer), never whole."""
    archive = tmp_path / "a.zip"
    # 1,000 KiB: within the ratio floor, so only the link's own limit stops it
    _zip(archive, [("ok/l", b"a/" * (500 * 1024), stat.S_IFLNK | 0o777)])
    reads: list[int] = []
    real_read = zipfile.ZipExtFile.read

    def read(self, n=-1):
        reads.append(n)
        return real_read(self, n)

    monkeypatch.setattr(zipfile.ZipExtFile, "read", read)
    with pytest.raises(ArchiveError) as err:
        extract(archive, ExtractLimits())
    assert "member 'ok/l': link target longer than 4,095 bytes; refused" in str(err.value)
    assert reads and all(0 <= n <= 4096 for n in reads)
    assert os.listdir(tmp_path) == ["a.zip"]


def test_many_small_members_hit_the_whole_archive_limit(tmp_path):
    """The review's zip: 300 members of 1 MiB of zeros, each under the per-member floor (about 340 KB)."""
    archive = tmp_path / "zeros.zip"
    _zip(archive, [(f"z/{i:03d}.bin", bytes(1024 * 1024), REG) for i in range(300)])
    size = archive.stat().st_size
    assert size < 400_000
    with pytest.raises(ArchiveError) as err:
        extract(archive, ExtractLimits())
    budget = int(size * 250)
    refused = budget // (1024 * 1024)  # the first member that would take the total past 250x
    message = str(err.value)
    assert (
        f"member 'z/{refused:03d}.bin': archive expands beyond {budget:,} bytes, the whole-archive ratio "
        f"limit (250x its {size:,} compressed bytes, at least 1,048,576): archive bomb?; refused" in message
    )
    assert os.listdir(tmp_path) == ["zeros.zip"]  # nothing of the first members is left


def test_whole_archive_limit_has_a_floor(tmp_path):
    """A small archive may expand past 250x up to 1 MiB: a member of 1 MiB of zeros, in a zip and a tar.gz."""
    for name, build in (
        ("z.zip", lambda p: _zip(p, [("zeros.bin", bytes(1024 * 1024), REG)])),
        ("z.tar.gz", lambda p: _tar(p, [("zeros.bin", bytes(1024 * 1024 - 1024))])),
    ):
        target = tmp_path / name.replace(".", "_")
        target.mkdir()
        build(target / name)
        assert (target / name).stat().st_size * 250 < 1024 * 1024
        assert extract(target / name, ExtractLimits()) == 1
        assert (target / "zeros.bin").stat().st_size > 1000 * 1024


def test_whole_archive_limit_follows_the_ratio_setting(tmp_path):
    archive = tmp_path / "zeros.zip"
    _zip(archive, [(f"z/{i}.bin", bytes(512 * 1024), REG) for i in range(40)])
    with pytest.raises(ArchiveError, match="whole-archive ratio limit"):
        extract(archive, ExtractLimits())
    assert extract(archive, ExtractLimits(max_ratio=10_000)) == 40


def _dir(name: str) -> tarfile.TarInfo:
    return _special(name, tarfile.DIRTYPE)


COLLISIONS = [
    # id, members, member named, reason
    ("dir-then-file", [GOOD, _dir("d"), ("d", b"x")], "d", "collides with an earlier directory"),
    ("file-then-dir", [GOOD, ("d", b"x"), _dir("d")], "d", "collides with an earlier directory, file"),
    ("file-then-child", [GOOD, ("d", b"x"), ("d/x", b"y")], "d/x", "its directory 'd' is a file"),
    ("file-then-grandchild", [GOOD, ("d", b"x"), ("d/e/x", b"y")], "d/e/x", "its directory 'd' is a file"),
    ("dir-then-link", [GOOD, _dir("d"), _special("d", tarfile.SYMTYPE, "ok")], "d", "collides with"),
]


@pytest.mark.parametrize(
    ("members", "member", "reason"), [c[1:] for c in COLLISIONS], ids=[c[0] for c in COLLISIONS]
)
def test_tar_member_colliding_with_a_directory_is_refused_naming_it(tmp_path, members, member, reason):
    target = tmp_path / "target"
    target.mkdir()
    _tar(target / "a.tar", members, "w")
    with pytest.raises(ArchiveError) as err:
        extract(target / "a.tar", ExtractLimits())
    message = str(err.value)
    assert message.startswith(f"archive a.tar: member {member!r}: ") and reason in message
    assert ".kubetrain-extract" not in message and str(tmp_path) not in message
    assert os.listdir(target) == ["a.tar"] and os.listdir(tmp_path) == ["target"]


def test_stage_in_refuses_the_chain_and_the_zip_of_zeros(s3_server, tmp_path):
    """Through the real tool: exit 1 naming the member, DATA_DIR as it was, no link out of it."""
    s3 = s3_client(s3_server)
    chain, zeros = tmp_path / "chain.tar.gz", tmp_path / "zeros.zip"
    _chain_archive(chain, CHAIN)
    _zip(zeros, [(f"z/{i:03d}.bin", bytes(1024 * 1024), REG) for i in range(300)])
    for archive, expected in (
        (chain, f"archive chain.tar.gz: member 'root': link to {CHAIN[1][1]!r} escapes the target"),
        (zeros, "archive zeros.zip: member 'z/"),
    ):
        prefix = f"hostile-{archive.stem}-{os.getpid()}/"
        s3.put_object(Bucket="datasets", Key=f"{prefix}plain.txt", Body=b"plain")
        s3.put_object(Bucket="datasets", Key=f"{prefix}{archive.name}", Body=archive.read_bytes())
        uri = put_manifest(s3, dataset_manifest(s3, "datasets", prefix, archive.stem.split(".")[0]))
        data = tmp_path / f"data-{archive.stem}"
        data.mkdir()
        (data / "kept.txt").write_text("kept")
        result = run_sync(["stage-in", "--manifest", uri, "--data-dir", str(data)], s3_server.env())
        assert result.returncode == 1, result.stderr
        assert expected in result.stderr and "Traceback" not in result.stderr
        assert os.listdir(data) == ["kept.txt"]
        assert _links_outside(tmp_path) == []


# -- issue #53 items 4 and 5: floods of members, damaged archives ---------------------------------
# (the hostile cases themselves are in tests/test_hostile_inputs.py, "Archives, continued")


def _copies_of_one_directory(path: Path, n: int) -> None:
    """A tar.gz of ``n`` members, each the directory d: members tarfile reads, no inodes."""
    d = _special("d", tarfile.DIRTYPE)
    path.write_bytes(gzip.compress(d.tobuf(tarfile.USTAR_FORMAT) * n + bytes(10240), mtime=0))


def test_memory_does_not_grow_with_the_members_of_a_tar(tmp_path):
    """tarfile keeps every member it reads (TarFile.members): the extractor drops them as they come."""
    peaks = {}
    for n in (3_000, 9_000):
        target = tmp_path / str(n)
        target.mkdir()
        _copies_of_one_directory(target / "d.tar.gz", n)
        tracemalloc.start()
        try:
            assert extract(target / "d.tar.gz", ExtractLimits()) == n
            peaks[n] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peaks[9_000] - peaks[3_000] < 200_000, peaks  # before: 1.5 MB more (about 260 bytes a member)


@pytest.mark.parametrize("mode", ["w:xz", "w:bz2"])
def test_xz_and_bzip2_tars_extract_and_a_truncated_one_is_refused(tmp_path, mode):
    archive = tmp_path / "a.tar"
    _tar(archive, [("x/a.txt", b"a" * 5000), ("x/b.txt", os.urandom(50_000))], mode)
    whole = archive.read_bytes()
    assert extract(archive, ExtractLimits()) == 2 and (tmp_path / "x/a.txt").read_bytes() == b"a" * 5000
    target = tmp_path / "cut"
    target.mkdir()
    (target / "a.tar").write_bytes(whole[: len(whole) - 20])
    with pytest.raises(ArchiveError) as err:
        extract(target / "a.tar", ExtractLimits())
    kind = "xz" if mode == "w:xz" else "bzip2"
    assert f"the {kind} stream is truncated or damaged" in str(err.value)
    assert os.listdir(target) == ["a.tar"]


def _zip_bytes(names: list[str]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name in names:
            zf.writestr(name, name.encode())
    return buf.getvalue()


@pytest.mark.parametrize("shape", ["comment", "prefix", "zip64"])
def test_the_central_directory_walk_finds_what_zipfile_finds(tmp_path, shape):
    """A comment after the end record, data before the zip (a self-extractor's stub), zip64 end records."""
    data = _zip_bytes(["a.txt", "d/b.txt"])
    if shape == "comment":
        data = data[:-2] + struct.pack("<H", 300) + b"a comment of 300 bytes".ljust(300, b".")
    elif shape == "prefix":
        data = b"#!/bin/sh\nexit 0\n" * 100 + data
    else:
        body, end = data[:-22], data[-22:]
        _, _, _, _, _, cd_size, cd_offset, _ = struct.unpack("<4s4H2LH", end)
        record = struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, 2, 2, cd_size, cd_offset)
        locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, len(body), 1)
        end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
        data = body + record + locator + end
    (tmp_path / "a.zip").write_bytes(data)
    assert len(zipfile.ZipFile(tmp_path / "a.zip").infolist()) == 2
    assert extract(tmp_path / "a.zip", ExtractLimits()) == 2
    assert (tmp_path / "d/b.txt").read_bytes() == b"d/b.txt"


def test_a_tar_replaces_a_hard_link_and_links_only_to_its_files(tmp_path):
    """Without a set of every path: what is a file in the fresh extraction directory is the archive's."""
    archive = tmp_path / "a.tar"
    _tar(archive, [("a", b"first"), _special("b", tarfile.LNKTYPE, "a"), ("b", b"second")], "w")
    assert extract(archive, ExtractLimits()) == 3
    assert (tmp_path / "a").read_bytes() == b"first" and (tmp_path / "b").read_bytes() == b"second"
    target = tmp_path / "dir"
    target.mkdir()
    _tar(target / "a.tar", [_special("d", tarfile.DIRTYPE), _special("h", tarfile.LNKTYPE, "d")], "w")
    with pytest.raises(
        ArchiveError, match=r"member 'h': hard link to 'd', which is not a file of this archive"
    ):
        extract(target / "a.tar", ExtractLimits())


def test_extract_limits_check_themselves():
    with pytest.raises(ValueError, match="min_member_bytes -1 must be 0"):
        ExtractLimits(min_member_bytes=-1)
    assert ExtractLimits().min_member_bytes == 8


def test_stage_in_refuses_a_damaged_tar_and_passes_the_member_density_setting(s3_server, tmp_path):
    """Through the real tool: a tar.gz cut at a header boundary, and --min-extract-member-bytes."""
    s3 = s3_client(s3_server)
    cut = tmp_path / "cut.tar.gz"
    whole = io.BytesIO()
    with tarfile.open(fileobj=whole, mode="w") as tf:
        for name, body in (("a.txt", b"a"), ("b.txt", b"b")):
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tf.addfile(info, io.BytesIO(body))
    cut.write_bytes(gzip.compress(whole.getvalue()[:1024], mtime=0))  # a, then nothing: no b, no end
    flood = tmp_path / "flood.tar.gz"
    _copies_of_one_directory(flood, 12_001)
    runs = [
        (
            cut,
            [],
            1,
            "archive cut.tar.gz: member 'a.txt': the archive is truncated at byte 1,024, after this member",
        ),
        (flood, [], 1, "more than 10,000 members (member-density limit: one member per 8 bytes of its"),
        (flood, ["--min-extract-member-bytes", "0"], 0, "1 archives extracted (12,001 members)"),
    ]
    for i, (archive, flags, code, expected) in enumerate(runs):
        prefix = f"damaged-{i}-{os.getpid()}/"
        s3.put_object(Bucket="datasets", Key=f"{prefix}plain.txt", Body=b"plain")
        s3.put_object(Bucket="datasets", Key=f"{prefix}{archive.name}", Body=archive.read_bytes())
        uri = put_manifest(s3, dataset_manifest(s3, "datasets", prefix, f"damaged{i}"))
        data = tmp_path / f"data-{i}"
        data.mkdir()
        (data / "kept.txt").write_text("kept")
        result = run_sync(["stage-in", "--manifest", uri, "--data-dir", str(data), *flags], s3_server.env())
        assert result.returncode == code, result.stderr
        assert expected in result.stderr and "Traceback" not in result.stderr
        if code:
            assert os.listdir(data) == ["kept.txt"]
        else:
            assert sorted(os.listdir(data)) == ["d", "kept.txt", "plain.txt"]
