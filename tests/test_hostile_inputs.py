"""The hostile-input catalogue: what an attacker (or a careless user) can hand kubetrain, and what it does.

One section per area, each a table-driven test (one ``@pytest.mark.parametrize`` table with
ids), each case asserting the exact refusal (a fragment of the message, naming what was
refused) or the confinement (what was written stays where it belongs). A new finding
becomes a row here before it is fixed.

Areas:

* archives: the dataset archives stage-in extracts into DATA_DIR (trainer/sync/archive.py;
  the rules are in trainer/sync/README.md, "Stage-in"). Issue #31 items 3 and 6; damaged
  archives and member floods (issue #53 items 4 and 5) at the end of the file.

Sections for Params (trigger-form values), UI requests and images follow below, each
with its own header and its own helpers; then issue #53's: registries (realms, redirects, upload
Locations, hosts), Params against the API server's rules and the form's schema, links read from
run records, stopping rules with reports that are not finite numbers (against Optuna's pruners),
and damaged archives and member floods.

Runs under the Airflow environment (.venv): what it imports from the pod side
(trainer.sync.archive) is standard library only.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import tarfile
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from trainer.sync.archive import ArchiveError, ExtractLimits, extract

# ==========================================================================================
# Archives: stage-in's extraction of dataset archives (trainer/sync/archive.py)
# ==========================================================================================
#
# Every case extracts one archive into an empty directory. A refused case names the member
# (repr) and the reason, and leaves nothing but the archive: no member, no temporary
# directory, nothing beside it. An accepted case is checked for what it wrote; after every
# case nothing lies outside the directory, no link resolves outside it, and no file has a
# setuid, setgid or sticky bit or is a device or FIFO.

_ARC_REG = stat.S_IFREG | 0o644
_ARC_LNK = stat.S_IFLNK | 0o777
_ARC_OK = ("ok/first.txt", b"fine\n")
_ARC_MIB = 1024 * 1024
# a chain of links that each pass a check on their text alone: up -> the extraction root,
# root -> DEEP/up/.. x 12 (reads as "d1"), which through up climbs 12 levels: to "/"
_ARC_DEEP = "/".join(f"d{i}" for i in range(1, 13))
_ARC_UPS = "/".join([".."] * 12)
_ARC_CHAIN = [(f"{_ARC_DEEP}/up", _ARC_UPS), ("root", f"{_ARC_DEEP}/up/{_ARC_UPS}")]


def _arc_zip(members: list[tuple[str, bytes, int]]) -> Callable[[Path], None]:
    """A builder of a deflated zip; members: (name, data, unix mode with the file type bits)."""

    def build(path: Path) -> None:
        with warnings.catch_warnings(), zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
            warnings.simplefilter("ignore", UserWarning)  # zipfile warns of the duplicate names we want
            for name, data, mode in members:
                info = zipfile.ZipInfo(name)
                info.external_attr = mode << 16
                info.compress_type = zipfile.ZIP_DEFLATED
                zf.writestr(info, data)

    return build


def _arc_tar(members: list[tarfile.TarInfo | tuple[str, bytes]]) -> Callable[[Path], None]:
    """A builder of a tar (PAX format, so names and link targets are kept whole), gzipped for .gz."""

    def build(path: Path) -> None:
        mode = "w:gz" if path.name.endswith((".tar.gz", ".tgz")) else "w"
        with tarfile.open(path, mode, format=tarfile.PAX_FORMAT) as tf:
            for m in members:
                if isinstance(m, tarfile.TarInfo):
                    tf.addfile(m, io.BytesIO(b"x" * m.size) if m.isreg() else None)
                else:
                    info = tarfile.TarInfo(m[0])
                    info.size = len(m[1])
                    tf.addfile(info, io.BytesIO(m[1]))

    return build


def _arc_info(name: str, kind: bytes = tarfile.REGTYPE, *, link: str = "", mode: int = 0o644, pax=None):
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, mode
    info.size = 1 if kind == tarfile.REGTYPE else 0
    if pax:
        info.pax_headers = pax
    return info


def _arc_zip_nul_name(path: Path) -> None:
    """A zip whose stored name is 'evil.txt\\0.sh' (zipfile cannot write one: patched in place)."""
    _arc_zip([(*_ARC_OK, _ARC_REG), ("evil.txtX.sh", b"x", _ARC_REG)])(path)
    path.write_bytes(path.read_bytes().replace(b"evil.txtX.sh", b"evil.txt\0.sh"))


def _arc_mode_without_special_bits(rel: str) -> Callable[[Path], None]:
    def check(root: Path) -> None:
        st = os.lstat(root / rel)
        assert stat.S_ISREG(st.st_mode) and st.st_mode & 0o7000 == 0

    return check


def _arc_content(rel: str, data: bytes) -> Callable[[Path], None]:
    def check(root: Path) -> None:
        assert not (root / rel).is_symlink() and (root / rel).read_bytes() == data

    return check


_ARC_ZEROS = [(f"z/{i:03d}.bin", bytes(_ARC_MIB), _ARC_REG) for i in range(300)]

# id, archive file name, builder, limits (None: the defaults), then either
#   (member, fragment): refused, the message naming the member (a name ending in * : a prefix of
#       it) and holding the fragment, or
#   (None, check): accepted, check(directory) asserts what was written
ARCHIVE_CASES = [
    # -- paths out of the directory
    (
        "tar-absolute",
        "a.tar.gz",
        _arc_tar([_ARC_OK, ("/etc/evil", b"x")]),
        None,
        "/etc/evil",
        "absolute path",
    ),
    ("zip-absolute", "a.zip", _arc_zip([("/tmp/evil", b"x", _ARC_REG)]), None, "/tmp/evil", "absolute path"),
    ("zip-drive-letter", "a.zip", _arc_zip([("C:/evil", b"x", _ARC_REG)]), None, "C:/evil", "absolute path"),
    ("tar-dotdot", "a.tar", _arc_tar([_ARC_OK, ("ok/../../evil", b"x")]), None, "ok/../../evil", "'..'"),
    ("zip-backslash-dotdot", "a.zip", _arc_zip([("..\\evil", b"x", _ARC_REG)]), None, "..\\evil", "'..'"),
    # -- Unicode: names that become '..' or absolute once normalised (NFKC)
    (
        "zip-fullwidth-dots",
        "a.zip",
        _arc_zip([("\uff0e\uff0e/evil", b"x", _ARC_REG)]),
        None,
        "\uff0e\uff0e/evil",
        "path with '..' once Unicode-normalised (NFKC)",
    ),
    (
        "tar-one-dot-leader",
        "a.tar",
        _arc_tar([("\u2025/evil", b"x")]),
        None,
        "\u2025/evil",
        "path with '..' once Unicode-normalised (NFKC)",
    ),
    (
        "zip-fullwidth-solidus",
        "a.zip",
        _arc_zip([("\uff0fetc/passwd", b"x", _ARC_REG)]),
        None,
        "\uff0fetc/passwd",
        "absolute path once Unicode-normalised (NFKC)",
    ),
    (
        "tar-right-to-left-override",
        "a.tar",
        _arc_tar([("ok/gpj.\u202eexe", b"x")]),
        None,
        None,
        _arc_content("ok/gpj.\u202eexe", b"x"),
    ),
    # -- NUL bytes
    (
        "tar-nul-in-name",
        "a.tar",
        _arc_tar([_ARC_OK, _arc_info("x", pax={"path": "ok/a\x00b.txt"})]),
        None,
        "ok/a\x00b.txt",
        "NUL byte in the name",
    ),
    (
        "tar-nul-in-link-target",
        "a.tar",
        _arc_tar(
            [_ARC_OK, _arc_info("ok/l", tarfile.SYMTYPE, link="x", pax={"linkpath": "first.txt\x00/../.."})]
        ),
        None,
        "ok/l",
        "NUL byte in the link target 'first.txt\\x00/../..'",
    ),
    (
        "zip-nul-in-link-target",
        "a.zip",
        _arc_zip([(*_ARC_OK, _ARC_REG), ("ok/l", b"first.txt\x00/../..", _ARC_LNK)]),
        None,
        "ok/l",
        "NUL byte in the link target 'first.txt\\x00/../..'",
    ),
    # zipfile ends a stored name at its NUL, as unzip does: the file lands as 'evil.txt', inside
    ("zip-nul-in-name", "a.zip", _arc_zip_nul_name, None, None, _arc_content("evil.txt", b"x")),
    # -- links
    (
        "tar-symlink-escape",
        "a.tar",
        _arc_tar([_ARC_OK, _arc_info("ok/up", tarfile.SYMTYPE, link="../../..")]),
        None,
        "ok/up",
        "link to '../../..' escapes the target",
    ),
    (
        "zip-symlink-absolute",
        "a.zip",
        _arc_zip([("passwd", b"/etc/passwd", _ARC_LNK)]),
        None,
        "passwd",
        "link to the absolute path '/etc/passwd' escapes the target",
    ),
    (
        "tar-link-chain-12-levels",
        "a.tar.gz",
        _arc_tar([_ARC_OK, *(_arc_info(n, tarfile.SYMTYPE, link=t) for n, t in _ARC_CHAIN)]),
        None,
        "root",
        f"escapes the target through the link '{_ARC_DEEP}/up'",
    ),
    (
        "zip-link-chain-12-levels-reversed",
        "a.zip",
        _arc_zip([(n, t.encode(), _ARC_LNK) for n, t in reversed(_ARC_CHAIN)]),
        None,
        "root",
        f"escapes the target through the link '{_ARC_DEEP}/up'",
    ),
    (
        "zip-link-loop",
        "a.zip",
        _arc_zip([("a", b"b", _ARC_LNK), ("b", b"a", _ARC_LNK)]),
        None,
        "a",  # b is checked before a's chain closes; the final pass finds the loop from a
        "link to 'b' is a loop of links",
    ),
    (
        "tar-write-through-link",
        "a.tar.gz",
        _arc_tar([_ARC_OK, _arc_info("here", tarfile.SYMTYPE, link="ok"), ("here/x.txt", b"x")]),
        None,
        "here/x.txt",
        "path goes through the link here",
    ),
    (
        "tar-overwrite-link",
        "a.tar",
        _arc_tar([_ARC_OK, _arc_info("l", tarfile.SYMTYPE, link="ok/first.txt"), ("l", b"x")]),
        None,
        "l",
        "would overwrite a link",
    ),
    (
        "tar-hardlink-absolute",
        "a.tar.gz",
        _arc_tar([_ARC_OK, _arc_info("ok/passwd", tarfile.LNKTYPE, link="/etc/passwd")]),
        None,
        "ok/passwd",
        "hard link to '/etc/passwd', which is not a file of this archive",
    ),
    (
        "tar-hardlink-dotdot",
        "a.tar",
        _arc_tar([_ARC_OK, _arc_info("ok/h", tarfile.LNKTYPE, link="../outside")]),
        None,
        "ok/h",
        "hard link to '../outside', which is not a file of this archive",
    ),
    (
        "zip-link-target-too-long",
        "a.zip",
        _arc_zip([("ok/l", b"a/" * 2500, _ARC_LNK)]),
        None,
        "ok/l",
        "link target longer than 4,095 bytes",
    ),
    (
        "tar-link-target-too-long",
        "a.tar",
        _arc_tar([_arc_info("ok/l", tarfile.SYMTYPE, link="a/" * 2500)]),
        None,
        "ok/l",
        "link target longer than 4,095 bytes",
    ),
    # -- special files and modes
    (
        "tar-char-device",
        "a.tar.gz",
        _arc_tar([_ARC_OK, _arc_info("dev/null", tarfile.CHRTYPE)]),
        None,
        "dev/null",
        "device file or FIFO",
    ),
    (
        "tar-block-device",
        "a.tar",
        _arc_tar([_arc_info("dev/sda", tarfile.BLKTYPE)]),
        None,
        "dev/sda",
        "device file",
    ),
    (
        "tar-fifo",
        "a.tar",
        _arc_tar([_arc_info("pipe", tarfile.FIFOTYPE)]),
        None,
        "pipe",
        "device file or FIFO",
    ),
    (
        "zip-socket",
        "a.zip",
        _arc_zip([("sock", b"", stat.S_IFSOCK | 0o644)]),
        None,
        "sock",
        "device file, FIFO or socket",
    ),
    (
        "tar-setuid-setgid-sticky",
        "a.tar",
        _arc_tar([_arc_info("bin/su", mode=0o7755)]),
        None,
        None,
        _arc_mode_without_special_bits("bin/su"),
    ),
    (
        "zip-setuid",
        "a.zip",
        _arc_zip([("bin/su", b"x", stat.S_IFREG | 0o4755)]),
        None,
        None,
        _arc_mode_without_special_bits("bin/su"),
    ),
    # -- bombs and sizes
    (
        "zip-member-ratio",
        "a.zip",
        _arc_zip([(*_ARC_OK, _ARC_REG), ("zeros.bin", bytes(20 * _ARC_MIB), _ARC_REG)]),
        None,
        "zeros.bin",
        "beyond the 250x ratio limit: archive bomb?",
    ),
    (
        "tar-gz-whole-stream-ratio",
        "a.tar.gz",
        _arc_tar([_ARC_OK, ("zeros.bin", bytes(30 * _ARC_MIB))]),
        None,
        "zeros.bin",
        "the whole-archive ratio limit (250x its",
    ),
    (
        "zip-300-members-of-zeros",
        "a.zip",
        _arc_zip(_ARC_ZEROS),
        None,
        "z/*",  # the first member past 250x the archive's size (its number depends on zlib)
        "the whole-archive ratio limit (250x its",
    ),
    (
        "zip-total-size",
        "a.zip",
        _arc_zip([("a.bin", os.urandom(600_000), _ARC_REG), ("b.bin", os.urandom(600_000), _ARC_REG)]),
        ExtractLimits(max_bytes=1_000_000),
        "b.bin",
        "archive expands beyond 1,000,000 bytes (size limit)",
    ),
    (
        "tar-many-members",
        "a.tar",
        _arc_tar([(f"m/{i}", b"") for i in range(101)]),
        ExtractLimits(max_members=100),
        "m/100",
        "more than 100 members (limit)",
    ),
    # -- names that collide
    (
        "zip-duplicate-name",
        "a.zip",
        _arc_zip([("ok/x", b"first", _ARC_REG), ("ok/x", b"second", _ARC_REG)]),
        None,
        "ok/x",
        "appears twice",
    ),
    # tar's rule: a later member of the same name replaces the earlier one
    (
        "tar-duplicate-name",
        "a.tar",
        _arc_tar([("ok/x", b"first"), ("ok/x", b"second")]),
        None,
        None,
        _arc_content("ok/x", b"second"),
    ),
    (
        "tar-file-over-directory",
        "a.tar",
        _arc_tar([_ARC_OK, _arc_info("d", tarfile.DIRTYPE), ("d", b"x")]),
        None,
        "d",
        "collides with an earlier directory",
    ),
    (
        "tar-directory-over-file",
        "a.tar",
        _arc_tar([_ARC_OK, ("d", b"x"), _arc_info("d", tarfile.DIRTYPE)]),
        None,
        "d",
        "collides with an earlier directory, file or link",
    ),
    (
        "tar-member-under-a-file",
        "a.tar",
        _arc_tar([_ARC_OK, ("d", b"x"), ("d/e/x", b"y")]),
        None,
        "d/e/x",
        "its directory 'd' is a file",
    ),
]


def _arc_confined(root: Path) -> None:
    """Nothing below ``root`` resolves outside it, nor is special."""
    real = os.path.realpath(root)
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            assert not (stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) or stat.S_ISFIFO(st.st_mode)), (
                path
            )
            assert st.st_mode & 0o7000 == 0, path
            if stat.S_ISLNK(st.st_mode):
                assert os.path.commonpath([real, os.path.realpath(path)]) == real, path


@pytest.mark.parametrize(
    ("name", "build", "limits", "member", "expect"),
    [c[1:] for c in ARCHIVE_CASES],
    ids=[c[0] for c in ARCHIVE_CASES],
)
def test_hostile_archive(tmp_path, name, build, limits, member, expect):
    target = tmp_path / "data"
    target.mkdir()
    archive = target / name
    build(archive)
    if member is None:
        extract(archive, limits or ExtractLimits())
        expect(target)
    else:
        with pytest.raises(ArchiveError) as err:
            extract(archive, limits or ExtractLimits())
        message = str(err.value)
        named = f"member {member[:-1]!r}"[:-1] if member.endswith("*") else f"member {member!r}: "
        assert message.startswith(f"archive {name}: {named}")
        assert expect in message and message.endswith("; refused")
        assert ".kubetrain-extract" not in message  # the member is named, not a temporary path
        assert os.listdir(target) == [name]  # nothing extracted, no temporary directory left
    assert os.listdir(tmp_path) == ["data"]  # nothing written beside the directory
    _arc_confined(tmp_path)


# ==========================================================================================
# Params: values a user who may trigger a DAG types into its trigger form
# ==========================================================================================
#
# A Param reaches the stage task (dataset_uri) or the pod spec (tolerations, sizes). A refused
# value fails with a message that names it and what was expected; nothing is staged or created.


def _par_source(uri: str, *, allowed=("s3://datasets/",), narrowed=()) -> Callable[[], object]:
    from kubetrain.s3_layout import check_dataset_source

    return lambda: check_dataset_source(uri, allowed=allowed, training_bucket="training", narrowed=narrowed)


def _par_tolerations(value) -> Callable[[], object]:
    from kubetrain.pod_spec import TrainingPodConfig

    def build():
        items = json.loads(value) if isinstance(value, str) else value
        return TrainingPodConfig(
            image="r:5000/t:1", sync_image="r:5000/s:1", run_uri="s3://training/runs/d/r", tolerations=items
        )

    return build


def _par_pod(**changes) -> Callable[[], object]:
    from kubetrain.pod_spec import TrainingPodConfig, training_pod

    return lambda: training_pod(
        TrainingPodConfig(
            image="r:5000/t:1", sync_image="r:5000/s:1", run_uri="s3://training/runs/d/r", **changes
        )
    )


PARAM_CASES = [
    # (id, call, exception, message fragment)
    (
        "dataset-in-training-runs",
        _par_source("s3://training/runs/"),
        ValueError,
        "dataset 's3://training/runs/' is inside kubetrain's own area of the training bucket",
    ),
    (
        "dataset-in-training-models",
        _par_source("s3://training/models/digits/"),
        ValueError,
        "dataset 's3://training/models/digits/' is inside kubetrain's own area",
    ),
    (
        "dataset-in-another-bucket-area",
        _par_source("s3://training/team-data/"),
        ValueError,
        "'s3://training/team-data/' is outside the deployment's dataset prefixes (s3://datasets/)",
    ),
    (
        "dataset-runs-even-if-allowed",
        _par_source("s3://training/runs/x/", allowed=("s3://training/",)),
        ValueError,
        "inside kubetrain's own area of the training bucket",
    ),
    (
        "dataset-models-even-if-allowed",
        _par_source("s3://training/models", allowed=("s3://training/",)),
        ValueError,
        "inside kubetrain's own area of the training bucket",
    ),
    (
        "dataset-whole-training-bucket",
        _par_source("s3://training/", allowed=("s3://training/",)),
        ValueError,
        "inside kubetrain's own area",
    ),
    (
        "dataset-other-bucket",
        _par_source("s3://other-team/data/"),
        ValueError,
        "'s3://other-team/data/' is outside the deployment's dataset prefixes (s3://datasets/)",
    ),
    (
        "dataset-dotdot-segment",
        _par_source("s3://datasets/../training/runs/"),
        ValueError,
        "has a '.' or '..' segment",
    ),
    (
        "dataset-prefix-boundary",
        _par_source("s3://datasets/team-a-evil/", allowed=("s3://datasets/team-a",)),
        ValueError,
        "outside the deployment's dataset prefixes (s3://datasets/team-a)",
    ),
    (
        "dataset-outside-the-dags-own",
        _par_source("s3://datasets/team-b/x/", narrowed=("s3://datasets/team-a/",)),
        ValueError,
        "outside this DAG's dataset prefixes",
    ),
    (
        "dag-prefix-widens-the-deployment",
        _par_source("s3://datasets/a/", allowed=("s3://datasets/a/",), narrowed=("s3://training/",)),
        ValueError,
        "is outside the deployment's",
    ),
    ("dataset-not-s3", _par_source("file:///etc/passwd"), ValueError, "is not an S3 URI"),
    ("dataset-bad-bucket", _par_source("s3://UPPER/x/"), ValueError, "bucket name 'UPPER' is not valid"),
    (
        "toleration-bogus-operator",
        _par_tolerations('[{"key": "a", "operator": "Bogus"}]'),
        ValueError,
        "operator 'Bogus' must be Equal or Exists",
    ),
    (
        "toleration-unknown-field",
        _par_tolerations('[{"key": "a", "operator": "Exists", "sneaky": 1}]'),
        ValueError,
        "unknown field(s) sneaky",
    ),
    (
        "toleration-bad-effect",
        _par_tolerations([{"key": "a", "operator": "Exists", "effect": "Evict"}]),
        ValueError,
        "effect 'Evict' must be NoSchedule",
    ),
    (
        "toleration-exists-with-value",
        _par_tolerations([{"key": "a", "operator": "Exists", "value": "x"}]),
        ValueError,
        "value must be empty when operator is Exists",
    ),
    (
        "toleration-empty-key-equal",
        _par_tolerations([{"operator": "Equal", "value": "x"}]),
        ValueError,
        "an empty key needs operator Exists",
    ),
    (
        "toleration-seconds-not-noexecute",
        _par_tolerations([{"key": "a", "operator": "Exists", "tolerationSeconds": 5}]),
        ValueError,
        "tolerationSeconds applies only with effect NoExecute",
    ),
    (
        "toleration-seconds-text",
        _par_tolerations(
            [{"key": "a", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": "5; rm -rf /"}]
        ),
        ValueError,
        "tolerationSeconds must be a whole number",
    ),
    ("toleration-not-an-object", _par_tolerations(["spot"]), ValueError, "not a V1Toleration or a mapping"),
    (
        "data-size-not-a-quantity",
        _par_pod(dataset_bytes=1, data_size="lots"),
        ValueError,
        "data_size='lots' is not a Kubernetes quantity",
    ),
    ("dataset-bytes-negative", _par_pod(dataset_bytes="-5"), ValueError, "dataset_bytes"),
]


@pytest.mark.parametrize(
    ("call", "error", "message"), [c[1:] for c in PARAM_CASES], ids=[c[0] for c in PARAM_CASES]
)
def test_hostile_param(call, error, message):
    with pytest.raises(error) as err:
        call()
    assert message in str(err.value)


def test_a_hostile_dataset_uri_fails_the_stage_task_without_a_retry(monkeypatch):
    """The rule is applied by the stage task itself, before it lists anything."""
    from airflow.sdk.exceptions import AirflowFailException

    from kubetrain.operators.stage import StageDatasetOperator

    monkeypatch.setenv("KUBETRAIN_DATASET_PREFIXES", "s3://datasets/team-a/")
    op = StageDatasetOperator(
        task_id="stage", source_uri="s3://training/runs/other_dag/", allowed_prefixes=()
    )
    with pytest.raises(AirflowFailException, match="inside kubetrain's own area of the training bucket"):
        op.check_source()
    op = StageDatasetOperator(task_id="stage2", source_uri="s3://datasets/team-b/x/")
    with pytest.raises(
        AirflowFailException, match=r"outside the deployment's dataset prefixes \(s3://datasets/team-a/\)"
    ):
        op.check_source()
    StageDatasetOperator(task_id="stage3", source_uri="s3://datasets/team-a/digits/").check_source()


# ==========================================================================================
# UI requests: what a logged-in viewer can ask the Training page for
# ==========================================================================================
#
# The viewer may read DAG ui_team_a only. Another team's runs, models and promoted pointers are
# answered as if they did not exist; a malformed request is refused naming the value.


@pytest.fixture(scope="module")
def _ui_queries(s3_server):
    from datetime import timedelta

    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

    from kubetrain.run_store import RunStore
    from kubetrain.s3_layout import S3Layout
    from kubetrain.ui.queries import TrainingQueries
    from tests.plugins.ui.training_records import T0, make_record

    aws = {
        "conn_type": "aws",
        "login": s3_server.access_key_id,
        "password": s3_server.secret_access_key,
        "extra": {"endpoint_url": s3_server.endpoint, "region_name": s3_server.region},
    }
    saved = {k: os.environ.get(k) for k in ("AIRFLOW_CONN_AWS_DEFAULT", "KUBETRAIN_TRAINING_BUCKET")}
    os.environ["AIRFLOW_CONN_AWS_DEFAULT"] = json.dumps(aws)
    os.environ.pop("KUBETRAIN_TRAINING_BUCKET", None)
    store = RunStore(S3Hook(aws_conn_id="aws_default"), S3Layout())
    tag = os.urandom(3).hex()
    records = {}
    for name, dag, model in (
        ("mine", "ui_team_a", f"shared-{tag}"),
        ("theirs", "ui_team_b", f"shared-{tag}"),
        ("secret", "ui_team_b", f"secret-{tag}"),
    ):
        record = make_record(
            dag_id=dag, run_id=f"manual__{tag}-{name}", model=model, when=T0 + timedelta(minutes=len(records))
        )
        store.runs.write(record)
        records[name] = record
    theirs = S3Layout().run("ui_team_b", records["theirs"]["run_id"])
    store.write_json(
        "training",
        S3Layout().model_latest_key(f"shared-{tag}"),
        {
            "kind": "kubetrain/model-pointer",
            "format_version": 1,
            "model": f"shared-{tag}",
            "version": "v9",
            "uri": f"s3://training/models/shared-{tag}/v9/",
            "run_uri": theirs.uri,
            "sync_pass": 1,
            "files": [],
            "promoted_at": "2026-01-01T00:00:00Z",
        },
    )
    try:
        yield TrainingQueries(store, ["ui_team_a"]), records, tag
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _ui(call: Callable) -> Callable:
    return call


UI_CASES = [
    # (id, call(queries, records, tag), exception name, message fragment)
    ("record-of-another-team", lambda q, r, t: q.record(_ui_ref(r["theirs"])), "NotVisible", "ui_team_b"),
    (
        "compare-with-another-teams-run",
        lambda q, r, t: q.compare([_ui_ref(r["mine"]), _ui_ref(r["theirs"])]),
        "NotVisible",
        "",
    ),
    ("ref-with-traversal", lambda q, r, t: q.record("ui_team_a/../ui_team_b/manual__x"), "QueryError", ""),
    ("ref-not-a-ref", lambda q, r, t: q.record("%2e%2e"), "QueryError", ""),
    (
        "leaderboard-of-a-hidden-model",
        lambda q, r, t: q.leaderboard(f"secret-{t}"),
        "ModelNotVisible",
        "that you may read",
    ),
    (
        "promotions-of-a-hidden-model",
        lambda q, r, t: q.promotions(f"secret-{t}"),
        "ModelNotVisible",
        "that you may read",
    ),
    (
        "leaderboard-of-a-model-with-slash",
        lambda q, r, t: q.leaderboard("../index"),
        "QueryError",
        "'../index'",
    ),
    (
        "runs-after-a-foreign-key",
        lambda q, r, t: q.runs(_ui_filter(), after="runs/ui_team_b/x"),
        "QueryError",
        "is not a key of the run index",
    ),
    ("runs-limit-zero", lambda q, r, t: q.runs(_ui_filter(), limit=0), "QueryError", "limit=0 is not valid"),
    ("runs-limit-huge", lambda q, r, t: q.runs(_ui_filter(), limit=10**9), "QueryError", "is not valid"),
    (
        "sweep-of-another-team",
        lambda q, r, t: q.sweep(
            model=f"shared-{t}", dag_id="ui_team_b", run_id=r["theirs"]["run_id"], run_time="0"
        ),
        "NotVisible",
        "",
    ),
    (
        "metric-not-on-the-board",
        lambda q, r, t: q.leaderboard(f"shared-{t}", metric="../../x"),
        "QueryError",
        "has no leaderboard for metric",
    ),
]


def _ui_ref(record: dict) -> str:
    from kubetrain.ui.queries import record_ref

    return record_ref(record)


def _ui_filter():
    from kubetrain.ui.queries import RunFilter

    return RunFilter()


@pytest.mark.parametrize(
    ("call", "error", "message"), [c[1:] for c in UI_CASES], ids=[c[0] for c in UI_CASES]
)
def test_hostile_ui_request(_ui_queries, call, error, message):
    queries, records, tag = _ui_queries
    with pytest.raises(Exception) as err:  # noqa: PT011 - the class is checked by name below
        call(queries, records, tag)
    assert type(err.value).__name__ == error, repr(err.value)
    assert message in str(err.value)


def test_the_viewer_sees_only_its_teams_models_and_no_foreign_pointer(_ui_queries):
    queries, records, tag = _ui_queries
    models = queries.models()
    assert f"shared-{tag}" in models and f"secret-{tag}" not in models
    board = queries.leaderboard(f"shared-{tag}")
    assert board.promoted is None  # the pointer names ui_team_b's run
    assert [e["dag_id"] for e in board.entries] == ["ui_team_a"]


# ==========================================================================================
# Images: image references and registries the worker is pointed at (the image Param)
# ==========================================================================================
#
# Pinning an image contacts its registry from the Airflow worker. A registry may answer with a
# Bearer challenge: the worker follows only realms on the registry's own host or the trusted
# token services, and never echoes a foreign body in an error.


class _ImgServer:
    """A loopback HTTP server answering every request with ``answer(path)``; records the paths."""

    def __init__(self, answer) -> None:
        import http.server
        import threading

        seen = self.seen = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                seen.append(self.path)
                status, headers, body = answer(self.path)
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_HEAD = do_GET  # noqa: N815

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


SECRET_BODY = b"<html>internal admin console: root password hunter2</html>"


def _img_registry(realm: Callable[[int], str] | None = None, body: bytes = b"") -> Callable:
    """A registry whose /v2/ answers 401 with a Bearer realm (from the other server's port), or 500 with ``body``."""

    def start(other_port: int) -> _ImgServer:
        def answer(path):
            if realm is not None:
                return 401, {"WWW-Authenticate": f'Bearer realm="{realm(other_port)}",service="x"'}, b"{}"
            return 500, {"Content-Type": "text/html"}, body

        return _ImgServer(answer)

    return start


IMAGE_CASES = [
    # (id, registry factory, exception name, message fragment)
    (
        "realm-at-another-local-port",
        _img_registry(lambda p: f"http://127.0.0.1:{p}/token"),
        "ImageNotFoundError",
        "which is neither the registry's own host nor a trusted token service: refused, nothing was sent there",
    ),
    (
        "realm-at-localhost-name",
        _img_registry(lambda p: f"http://localhost:{p}/latest/meta-data/"),
        "ImageNotFoundError",
        "points its Bearer realm at http://localhost",
    ),
    (
        "realm-at-metadata-service",
        _img_registry(lambda p: "http://169.254.169.254/latest/meta-data/iam/"),
        "ImageNotFoundError",
        "http://169.254.169.254:80, which is neither",
    ),
    (
        "realm-file-scheme",
        _img_registry(lambda p: "file:///etc/passwd"),
        "ImageNotFoundError",
        "a Bearer realm that is not an http(s) URL: refused",
    ),
    (
        "realm-https-other-host",
        _img_registry(lambda p: f"https://127.0.0.2:{p}/token"),
        "ImageNotFoundError",
        "https://127.0.0.2",
    ),
    ("error-answer-of-a-registry", _img_registry(body=SECRET_BODY), "ImageResolutionError", "HTTP 500"),
]


@pytest.mark.parametrize(
    ("factory", "error", "message"), [c[1:] for c in IMAGE_CASES], ids=[c[0] for c in IMAGE_CASES]
)
def test_hostile_registry(monkeypatch, factory, error, message):
    from kubetrain.images import pin_image

    monkeypatch.delenv("KUBETRAIN_TOKEN_SERVICES", raising=False)
    other = _ImgServer(lambda path: (200, {"Content-Type": "application/json"}, SECRET_BODY))
    registry = factory(other.port)
    try:
        with pytest.raises(Exception) as err:  # noqa: PT011 - the class is checked by name below
            pin_image(
                f"127.0.0.1:{registry.port}/team/trainer:latest", registry_conn_id="no_such_registry_conn"
            )
    finally:
        registry.close()
        other.close()
    assert type(err.value).__name__ == error, repr(err.value)
    assert message in str(err.value)
    assert other.seen == []  # nothing reached the other server
    assert b"hunter2".decode() not in str(err.value)


IMAGE_REFERENCE_CASES = [
    ("uppercase-repository", "127.0.0.1:5000/Team/trainer:1", "invalid repository name 'Team/trainer'"),
    ("dotdot-repository", "127.0.0.1:5000/team/../trainer:1", "invalid repository name 'team/../trainer'"),
    (
        "space-in-reference",
        "127.0.0.1:5000/team/trainer:1 --privileged",
        "invalid image tag '1 --privileged'",
    ),
    ("bad-digest", "127.0.0.1:5000/team/trainer@sha256:zz", "invalid digest 'sha256:zz'"),
    ("tag-too-long", "127.0.0.1:5000/team/trainer:" + "a" * 200, "expected 1 to 128 characters"),
]


@pytest.mark.parametrize(
    ("image", "message"), [c[1:] for c in IMAGE_REFERENCE_CASES], ids=[c[0] for c in IMAGE_REFERENCE_CASES]
)
def test_hostile_image_reference(image, message):
    """A malformed reference is refused before any registry is contacted."""
    from kubetrain.images import pin_image

    with pytest.raises(ValueError) as err:
        pin_image(image, registry_conn_id="no_such_registry_conn")
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("content_type", "body", "shown"),
    [
        ("text/html", SECRET_BODY, f"HTTP 502 (a text/html body of {len(SECRET_BODY)} bytes, not shown)"),
        ("application/json", b'{"errors": [{"code": "DENIED", "message": "no"}]}', "HTTP 502 DENIED: no"),
        (
            "application/json",
            b'{"error": "invalid_grant", "error_description": "expired"}',
            "HTTP 502 invalid_grant: expired",
        ),
        (
            "application/json",
            b'{"secret": "hunter2"}',
            "HTTP 502 (a application/json body of 21 bytes, not shown)",
        ),
    ],
    ids=["html", "registry-errors", "oauth-error", "other-json"],
)
def test_an_error_never_echoes_a_body_that_is_not_an_error_document(content_type, body, shown):
    import requests

    from kubetrain.imagebuild.registry_errors import error_detail

    response = requests.Response()
    response.status_code, response._content = 502, body
    response.headers["Content-Type"] = content_type
    assert error_detail(response) == shown


# ==========================================================================================
# Registries: realms, redirects and upload Locations (issue #53 items 1, 2 and 6)
# ==========================================================================================
#
# A registry named in the image Param answers the worker. Whatever URL it hands back (a Bearer realm, a
# redirect, an upload Location) is checked on the URL the HTTP client will send, the way urllib3 reads it,
# and refused when urlsplit reads another host out of it, or when the host is neither the registry's own nor
# a trusted service. Only a blob download follows a redirect; nothing else does. Every refused case runs a
# second loopback server (on 127.0.0.1, or on ::1) where the registry points, and checks that nothing reached
# it; an accepted blob redirect checks the bytes, that our Authorization went to the registry's host only,
# and that TransferStats counted every hop. A registry host outside distribution/reference's grammar is
# refused before any request.


class _RegServer:
    """A loopback HTTP server (``host`` 127.0.0.1 or ::1) answering every method with
    ``answer(method, path)``; records ``(method, path, headers)`` of what reached it."""

    def __init__(self, answer, host: str = "127.0.0.1") -> None:
        import http.server
        import socket
        import threading

        seen = self.seen = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                seen.append((self.command, self.path, dict(self.headers)))
                status, headers, body = answer(self.command, self.path)
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_HEAD = do_POST = do_PUT = do_DELETE = do_GET  # noqa: N815

            def log_message(self, *args):
                pass

        class Server(http.server.ThreadingHTTPServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        self.server = Server((host, 0), Handler)
        self.port = self.server.server_address[1]
        self.netloc = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"
        threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _reg_start_other(host: str, answer) -> _RegServer:
    """The server the registry points at; skips the case when the machine has no IPv6 loopback."""
    try:
        return _RegServer(answer, host)
    except OSError as exc:
        pytest.skip(f"no {host} loopback here: {exc}")


_REG_SECRET = b"<html>internal admin console: root password hunter2</html>"
_REG_BLOB = b'{"architecture":"amd64","os":"linux"}'
_REG_DIGEST = "sha256:" + hashlib.sha256(_REG_BLOB).hexdigest()
_REG_TOKEN = "reg-secret-token"


def _reg_redirect(status: int, prefix: str, to: str = "http://{other}/elsewhere"):
    """A registry redirecting requests under ``prefix`` to ``to`` (``{reg}`` and ``{other}`` filled in)."""

    def answer(method, path, reg, other):
        if path.startswith(prefix):
            return status, {"Location": to.format(reg=reg, other=other)}, b""
        return 404, {"Content-Type": "application/json"}, b'{"errors": [{"code": "NOT_FOUND"}]}'

    return answer


def _reg_realm(realm: str, token_answer=None):
    """A registry asking for a Bearer token at ``realm``; ``token_answer`` answers its own /token."""

    def answer(method, path, reg, other):
        if path.startswith("/token") and token_answer is not None:
            return token_answer(reg, other)
        challenge = f'Bearer realm="{realm.format(reg=reg, other=other)}",service="x"'
        return 401, {"WWW-Authenticate": challenge, "Content-Type": "application/json"}, b"{}"

    return answer


def _reg_pin(reg: str):
    from kubetrain.images import pin_image

    return pin_image(f"{reg}/team/trainer:latest", registry_conn_id="no_such_registry_conn")


def _reg_client(action):
    """A call opening a client with a ready token (sent on each request to the registry) to run ``action``."""

    def call(reg: str):
        from kubetrain.imagebuild.oci import RegistryClient

        with RegistryClient(reg, insecure=True, token=_REG_TOKEN, timeout=10) as client:
            return action(client)

    return call


def _reg_upload(client):
    from kubetrain.imagebuild.oci import OCI_LAYER_GZIP, Blob

    client.upload_blob("team/trainer", Blob.from_bytes(b"layer bytes", OCI_LAYER_GZIP))


_REG_BLOBS = "/v2/team/trainer/blobs/"
_REG_MANIFESTS = "/v2/team/trainer/manifests/"
_REG_UPLOADS = "/v2/team/trainer/blobs/uploads/"
_REG_PARSERS = (
    "whose host URL parsers read differently ({reg} to urlsplit, {other} to the HTTP client): refused, "
)
_REG_ELSEWHERE = (
    "(HTTP {code}) to http://{other}/elsewhere: refused, nothing was sent there (the distribution API"
)

REG_REFUSAL_CASES = [
    # (id, host of the other server, registry answer, call, exception name, message fragment)
    (
        "realm-backslash-reads-as-registry-host",
        "127.0.0.1",
        _reg_realm("http://{other}\\@{reg}/token"),
        _reg_pin,
        "ImageNotFoundError",
        _REG_PARSERS + "nothing was sent there",
    ),
    (
        "realm-on-registry-host-redirects-elsewhere",
        "127.0.0.1",
        _reg_realm(
            "http://{reg}/token", lambda reg, other: (302, {"Location": f"http://{other}/steal"}, b"")
        ),
        _reg_pin,
        "ImageNotFoundError",
        "token service http://{reg}/token of registry {reg} redirected the token request (HTTP 302) to "
        "http://{other}/steal: refused, nothing was sent there",
    ),
    *[
        (
            f"ping-{code}-to-{name}",
            host,
            _reg_redirect(code, "/v2/"),
            _reg_client(lambda c: c.ping()),
            "TargetRefused",
            "registry {reg} redirected GET /v2/ (API check) " + _REG_ELSEWHERE.replace("{code}", str(code)),
        )
        for code, host, name in (
            (301, "127.0.0.1", "other-port"),
            (302, "::1", "ipv6"),
            (307, "127.0.0.1", "other-port"),
        )
    ],
    *[
        (
            f"manifest-head-{code}-to-{name}",
            host,
            _reg_redirect(code, _REG_MANIFESTS),
            _reg_pin,
            "ImageNotFoundError",
            "registry {reg} redirected HEAD team/trainer:latest "
            + _REG_ELSEWHERE.replace("{code}", str(code)),
        )
        for code, host, name in ((301, "::1", "ipv6"), (302, "127.0.0.1", "other-port"), (307, "::1", "ipv6"))
    ],
    *[
        (
            f"manifest-get-{code}-to-{name}",
            host,
            _reg_redirect(code, _REG_MANIFESTS),
            _reg_client(lambda c: c.get_manifest("team/trainer", "latest")),
            "TargetRefused",
            "redirected image {reg}/team/trainer:latest " + _REG_ELSEWHERE.replace("{code}", str(code)),
        )
        for code, host, name in (
            (301, "127.0.0.1", "other-port"),
            (302, "::1", "ipv6"),
            (307, "127.0.0.1", "other-port"),
        )
    ],
    (
        "upload-location-on-another-port",
        "127.0.0.1",
        lambda method, path, reg, other: (202, {"Location": f"http://{other}/upload/1"}, b""),
        _reg_client(_reg_upload),
        "TargetRefused",
        "to team/trainer at http://{other}, which is neither the registry's own host nor a trusted upload "
        "host: refused, nothing was sent there",
    ),
    (
        "mount-answers-an-upload-location-on-ipv6",
        "::1",
        lambda method, path, reg, other: (202, {"Location": f"http://{other}/upload/1"}, b""),
        _reg_client(lambda c: c.mount_blob("team/trainer", _REG_DIGEST, "base/image")),
        "TargetRefused",
        "the upload Location for cancel upload of "
        + _REG_DIGEST
        + " to team/trainer at http://{other}, which is "
        "neither the registry's own host nor a trusted upload host: refused, nothing was sent there",
    ),
    *[
        (
            f"blob-get-{code}-to-{name}",
            host,
            _reg_redirect(code, _REG_BLOBS),
            _reg_client(lambda c: c.get_blob("team/trainer", _REG_DIGEST)),
            "TargetRefused",
            f"points its redirect of blob team/trainer@{_REG_DIGEST} at http://{{other}}, which is neither "
            "the registry's own host nor a trusted blob storage: refused, nothing was sent there",
        )
        for code, host, name in ((302, "127.0.0.1", "foreign-port"), (307, "::1", "foreign-ipv6"))
    ],
    (
        "blob-get-redirect-backslash-reads-as-registry-host",
        "127.0.0.1",
        _reg_redirect(307, _REG_BLOBS, "http://{other}\\@{reg}/storage"),
        _reg_client(lambda c: c.get_blob("team/trainer", _REG_DIGEST)),
        "TargetRefused",
        _REG_PARSERS + "nothing was sent there",
    ),
    (
        "blob-get-redirect-to-a-file-url",
        "127.0.0.1",
        _reg_redirect(302, _REG_BLOBS, "file:///etc/passwd"),
        _reg_client(lambda c: c.get_blob("team/trainer", _REG_DIGEST)),
        "TargetRefused",
        f"sent a redirect of blob team/trainer@{_REG_DIGEST} that is not an http(s) URL: refused",
    ),
    (
        "blob-get-redirect-loop-on-registry-host",
        "127.0.0.1",
        _reg_redirect(302, _REG_BLOBS, "http://{reg}" + _REG_BLOBS + _REG_DIGEST),
        _reg_client(lambda c: c.get_blob("team/trainer", _REG_DIGEST)),
        "TargetRefused",
        f"redirected blob team/trainer@{_REG_DIGEST} more than 5 times",
    ),
]


@pytest.mark.parametrize(
    ("other_host", "answer", "call", "error", "message"),
    [c[1:] for c in REG_REFUSAL_CASES],
    ids=[c[0] for c in REG_REFUSAL_CASES],
)
def test_hostile_registry_target(monkeypatch, other_host, answer, call, error, message):
    monkeypatch.delenv("KUBETRAIN_TOKEN_SERVICES", raising=False)
    other = _reg_start_other(
        other_host, lambda method, path: (200, {"Content-Type": "text/html"}, _REG_SECRET)
    )
    ports = {}
    registry = _RegServer(lambda method, path: answer(method, path, ports["reg"], other.netloc))
    ports["reg"] = registry.netloc
    try:
        with pytest.raises(Exception) as err:  # noqa: PT011 - the class is checked by name below
            call(registry.netloc)
    finally:
        registry.close()
        other.close()
    assert type(err.value).__name__ == error, repr(err.value)
    assert message.format(reg=registry.netloc, other=other.netloc) in str(err.value)
    assert other.seen == []  # nothing reached the other server
    assert "hunter2" not in str(err.value)


def _reg_storage(method, path):
    return (
        (200, {"Content-Type": "application/octet-stream"}, _REG_BLOB)
        if "storage" in path
        else (404, {}, b"")
    )


REG_BLOB_REDIRECT_CASES = [
    # (id, registry answer, other server in the token_services setting, requests to the registry, to it)
    (
        "to-a-host-of-the-token-services-setting",
        _reg_redirect(307, _REG_BLOBS, "http://{other}/storage/1?sig=abc"),
        True,
        1,
        1,
    ),
    (
        "relative-on-the-registry-host",
        lambda method, path, reg, other: (
            (302, {"Location": "/storage/1"}, b"")
            if path.startswith(_REG_BLOBS)
            else _reg_storage(method, path)
        ),
        False,
        2,
        0,
    ),
    (
        "registry-host-then-trusted-host",
        lambda method, path, reg, other: (
            (302, {"Location": "/hop"}, b"")
            if path.startswith(_REG_BLOBS)
            else (301, {"Location": f"http://{other}/storage/2"}, b"")
        ),
        True,
        2,
        1,
    ),
]


@pytest.mark.parametrize(
    ("answer", "trusted", "to_registry", "to_other"),
    [c[1:] for c in REG_BLOB_REDIRECT_CASES],
    ids=[c[0] for c in REG_BLOB_REDIRECT_CASES],
)
def test_a_blob_download_follows_a_redirect_to_an_allowed_host(
    monkeypatch, answer, trusted, to_registry, to_other
):
    """The one redirect the distribution spec expects: followed, bytes checked, credentials kept home."""
    from kubetrain.imagebuild.oci import RegistryClient

    other = _RegServer(_reg_storage)
    if trusted:
        monkeypatch.setenv("KUBETRAIN_TOKEN_SERVICES", f"http://{other.netloc}")
    else:
        monkeypatch.delenv("KUBETRAIN_TOKEN_SERVICES", raising=False)
    ports = {}
    registry = _RegServer(lambda method, path: answer(method, path, ports["reg"], other.netloc))
    ports["reg"] = registry.netloc
    try:
        with RegistryClient(registry.netloc, insecure=True, token=_REG_TOKEN, timeout=10) as client:
            assert client.get_blob("team/trainer", _REG_DIGEST) == _REG_BLOB
            stats = client.stats
    finally:
        registry.close()
        other.close()
    assert (len(registry.seen), len(other.seen)) == (to_registry, to_other)
    assert all(h.get("Authorization") == f"Bearer {_REG_TOKEN}" for _, _, h in registry.seen)
    assert all("Authorization" not in h for _, _, h in other.seen)  # our token never leaves the registry
    assert (stats.requests, stats.by_method, stats.bytes_received) == (
        to_registry + to_other,
        {"GET": to_registry + to_other},
        len(_REG_BLOB),
    )


REG_HOST_CASES = [
    # (id, image reference ({port}: the other server's), message fragment)
    (
        "non-ascii-host",
        "régistry.localhost:{port}/team/trainer:1",
        "invalid registry 'régistry.localhost:{port}'",
    ),
    (
        "non-ascii-host-with-digest",
        "régistry.localhost:{port}/team/trainer@sha256:" + "0" * 64,
        "invalid registry 'régistry.localhost:{port}'",
    ),
    (
        "backslash-host",
        "127.0.0.1:{port}\\@127.0.0.1:{port}/team/trainer:1",
        "invalid registry '127.0.0.1:{port}\\\\@127.0.0.1:{port}'",
    ),
    ("at-sign-host", "user@127.0.0.1:{port}/team/trainer:1", "invalid registry 'user@127.0.0.1:{port}'"),
    (
        "at-sign-host-with-digest",
        "user@127.0.0.1:{port}/team/trainer@sha256:" + "0" * 64,
        "invalid registry 'user@127.0.0.1:{port}'",
    ),
    ("empty-label", "127..0.0.1:{port}/team/trainer:1", "invalid registry '127..0.0.1:{port}'"),
    ("port-out-of-range", "127.0.0.1:99999/team/trainer:1", "invalid registry '127.0.0.1:99999'"),
]


@pytest.mark.parametrize(
    ("image", "message"), [c[1:] for c in REG_HOST_CASES], ids=[c[0] for c in REG_HOST_CASES]
)
def test_hostile_registry_host_in_an_image(image, message):
    """A registry host outside distribution/reference's grammar is refused before any registry is asked."""
    from kubetrain.images import pin_image

    other = _RegServer(lambda method, path: (200, {"Content-Type": "text/html"}, _REG_SECRET))
    try:
        with pytest.raises(ValueError) as err:
            pin_image(image.format(port=other.port), registry_conn_id="no_such_registry_conn")
    finally:
        other.close()
    assert message.format(port=other.port) in str(err.value)
    assert "the host is a DNS name of ASCII letters, digits and '-'" in str(err.value)
    assert other.seen == []  # nothing reached the other server


# ==========================================================================================
# Params reaching the pod spec, and links from run records (issue #53 items 6 and 7)
# ==========================================================================================
#
# Node selectors, tolerations and resource quantities are checked with the API server's own
# rules before any pod is built (kubetrain.settings: qualified names and label values;
# kubetrain.pod_sizing.quantity: quantities that fit an int64 as Kubernetes counts them, bytes
# or millicores), and the trigger form's JSON Schema refuses the same values. A refusal names
# the field and the value and says what was expected.
#
# A run record is a document in S3; its report_url and mlflow.url (and a sweep's trials'
# report_url) become links only when they are http(s) URLs or paths of the page's own origin;
# anything else is shown as text, its value only in the title.

_PRM_INT64 = 2**63 - 1
_PRM_POD = {"image": "r:5000/t:1", "sync_image": "r:5000/s:1", "run_uri": "s3://training/runs/d/r"}


def _prm_selector(value) -> Callable[[], object]:
    """What the training operator and the deployment's setting do with a node selector."""
    from kubetrain.settings import parse_node_selector

    return lambda: parse_node_selector(value)


def _prm_config(**changes) -> Callable[[], object]:
    from kubetrain.pod_spec import TrainingPodConfig

    return lambda: TrainingPodConfig(**_PRM_POD, **changes)


def _prm_pod(**changes) -> dict:
    """The pod spec (as the API server receives it) of a config with ``changes``."""
    from kubernetes.client import ApiClient

    from kubetrain.pod_spec import TrainingPodConfig, training_pod

    return ApiClient().sanitize_for_serialization(training_pod(TrainingPodConfig(**_PRM_POD, **changes)))


def _prm_toleration(**fields) -> Callable[[], object]:
    return _prm_config(tolerations=[fields])


PRM_REFUSED = [
    # (id, call, message fragment naming the field and the value)
    (
        "selector-value-too-long",
        _prm_selector({"pool": "g" * 64}),
        f"node_selector value {'g' * 64!r} of 'pool' is not a valid label value: it has 64 characters: "
        "expected at most 63",
    ),
    (
        "selector-value-space",
        _prm_selector({"pool": "a100 spot"}),
        "node_selector value 'a100 spot' of 'pool' is not a valid label value: expected empty or letters, "
        "digits, '-', '_' and '.', starting and ending with a letter or digit",
    ),
    (
        "selector-value-slash",
        _prm_selector({"pool": "gpu/a100"}),
        "node_selector value 'gpu/a100' of 'pool' is not a valid label value",
    ),
    (
        "selector-value-leading-dash",
        _prm_selector({"pool": "-gpu"}),
        "node_selector value '-gpu' of 'pool' is not a valid label value",
    ),
    (
        "selector-value-non-ascii",
        _prm_selector({"zone": "zürich-1"}),
        "node_selector value 'zürich-1' of 'zone' is not a valid label value",
    ),
    (
        "selector-value-trailing-newline",
        _prm_selector({"pool": "gpu\n"}),
        "node_selector value 'gpu\\n' of 'pool' is not a valid label value",
    ),
    (
        "selector-value-in-text-form",
        _prm_selector("pool=gpu,zone=a b"),
        "node_selector value 'a b' of 'zone' is not a valid label value",
    ),
    (
        "selector-key-two-slashes",
        _prm_selector({"example.com/pool/x": "gpu"}),
        "node_selector key 'example.com/pool/x' is not a valid label key: expected at most one '/'",
    ),
    (
        "selector-key-name-over-63",
        _prm_selector({"example.com/" + "n" * 64: "gpu"}),
        "is not a valid label key: its name part has 64 characters: expected at most 63",
    ),
    (
        "selector-key-prefix-over-253",
        _prm_selector({"a" * 254 + "/pool": "gpu"}),
        "is not a valid label key: its prefix has 254 characters: expected at most 253",
    ),
    (
        "selector-key-prefix-double-dot",
        _prm_selector({"example..com/pool": "gpu"}),
        "node_selector key 'example..com/pool' is not a valid label key: its prefix 'example..com' is not a "
        "DNS-1123 subdomain",
    ),
    (
        "selector-key-trailing-newline",
        _prm_selector({"pool\n": "gpu"}),
        "node_selector key 'pool\\n' is not a valid label key: its name part 'pool\\n' is not valid",
    ),
    (
        "toleration-key-space",
        _prm_toleration(key="spot instance", operator="Exists"),
        "key 'spot instance' is not a valid label key: its name part 'spot instance' is not valid",
    ),
    (
        "toleration-key-over-63",
        _prm_toleration(key="k" * 64, operator="Exists"),
        f"key {'k' * 64!r} is not a valid label key: its name part has 64 characters: expected at most 63",
    ),
    (
        "toleration-key-two-slashes",
        _prm_toleration(key="a.io/b/c", operator="Exists"),
        "key 'a.io/b/c' is not a valid label key: expected at most one '/'",
    ),
    (
        "toleration-value-slash",
        _prm_toleration(key="pool", operator="Equal", value="gpu/a100"),
        "value 'gpu/a100' is not a valid label value: expected empty or letters",
    ),
    (
        "toleration-value-non-ascii",
        _prm_toleration(key="zone", value="zürich"),
        "value 'zürich' is not a valid label value",
    ),
    (
        "toleration-value-too-long",
        _prm_toleration(key="pool", value="v" * 64),
        f"value {'v' * 64!r} is not a valid label value: it has 64 characters: expected at most 63",
    ),
    (
        "toleration-seconds-past-int64",
        _prm_toleration(key="spot", operator="Exists", effect="NoExecute", tolerationSeconds=2**63),
        "tolerationSeconds must be a whole number of seconds (a 64-bit integer)",
    ),
    (
        "memory-far-past-int64",
        _prm_config(memory="99999999999999999999999Ti"),
        "memory='99999999999999999999999Ti' is too large: Kubernetes counts it in bytes as a 64-bit integer",
    ),
    (
        "cpu-nan",
        _prm_config(cpu="NaN"),
        "cpu='NaN' is not a Kubernetes quantity: expected e.g. '500m', '2', '4Gi'",
    ),
    ("memory-infinity", _prm_config(memory="Infinity"), "memory='Infinity' is not a Kubernetes quantity"),
    ("cpu-leading-space", _prm_config(cpu=" 2"), "cpu=' 2' is not a Kubernetes quantity"),
    ("memory-underscores", _prm_config(memory="4_000Mi"), "memory='4_000Mi' is not a Kubernetes quantity"),
    (
        "cpu-huge-exponent",
        _prm_config(cpu="1e999999999"),
        "cpu='1e999999999' is too large: Kubernetes counts it in millicores as a 64-bit integer, at most "
        "9223372036854775807m (9223372036854775.807 cores)",
    ),
    (
        "dataset-bytes-overflow-the-storage",
        _prm_config(dataset_bytes=2**62),
        "data_size=None (dataset_bytes=4611686018427387904), checkpoint_size='4Gi' and output_size='2Gi' add up "
        "to 9223372045444710400 bytes of ephemeral-storage: Kubernetes counts it in bytes as a 64-bit integer",
    ),
]


@pytest.mark.parametrize(("call", "message"), [c[1:] for c in PRM_REFUSED], ids=[c[0] for c in PRM_REFUSED])
def test_prm_refused_before_any_pod_is_built(call, message):
    with pytest.raises(ValueError) as err:
        call()
    assert message in str(err.value)


def _prm_pod_value(pod: dict, field: str) -> object:
    """Where a field's value lands in the pod spec."""
    base = next(c for c in pod["spec"]["containers"] if c["name"] == "base")["resources"]
    if field == "data_size":
        return next(v for v in pod["spec"]["volumes"] if v["name"] == "data")["emptyDir"]["sizeLimit"]
    if field in ("cpu_limit", "memory_limit"):
        return base["limits"][field.removesuffix("_limit")]
    if field == "gpus":
        return int(base["requests"]["nvidia.com/gpu"])
    return base["requests"][field]


PRM_EDGES = [
    # (id, field, the largest value that fits, the next one, message fragment of its refusal)
    (
        "memory-bytes",
        "memory",
        "9223372036854775807",
        "9223372036854775808",
        "memory='9223372036854775808' is too large: Kubernetes counts it in bytes as a 64-bit integer, at "
        "most 9223372036854775807 bytes",
    ),
    ("memory-binary", "memory", "8191Pi", "8Ei", "memory='8Ei' is too large"),
    (
        "cpu-millicores",
        "cpu",
        "9223372036854775807m",
        "9223372036854775808m",
        "cpu='9223372036854775808m' is too large: Kubernetes counts it in millicores as a 64-bit integer, at "
        "most 9223372036854775807m (9223372036854775.807 cores)",
    ),
    (
        "cpu-cores",
        "cpu",
        "9223372036854775.807",
        "9223372036854775.808",
        "cpu='9223372036854775.808' is too large: Kubernetes counts it in millicores",
    ),
    # 9223372036854776m is nine thousand cores short of the edge in cores; as cores it is past it
    (
        "cpu-whole-cores",
        "cpu",
        "9223372036854776m",
        "9223372036854776",
        "cpu='9223372036854776' is too large",
    ),
    (
        "cpu-limit",
        "cpu_limit",
        "9223372036854775807m",
        "9223372036854775808m",
        "cpu_limit='9223372036854775808m' is too large: Kubernetes counts it in millicores",
    ),
    (
        "memory-limit",
        "memory_limit",
        "8388607Ti",
        "8388608Ti",
        "memory_limit='8388608Ti' is too large: Kubernetes counts it in bytes",
    ),
    (
        "data-size",
        "data_size",
        "8388607Ti",
        "8Ei",
        "data_size='8Ei' is too large: Kubernetes counts it in bytes",
    ),
    (
        "data-size-with-the-other-volumes",
        "data_size",
        "8388607Ti",
        "8388607.999Ti",
        "data_size='8388607.999Ti' (dataset_bytes=None), checkpoint_size='4Gi' and output_size='2Gi' add up to "
        "9223372043272060928 bytes of ephemeral-storage",
    ),
    (
        "gpus",
        "gpus",
        _PRM_INT64,
        _PRM_INT64 + 1,
        "gpus=9223372036854775808 is too large: Kubernetes counts it in units as a 64-bit integer",
    ),
]


@pytest.mark.parametrize(
    ("field", "fits", "too_large", "message"), [c[1:] for c in PRM_EDGES], ids=[c[0] for c in PRM_EDGES]
)
def test_prm_quantities_fit_an_int64_as_kubernetes_counts_them(field, fits, too_large, message):
    assert _prm_pod_value(_prm_pod(**{field: fits}), field) == fits
    with pytest.raises(ValueError) as err:
        _prm_pod(**{field: too_large})
    assert message in str(err.value)


def _prm_form_param(name: str):
    from kubetrain.pipeline import common_params

    return common_params(dataset_uri="s3://datasets/digits/", model="digits")[name]


def _prm_python(name: str, value) -> Callable[[], object]:
    """The Python side's check of a Param's value: the node selector's parser, else the pod's config."""
    if name == "node_selector":
        return _prm_selector(value)
    return _prm_config(**{name: value})


PRM_FORM = [
    # (id, Param, value, the part of it refused)
    ("selector-value-too-long", "node_selector", {"pool": "g" * 64}, "g" * 64),
    ("selector-value-space", "node_selector", {"pool": "a100 spot"}, "a100 spot"),
    ("selector-value-slash", "node_selector", {"pool": "gpu/a100"}, "gpu/a100"),
    ("selector-value-leading-dash", "node_selector", {"pool": "-gpu"}, "-gpu"),
    ("selector-value-non-ascii", "node_selector", {"zone": "zürich-1"}, "zürich-1"),
    ("selector-value-trailing-newline", "node_selector", {"pool": "gpu\n"}, "gpu\n"),
    ("selector-key-two-slashes", "node_selector", {"example.com/pool/x": "gpu"}, "example.com/pool/x"),
    ("selector-key-name-over-63", "node_selector", {"n" * 64: "gpu"}, "n" * 64),
    (
        "toleration-key-space",
        "tolerations",
        [{"key": "spot instance", "operator": "Exists"}],
        "spot instance",
    ),
    ("toleration-key-over-63", "tolerations", [{"key": "k" * 64, "operator": "Exists"}], "k" * 64),
    ("toleration-value-slash", "tolerations", [{"key": "pool", "value": "gpu/a100"}], "gpu/a100"),
    ("toleration-value-non-ascii", "tolerations", [{"key": "zone", "value": "zürich"}], "zürich"),
    ("memory-far-past-int64", "memory", "99999999999999999999999Ti", "99999999999999999999999Ti"),
    ("memory-8ei", "memory", "8388608Ti", "8388608Ti"),
    ("cpu-millicores", "cpu", "9223372036854775808m", "9223372036854775808m"),
    ("cpu-cores", "cpu", "9223372036854776", "9223372036854776"),
    ("data-size-8ei", "data_size", "8388608Ti", "8388608Ti"),
]


@pytest.mark.parametrize(
    ("name", "value", "refused"), [c[1:] for c in PRM_FORM], ids=[c[0] for c in PRM_FORM]
)
def test_prm_the_form_refuses_what_the_pod_spec_refuses(name, value, refused):
    import jsonschema

    param = _prm_form_param(name)
    validator = jsonschema.Draft7Validator(param.schema)
    assert validator.is_valid(param.value)  # the default stays valid
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    assert error is not None, f"the form takes {name}={value!r}"
    assert error.message.startswith(repr(refused))
    with pytest.raises(ValueError) as err:
        _prm_python(name, value)()
    assert f"{name.rstrip('s')}" in str(err.value) and repr(refused) in str(err.value)


def _prm_record(field: str, url: str) -> dict:
    """A run record as the record step writes it (tests/plugins/ui/training_records.py), holding ``url``."""
    import importlib.util
    from pathlib import Path

    from kubetrain.ui.queries import record_ref

    tests = next(p for p in Path(__file__).resolve().parents if p.name == "tests")
    spec = importlib.util.spec_from_file_location(
        "_prm_records", tests / "plugins" / "ui" / "training_records.py"
    )
    records = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(records)
    record = records.make_record(run_id="manual__2026-03-02T08:00:00+00:00")
    if field == "mlflow":
        record["mlflow"] = {"experiment_id": "1", "run_id": "abc", "url": url}
    else:
        record["report_url"] = url
    record["ref"] = record_ref(record)
    return record


def _prm_runs_page(field: str, url: str) -> str:
    """The Training page's runs list (runs.html and its macros) with one run whose ``field`` holds ``url``."""
    from kubetrain.ui.app import Links, templates
    from kubetrain.ui.queries import RunFilter, RunsPage

    base = "/kubetrain/training"
    return (
        templates()
        .get_template("runs.html")
        .render(
            base=base,
            links=Links(base),
            models=["digits"],
            section="runs",
            model=None,
            title="Training runs",
            filt=RunFilter(),
            page=RunsPage([_prm_record(field, url)], None, 1),
            dags=["train_image_classifier"],
            next_url=None,
        )
    )


def _prm_sweep_report(url: str, kind: str) -> str:
    """A sweep's leaderboard (report/sweep.html or .md) with one trial whose report_url is ``url``."""
    from kubetrain.report.sweep import SweepReportInputs, render_html, render_markdown

    inputs = SweepReportInputs(
        plan={"objective": {"metric": "val_accuracy", "mode": "max"}},
        trials=[{"trial": "trial-0", "status": "success", "report_url": url}],
        best=None,
    )
    return (render_html if kind == "html" else render_markdown)(inputs, {})


def _prm_rendered(where: str, url: str) -> str:
    if where == "sweep.html":
        return _prm_sweep_report(url, "html")
    if where == "sweep.md":
        return _prm_sweep_report(url, "md")
    return _prm_runs_page(where, url)


PRM_LINKS = [
    # (id, where: a run's "report_url" or "mlflow" on the runs page, or a sweep report's trial, the label,
    #  a stored value shown as text, a stored value linked)
    (
        "report-javascript",
        "report_url",
        "report",
        "javascript:alert(document.domain)",
        "/kubetrain/reports/train_image_classifier/training/runs/x/report/report.html",
    ),
    (
        "mlflow-javascript",
        "mlflow",
        "MLflow",
        "javascript:fetch('/x')",
        "https://mlflow.example/#/experiments/1/runs/abc",
    ),
    (
        "report-data",
        "report_url",
        "report",
        "data:text/html,<script>alert(1)</script>",
        "http://airflow.example/kubetrain/r",
    ),
    (
        "mlflow-vbscript",
        "mlflow",
        "MLflow",
        "vbscript:msgbox(1)",
        "http://mlflow:5000/#/experiments/1/runs/abc",
    ),
    (
        "report-leading-space",
        "report_url",
        "report",
        " javascript:alert(1)",
        "https://airflow.example/kubetrain/r",
    ),
    (
        "mlflow-leading-control",
        "mlflow",
        "MLflow",
        "\x01javascript:alert(1)",
        "HTTPS://mlflow.example/runs/abc",
    ),
    ("report-tab-in-scheme", "report_url", "report", "java\tscript:alert(1)", "/kubetrain/reports/d/b/k"),
    ("mlflow-newline-in-scheme", "mlflow", "MLflow", "java\nscript:alert(1)", "https://mlflow.example/"),
    ("report-mixed-case", "report_url", "report", "JaVaScRiPt:alert(1)", "/kubetrain/reports/d/b/k?x=1"),
    ("report-protocol-relative", "report_url", "report", "//evil.example/", "/kubetrain/training/"),
    ("mlflow-backslash-host", "mlflow", "MLflow", "/\\evil.example/", "https://mlflow.example/runs/abc"),
    ("report-scheme-without-host", "report_url", "report", "https:evil.example", "https://airflow.example/r"),
    ("sweep-trial-javascript", "sweep.html", "report", "javascript:alert(1)", "/kubetrain/reports/d/b/t0"),
    (
        "sweep-trial-protocol-relative",
        "sweep.html",
        "report",
        "//evil.example/x",
        "https://airflow.example/r",
    ),
    ("sweep-markdown-javascript", "sweep.md", "report", "javascript:alert(1)", "/kubetrain/reports/d/b/t0"),
]


@pytest.mark.parametrize(
    ("where", "label", "hostile", "fine"), [c[1:] for c in PRM_LINKS], ids=[c[0] for c in PRM_LINKS]
)
def test_prm_record_links_are_only_web_links(where, label, hostile, fine):
    import re

    from markupsafe import escape

    page = _prm_rendered(where, hostile)
    if where == "sweep.md":
        assert f"({hostile})" not in page and "[report](" not in page
        assert f"[report]({fine})" in _prm_rendered(where, fine)
        return
    hrefs = re.findall(r'href="([^"]*)"', page)
    assert not [h for h in hrefs if hostile.strip() in h or "script" in h.lower() or h.startswith("//")], (
        hrefs
    )
    # shown as text, the stored value only in the title
    assert f'<span class="muted" title="not a web link: {escape(hostile)}">{label}</span>' in page
    linked = _prm_rendered(where, fine)
    assert re.search(rf'<a href="{re.escape(str(escape(fine)))}"[^>]*>{label}</a>', linked), linked


# ==========================================================================================
# Stopping rules: reports whose objective is not a finite number (issue #53 item 9)
# ==========================================================================================
#
# A trainer's report may carry NaN (a diverged loss), an infinity or a value that is not a
# number at all. The rule (trainer/sync/README.md, "ASHA and Hyperband" and "Median stopping"):
# a report's position (its epoch) counts whether or not its value is usable; a value that is
# not a finite number at a rung stops the trial there unranked, even when it is alone at the
# rung, and is not counted among the trials ranked there; the median rule stops a trial none of
# whose reports is usable, and otherwise ranks its best usable value.
#
# Each case runs the same trials, one after the other, twice: through the checkpoint-sync
# sidecar's stopper (trainer/sync/asha.py or median.py, on an in-memory S3 that holds the rung
# reports and the trial records as the sidecars and the Airflow side write them), and through
# Optuna's pruner (a study of the same direction; SuccessiveHalvingPruner, HyperbandPruner or
# MedianPruner with the same settings; each report given to trial.report at its step, then
# trial.should_prune()). What our rule cannot use is handed to Optuna as NaN, Optuna's mark of a
# report it cannot rank (Optuna itself ranks an infinity as a number and refuses a string). Both
# must stop each trial at the report the table expects (None: the trial runs to its end).

_ASHA_NAN = float("nan")
_ASHA_INF = float("inf")
_ASHA_N = _ASHA_NAN  # short, for the tables
_ASHA_ETA2 = {"min_resource": 1, "reduction_factor": 2}
# a study name whose Optuna brackets (a hash of the name and trial number) are, for trials 0 to 3,
# the brackets kubetrain_contract.early_stop.hyperband_bracket gives them: 0, 1, 0, 2
_ASHA_HYPERBAND = {
    "min_resource": 1,
    "reduction_factor": 3,
    "max_resource": 9,
    "study": "hyperband-60",
    "brackets": [0, 1, 0, 2],
}
_ASHA_MEDIAN = {"min_trials": 2, "start_step": 2}

# (rule, mode, settings, each trial's reports in order, the report each is stopped at or None)
ASHA_CASES = [
    pytest.param("asha", "max", {}, [[_ASHA_N] * 4], [1], id="asha-nan-from-the-first-epoch-alone"),
    pytest.param(
        "asha",
        "max",
        {},
        [[0.5] * 4, [0.9, _ASHA_N, 0.95, 0.1]],
        [None, None],
        # rung 3 is its third report (0.95), not its third number (0.1 at report 4)
        id="asha-nan-between-rungs-keeps-the-positions",
    ),
    pytest.param(
        "asha", "max", {}, [[0.5] * 4, [0.9, 0.8, _ASHA_N, 0.95]], [None, 3], id="asha-nan-at-the-second-rung"
    ),
    pytest.param(
        "asha", "max", {}, [[0.5] * 3, [_ASHA_INF, 0.9, 0.9]], [None, 1], id="asha-plus-inf-is-not-the-best"
    ),
    pytest.param("asha", "min", {}, [[_ASHA_INF, 0.3, 0.2]], [1], id="asha-inf-loss-alone-at-the-rung"),
    pytest.param(
        "asha", "max", {}, [[0.5] * 3, ["n/a", 0.9, 0.9]], [None, 1], id="asha-non-numeric-string-at-the-rung"
    ),
    pytest.param("asha", "max", {}, [[0.5] * 3, [None, 0.9, 0.9]], [None, 1], id="asha-null-at-the-rung"),
    pytest.param(
        "asha",
        "max",
        {},
        [[0.5] * 3, ["0.7", "0.8", "0.9"]],
        [None, None],
        id="asha-numeric-strings-are-numbers",
    ),
    pytest.param(
        "asha",
        "max",
        {},
        [[0.5] * 4, [0.6, 0.6, 0.6, _ASHA_N, _ASHA_N, _ASHA_INF]],
        [None, None],
        id="asha-nan-only-after-the-last-rung",
    ),
    pytest.param(
        "asha",
        "max",
        {},
        [[0.5] * 2, [_ASHA_N, 0.9], [0.6] * 2, [0.4] * 2],
        [None, 1, None, 1],
        id="asha-one-of-several-nan-at-the-rung",
    ),
    pytest.param(
        "asha",
        "max",
        _ASHA_ETA2,
        [[_ASHA_N] * 2, [0.6] * 2, [0.4] * 2, [0.5] * 2],
        # a NaN counted as the worst would make 4 ranked and promote the top 2, 0.5 among them
        [1, None, 1, 1],
        id="asha-a-nan-is-not-counted-among-the-ranked",
    ),
    pytest.param(
        "asha",
        "min",
        {},
        [[1.0, 0.9], [_ASHA_N, 0.1], [0.8, 0.7], [2.0, 1.5]],
        [None, 1, None, 1],
        id="asha-min-one-of-several-nan-at-the-rung",
    ),
    pytest.param(
        "hyperband",
        "max",
        _ASHA_HYPERBAND,
        [[0.5] * 4, [_ASHA_N] * 4, [_ASHA_N, 0.9, 0.9], [_ASHA_N] * 5],
        # bracket 1's first rung is report 3, bracket 2's is report 9
        [None, 3, 1, None],
        id="hyperband-nan-at-each-brackets-first-rung",
    ),
    pytest.param(
        "median",
        "max",
        _ASHA_MEDIAN,
        [[0.5] * 4, [0.5] * 4, [_ASHA_N] * 4],
        [None, None, 2],
        id="median-nan-from-the-first-report",
    ),
    pytest.param(
        "median",
        "max",
        _ASHA_MEDIAN,
        [[0.5] * 4, [0.5] * 4, [0.1, _ASHA_N, 0.2, 0.2]],
        # at report 2 its best is 0.1, below the median 0.5; not at its second number (report 3)
        [None, None, 2],
        id="median-nan-keeps-the-positions",
    ),
    pytest.param(
        "median",
        "max",
        _ASHA_MEDIAN,
        [[0.5] * 4, [0.5] * 4, [0.9, _ASHA_N, "n/a", _ASHA_INF]],
        [None, None, None],
        id="median-a-good-best-then-unusable-reports",
    ),
    pytest.param(
        "median",
        "min",
        _ASHA_MEDIAN,
        [[1.0] * 4, [1.0] * 4, [_ASHA_INF] * 4],
        [None, None, 2],
        id="median-min-inf-loss",
    ),
    pytest.param(
        "median",
        "max",
        {"min_trials": 3, "start_step": 2},
        [[0.5, _ASHA_N, 0.5, 0.5], [0.7] * 4, [0.3] * 4, [0.45] * 4],
        [None, None, None, 2],
        id="median-a-finished-trial-with-a-nan-report",
    ),
]


class _AshaS3:
    """The calls of trainer.sync.s3.S3 the stoppers make, on a dict of keys to bodies."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    def list_objects(self, bucket: str, prefix: str):
        import hashlib

        for key in sorted(k for k in self.objects if k.startswith(prefix)):
            yield {"Key": key, "ETag": f'"{hashlib.md5(self.objects[key]).hexdigest()}"'}

    def get_bytes(self, bucket: str, key: str) -> bytes:
        from kubetrain_contract.s3uri import S3Uri
        from trainer.sync.errors import S3RequestError

        if key not in self.objects:
            raise S3RequestError(S3Uri(bucket, key), 404, "NoSuchKey")
        return self.objects[key]

    def put_bytes(self, bucket: str, key: str, data: bytes, **_) -> dict[str, str]:
        self.objects[key] = bytes(data)
        return {}


def _asha_for_optuna(raw) -> float:
    """What Optuna is told for a report: the number, or NaN where it is not a finite number."""
    import math

    if raw is None or isinstance(raw, bool):
        return math.nan
    try:
        number = float(raw)
    except (TypeError, ValueError):
        return math.nan
    return number if math.isfinite(number) else math.nan


def _asha_optuna(rule: str, mode: str, settings: dict, trials: list[list]) -> tuple[list, list[int]]:
    """Each trial's report at which Optuna's pruner prunes it (None: never), and its bracket."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if rule == "median":
        pruner = optuna.pruners.MedianPruner(
            n_startup_trials=settings["min_trials"], n_warmup_steps=settings["start_step"]
        )
    elif rule == "hyperband":
        pruner = optuna.pruners.HyperbandPruner(
            min_resource=settings["min_resource"],
            max_resource=settings["max_resource"],
            reduction_factor=settings["reduction_factor"],
        )
    else:
        pruner = optuna.pruners.SuccessiveHalvingPruner(
            min_resource=settings.get("min_resource", 1), reduction_factor=settings.get("reduction_factor", 3)
        )
    study = optuna.create_study(
        study_name=settings.get("study", "asha"),
        direction="maximize" if mode == "max" else "minimize",
        pruner=pruner,
    )
    pruned, brackets = [], []
    for reports in trials:
        trial = study.ask()
        at = None
        for step, raw in enumerate(reports, 1):
            trial.report(_asha_for_optuna(raw), step)
            if trial.should_prune():
                at = step
                break
        # Optuna has no public way to tell a trial's bracket; the table checks it is the one expected
        brackets.append(pruner._get_bracket_id(study, trial) if rule == "hyperband" else 0)
        # the objective's final value is no pruner's business; a finite one keeps the trial COMPLETE
        study.tell(
            trial, 0.0 if at is None else None, state=None if at is None else optuna.trial.TrialState.PRUNED
        )
        pruned.append(at)
    return pruned, brackets


def _asha_ours(
    tmp_path, rule: str, mode: str, settings: dict, trials: list[list], brackets: list[int]
) -> list:
    """Each trial's report at which its checkpoint-sync sidecar's stopper stops it (None: never)."""
    import json

    from trainer.sync.asha import RungRule, RungStopper
    from trainer.sync.errors import parse_s3_uri
    from trainer.sync.median import MedianRule, MedianStopper

    s3 = _AshaS3()
    records = parse_s3_uri("s3://training/sweep/sweep/trials/")
    stopped = []
    for number, reports in enumerate(trials):
        out, ck = tmp_path / str(number) / "out", tmp_path / str(number) / "ck"
        out.mkdir(parents=True)
        ck.mkdir()
        where = {
            "run": parse_s3_uri(f"s3://training/sweep/trials/{number}"),
            "trials": records,
            "output_dir": out,
            "stop_file": ck / ".kubetrain-stop",
        }
        if rule == "median":
            median = MedianRule("score", mode, settings["min_trials"], settings["start_step"])
            stopper = MedianStopper(s3, median, **where)
        else:
            rung_rule = RungRule(
                "score",
                mode,
                min_resource=settings.get("min_resource", 1),
                reduction_factor=settings.get("reduction_factor", 3),
                bracket=brackets[number],
                brackets=3 if rule == "hyperband" else 1,
                name=rule,
            )
            rungs = parse_s3_uri("s3://training/sweep/sweep/rungs/")
            stopper = RungStopper(s3, rung_rule, trial=number, rungs=rungs, **where)
        at, lines = None, []
        for step, raw in enumerate(reports, 1):
            # as a Python trainer appends them: json.dumps writes NaN and Infinity as such
            lines.append(json.dumps({"step": step, "score": raw}) + "\n")
            (out / "metrics.jsonl").write_text("".join(lines))
            if stopper.check() is not None:
                at = step
                break
        # the trial's record, as the Airflow side writes it when the trial ends (NaN kept)
        record = {
            "kind": "kubetrain/sweep-trial",
            "number": number,
            "status": "success",
            "stopped_early": at is not None,
            "history": [{"step": s, "score": r} for s, r in enumerate(reports[: at or len(reports)], 1)],
        }
        s3.objects[f"{records.key}{number}.json"] = json.dumps(record).encode()
        stopped.append(at)
    return stopped


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")  # Optuna's nanmax of NaNs
@pytest.mark.parametrize(("rule", "mode", "settings", "trials", "expected"), ASHA_CASES)
def test_hostile_report_values(tmp_path, rule, mode, settings, trials, expected):
    pytest.importorskip("optuna")
    optuna_stops, brackets = _asha_optuna(rule, mode, settings, trials)
    assert brackets == settings.get("brackets", [0] * len(trials))
    ours = _asha_ours(tmp_path, rule, mode, settings, trials, brackets)
    assert (ours, optuna_stops) == (expected, expected)


# ==========================================================================================
# Archives, continued: damaged archives and floods of members (issue #53 items 4 and 5)
# ==========================================================================================
#
# A damaged tar (a bad header, a cut, a zero block in the middle, data after its end, a PAX
# size that contradicts its header, a truncated or corrupt gzip stream) is refused, naming the
# member where the damage starts; tarfile alone would end the archive there, silently, and
# stage-in would take the members before the damage for the whole dataset. A flood of members
# is refused early, in the memory of the stage-in container (1 GiB), naming the limit: the
# member limits, and the target file system's free inodes.

# a, b and c: a's header at byte 0, b's at 1,024 (its 700 bytes of data from 1,536), c's at
# 2,560, the end-of-archive blocks at 3,584; tarfile pads the archive with zeros to 10,240
_ARX_ABC = [("a.txt", b"a" * 100), ("b.txt", b"b" * 700), ("c.txt", b"c" * 10)]


def _arx_tar_bytes(members: list, fmt: int = tarfile.USTAR_FORMAT) -> bytes:
    """An uncompressed tar of (name, data) pairs and TarInfos (a TarInfo's data: its size of b"p")."""
    import io

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for m in members:
            if isinstance(m, tarfile.TarInfo):
                tf.addfile(m, io.BytesIO(b"p" * m.size) if m.isreg() else None)
            else:
                info = tarfile.TarInfo(m[0])
                info.size, info.mtime = len(m[1]), 0
                tf.addfile(info, io.BytesIO(m[1]))
    return buf.getvalue()


def _arx_gzip(data: bytes) -> bytes:
    import gzip

    return gzip.compress(data, mtime=0)


def _arx_damaged(
    damage: Callable[[bytes], bytes] = lambda t: t,
    *,
    members: list | None = None,
    fmt: int = tarfile.USTAR_FORMAT,
    gz_damage: Callable[[bytes], bytes] | None = None,
) -> Callable[[Path], None]:
    """A builder: the tar of ``members`` (a, b, c), damaged, then gzipped for .gz (and that damaged)."""

    def build(path: Path) -> None:
        data = damage(_arx_tar_bytes(_ARX_ABC if members is None else members, fmt))
        if path.name.endswith((".tar.gz", ".tgz")):
            data = _arx_gzip(data)
            data = gz_damage(data) if gz_damage else data
        path.write_bytes(data)

    return build


def _arx_bad_checksum(offset: int) -> Callable[[bytes], bytes]:
    return lambda t: t[: offset + 148] + b"0000000\x00" + t[offset + 156 :]


def _arx_pax_size(pax: int, data: int) -> list:
    """a.txt, then x.bin whose PAX header declares ``pax`` bytes, its tar header and data ``data``."""
    info = tarfile.TarInfo("x.bin")
    info.size, info.pax_headers = data, {"size": str(pax)}
    return [("a.txt", b"a"), info, ("z.txt", b"z" * 20)]


def _arx_pax_records(records: bytes) -> Callable[[Path], None]:
    """a.txt, a PAX header of these records, b.txt."""

    def build(path: Path) -> None:
        pax = tarfile.TarInfo("PaxHeaders/b.txt")
        pax.type, pax.size = tarfile.XHDTYPE, len(records)
        head = _arx_tar_bytes([("a.txt", b"a")])[:1024]
        padding = bytes(-len(records) % 512)
        path.write_bytes(
            head + pax.tobuf(tarfile.USTAR_FORMAT) + records + padding + _arx_tar_bytes([("b.txt", b"b")])
        )

    return build


def _arx_random(n: int) -> bytes:
    import random

    return random.Random(53).randbytes(n)


def _arx_pax_header_of(size: int) -> Callable[[Path], None]:
    """a.txt, then a PAX header that declares ``size`` bytes of records (zeros: a few KB gzipped)."""

    def build(path: Path) -> None:
        header = tarfile.TarInfo("././@PaxHeader")
        header.type, header.size = tarfile.XHDTYPE, size
        head = _arx_tar_bytes([("a.txt", b"a")])[:1024] + header.tobuf(tarfile.USTAR_FORMAT)
        import zlib

        z = zlib.compressobj(6, zlib.DEFLATED, 31)
        parts = [z.compress(head)]
        chunk = bytes(1024 * 1024)
        for _ in range(size // len(chunk)):
            parts.append(z.compress(chunk))
        parts.append(z.compress(bytes(10240)) + z.flush())
        path.write_bytes(b"".join(parts))

    return build


def _arx_copies_of_one_directory(n: int) -> Callable[[Path], None]:
    """A tar.gz of ``n`` members, every one the directory d: each a member tarfile reads, no inode."""

    def build(path: Path) -> None:
        d = tarfile.TarInfo("d")
        d.type, d.mode = tarfile.DIRTYPE, 0o755
        path.write_bytes(_arx_gzip(d.tobuf(tarfile.USTAR_FORMAT) * n + bytes(10240)))

    return build


def _arx_zip_declaring(entries: int, zip64: bool) -> Callable[[Path], None]:
    """A zip of 3 entries whose end record (or zip64 end record) declares ``entries``."""

    def build(path: Path) -> None:
        import io
        import struct

        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as zf:
            for name in ("a.txt", "b.txt", "c.txt"):
                zf.writestr(name, b"x")
        data = buf.getvalue()
        body, end = data[:-22], data[-22:]
        sig, disk, cd_disk, _, _, cd_size, cd_offset, comment = struct.unpack("<4s4H2LH", end)
        if not zip64:
            path.write_bytes(
                body + struct.pack("<4s4H2LH", sig, 0, 0, entries, entries, cd_size, cd_offset, 0)
            )
            return
        record = struct.pack(
            "<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, entries, entries, cd_size, cd_offset
        )
        locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, len(body), 1)
        end = struct.pack("<4s4H2LH", sig, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
        path.write_bytes(body + record + locator + end)

    return build


def _arx_files(rels: dict[str, bytes]) -> Callable[[Path], None]:
    """A check that the directory holds these files (and the archive), and nothing else."""

    def check(target: Path) -> None:
        found = {
            str(p.relative_to(target)): p.read_bytes() for p in target.rglob("*") if p.name != "a.tar.gz"
        }
        assert found == rels

    return check


# id, archive file name, builder, limits (None: the defaults), member named (None: the archive only,
# or with a check: accepted), the message's fragment (or the check of what an accepted archive wrote)
ARX_CASES = [
    # -- a damaged header: tarfile ends the archive there, without an error
    (
        "tar-bad-checksum-in-the-second-member",
        "a.tar",
        _arx_damaged(_arx_bad_checksum(1024)),
        None,
        "b.txt",
        "damaged tar header at byte 1,024 (bad checksum), after the member 'a.txt'",
    ),
    (
        "tar-gz-bad-checksum-in-the-second-member",
        "a.tar.gz",
        _arx_damaged(_arx_bad_checksum(1024)),
        None,
        "b.txt",
        "damaged tar header at byte 1,024 (bad checksum), after the member 'a.txt'",
    ),
    (
        "tar-pax-record-of-length-0",
        "a.tar",
        _arx_pax_records(b"0 path=evil\n"),
        None,
        "PaxHeaders/b.txt",
        "damaged tar header at byte 1,024 (tarfile cannot read the member it starts), after the member 'a.txt'",
    ),
    # -- truncated: in a member's data, at a header boundary, inside a header
    (
        "tar-truncated-in-a-members-data",
        "a.tar",
        _arx_damaged(lambda t: t[:1800]),
        None,
        "b.txt",
        "the archive is truncated at byte 1,800, inside this member's 700 bytes of data from byte 1,536",
    ),
    (
        "tar-gz-truncated-in-a-members-data",
        "a.tar.gz",
        _arx_damaged(lambda t: t[:1800]),
        None,
        "b.txt",
        "the archive is truncated at byte 1,800, inside this member's 700 bytes of data from byte 1,536",
    ),
    (
        "tar-truncated-at-a-header-boundary",
        "a.tar",
        _arx_damaged(lambda t: t[:2560]),
        None,
        "b.txt",
        "the archive is truncated at byte 2,560, after this member: 0 bytes of the 1,024 zero bytes",
    ),
    (
        "tar-gz-truncated-at-a-header-boundary",
        "a.tgz",
        _arx_damaged(lambda t: t[:2560]),
        None,
        "b.txt",
        "the archive is truncated at byte 2,560, after this member: 0 bytes of the 1,024 zero bytes",
    ),
    (
        "tar-truncated-inside-a-header",
        "a.tar",
        _arx_damaged(lambda t: t[: 2560 + 300]),
        None,
        "b.txt",
        "truncated at byte 2,860, inside the header at byte 2,560 (300 of its 512 bytes)",
    ),
    # -- a zero block mid-archive: tarfile takes it for the end, the members after it are lost
    (
        "tar-zero-block-mid-archive",
        "a.tar",
        _arx_damaged(lambda t: t[:1024] + bytes(512) + t[1024:]),
        None,
        "b.txt",
        "comes after a zero block at byte 1,024 that ends the archive there",
    ),
    (
        "tar-gz-zero-block-mid-archive",
        "a.tar.gz",
        _arx_damaged(lambda t: t[:1024] + bytes(512) + t[1024:]),
        None,
        "b.txt",
        "comes after a zero block at byte 1,024 that ends the archive there",
    ),
    (
        "tar-data-after-the-end-of-archive-blocks",
        "a.tar",
        _arx_damaged(lambda t: t + b"junk"),
        None,
        "c.txt",
        "data at byte 10,240, after the end-of-archive zero blocks at byte 3,584",
    ),
    # -- a PAX size that contradicts the tar header: the members after it would be misread
    (
        "tar-pax-size-smaller-than-the-data",
        "a.tar",
        _arx_damaged(members=_arx_pax_size(10, 1000), fmt=tarfile.PAX_FORMAT),
        None,
        "x.bin",
        "its PAX header declares 10 bytes of data, its tar header 1,000",
    ),
    (
        "tar-gz-pax-size-larger-than-the-data",
        "a.tar.gz",
        _arx_damaged(members=_arx_pax_size(1000, 10), fmt=tarfile.PAX_FORMAT),
        None,
        "x.bin",
        "its PAX header declares 1,000 bytes of data, its tar header 10",
    ),
    # a size the tar header's 11 octal digits cannot hold is the PAX header's alone (GNU tar writes
    # 0 there): read as declared, here found truncated
    (
        "tar-pax-size-beyond-the-tar-header-is-the-size",
        "a.tar",
        _arx_damaged(members=_arx_pax_size(8**11, 0), fmt=tarfile.PAX_FORMAT),
        None,
        "x.bin",
        "inside this member's 8,589,934,592 bytes of data",
    ),
    # -- the gzip stream: read to its end, its CRC checked
    (
        "tar-gz-stream-truncated-after-the-tar",
        "a.tar.gz",
        _arx_damaged(gz_damage=lambda g: g[:-4]),
        None,
        "c.txt",
        "the gzip stream is truncated or damaged (Compressed file ended before the end-of-stream marker",
    ),
    (
        "tar-gz-stream-truncated-in-a-members-data",
        "a.tar.gz",
        _arx_damaged(
            members=[("a.txt", b"a"), ("r.bin", _arx_random(200_000))], gz_damage=lambda g: g[:100_000]
        ),
        None,
        "r.bin",
        "the gzip stream is truncated or damaged (Compressed file ended before the end-of-stream marker "
        "was reached), at byte",
    ),
    (
        "tar-gz-bad-crc",
        "a.tar.gz",
        _arx_damaged(gz_damage=lambda g: g[:-8] + bytes([g[-8] ^ 0xFF]) + g[-7:]),
        None,
        "c.txt",
        "the gzip stream is truncated or damaged (CRC check failed",
    ),
    # -- memory before the limits: a PAX header tarfile would read whole, members tarfile would keep
    (
        "tar-gz-pax-header-of-64-MiB",
        "a.tar.gz",
        _arx_pax_header_of(64 * 1024 * 1024),
        None,
        "a.txt",
        "an extended header of more than 16,777,216 bytes (tarfile would read it whole into memory)",
    ),
    (
        "tar-gz-12001-copies-of-one-directory",
        "a.tar.gz",
        _arx_copies_of_one_directory(12_001),
        None,
        "d",
        "more than 10,000 members (member-density limit: one member per 8 bytes of its",
    ),
    # -- a zip's end record is read, and its central directory walked, before zipfile reads it
    (
        "zip-end-record-declares-more-entries-than-it-holds",
        "a.zip",
        _arx_zip_declaring(0xFFFE, zip64=False),
        None,
        None,
        "damaged: its end record declares 65,534 entries, its central directory holds 3",
    ),
    (
        "zip64-end-record-declares-2000000-entries",
        "a.zip",
        _arx_zip_declaring(2_000_000, zip64=True),
        None,
        None,
        "damaged: its end record declares 2,000,000 entries, its central directory holds 3",
    ),
    # -- zeros after the end: padding, as tar's records have (GNU tar -b 512: 256 KiB), up to the
    # whole-archive ratio limit, as if written (at least 1 MiB)
    (
        "tar-gz-end-padded-to-256-KiB",
        "a.tar.gz",
        _arx_damaged(lambda t: t + bytes(256 * 1024 - len(t))),
        None,
        None,
        _arx_files(dict(_ARX_ABC)),
    ),
    (
        "tar-gz-end-padded-with-64-MiB-of-zeros",
        "a.tar.gz",
        _arx_damaged(lambda t: t + bytes(64 * 1024 * 1024)),
        None,
        "c.txt",
        "bytes of zeros after the end of the archive at byte 3,584 (the whole-archive ratio limit)",
    ),
]


@pytest.mark.parametrize(
    ("name", "build", "limits", "member", "expect"),
    [c[1:] for c in ARX_CASES],
    ids=[c[0] for c in ARX_CASES],
)
def test_hostile_damaged_archive(tmp_path, name, build, limits, member, expect):
    target = tmp_path / "data"
    target.mkdir()
    archive = target / name
    build(archive)
    if callable(expect):
        extract(archive, limits or ExtractLimits())
        expect(target)
        return
    with pytest.raises(ArchiveError) as err:
        extract(archive, limits or ExtractLimits())
    message = str(err.value)
    assert message.startswith(f"archive {name}: " + (f"member {member!r}: " if member else ""))
    assert expect in message and message.endswith("; refused")
    assert ".kubetrain-extract" not in message
    assert os.listdir(target) == [name]  # nothing extracted, no temporary directory left
    assert os.listdir(tmp_path) == ["data"]


def test_hostile_zip_member_count_is_refused_before_zipfile_reads_it(tmp_path, monkeypatch):
    """zipfile keeps every entry of the central directory (about 600 bytes each): counted first."""
    archive = tmp_path / "many.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for i in range(1_001):
            zf.writestr(f"f/{i:04d}", b"")
    opened: list[object] = []
    monkeypatch.setattr(zipfile, "ZipFile", lambda *args, **kwargs: opened.append(args))
    with pytest.raises(ArchiveError) as err:
        extract(archive, ExtractLimits(max_members=1_000))
    assert str(err.value) == (
        "archive many.zip: member 'f/1000': more than 1,000 members (limit), the setting "
        "--max-extract-members; refused"
    )
    assert opened == [] and os.listdir(tmp_path) == ["many.zip"]


def _arx_empty_members(path: Path, n: int) -> None:
    """A tar.gz of ``n`` empty files e/0000000-9999999, e/0000001-9999998, ... from raw ustar headers.

    Each name is 7 digits and their complements (9 - digit): the digits add up to 63 in every
    name, so every header has the same checksum and is the name plus the same 495 bytes. Gzipped
    at level 1 (10 bytes a member; 1,000,001 in 3.5 s).
    """
    import zlib

    block = bytearray(512)
    block[0:17] = b"e/0000000-9999999"
    for at, field in ((100, b"0000644\x00"), (108, b"0000000\x00"), (116, b"0000000\x00")):
        block[at : at + 8] = field
    block[124:148] = b"00000000000\x00" * 2  # size and mtime
    block[148:156] = b" " * 8
    block[156:157], block[257:265] = b"0", b"ustar\x0000"
    block[148:156] = b"%06o\x00 " % sum(block)
    rest, complement = bytes(block[17:]), bytes.maketrans(b"0123456789", b"9876543210")
    z = zlib.compressobj(1, zlib.DEFLATED, 31)
    with open(path, "wb") as f:
        for start in range(0, n, 16384):
            parts: list[bytes] = []
            for i in range(start, min(start + 16384, n)):
                digits = b"%07d" % i
                parts += (b"e/", digits, b"-", digits.translate(complement), rest)
            f.write(z.compress(b"".join(parts)))
        f.write(z.compress(bytes(10240)) + z.flush())


@pytest.fixture(scope="module")
def _arx_floods(tmp_path_factory) -> dict[int, Path]:
    """The issue's archives of 1,000,001 and 200,000 empty files, built once."""
    root = tmp_path_factory.mktemp("arx-floods")
    floods = {}
    for n in (1_000_001, 200_000):
        floods[n] = root / f"{n}.tar.gz"
        _arx_empty_members(floods[n], n)
    return floods


_ARX_CHILD = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))  # the stage-in container's memory limit
from pathlib import Path
from trainer.sync.archive import ArchiveError, ExtractLimits, extract
try:
    extract(Path(sys.argv[1]), ExtractLimits(min_member_bytes=int(sys.argv[2])))
    print("extracted")
except ArchiveError as exc:
    print(exc)
# this process's own peak RSS (its memory since exec: the rusage of a child also counts the memory
# of the process it was forked from, before its exec)
hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print("peak-rss-kib", int(hwm.split()[1]))
"""


@pytest.mark.parametrize("members", [1_000_001, 200_000])
def test_hostile_member_flood_is_refused_early_in_a_pods_memory(tmp_path, _arx_floods, members):
    """Refused at the member-density limit, in a child process limited to 1 GiB as the pod is.

    With --min-extract-member-bytes 512, a setting for a dataset of images (their tar.gz holds
    2,500-7,500 bytes a member); before, tarfile's list of members and a set of every path took
    1.05 GiB for the 1,000,001 and the pod was OOM-killed before the member limit, without a word.
    """
    import subprocess
    import sys

    data = tmp_path / "data"
    data.mkdir()
    archive = data / "flood.tar.gz"
    os.symlink(_arx_floods[members], archive)  # extract() reads the archive where it lies
    size = archive.stat().st_size
    child = subprocess.Popen(
        [sys.executable, "-c", _ARX_CHILD, str(archive), "512"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
    )
    with child.stdout:
        out = child.stdout.read().decode()
    assert child.wait() == 0, out
    cap = max(10_000, size // 512)  # the refused member is the (cap + 1)-th: e/<cap>-...
    assert out.strip().startswith(f"archive flood.tar.gz: member 'e/{cap:07d}-"), out
    assert f"more than {cap:,} members (member-density limit: one member per 512 bytes of its {size:,}" in out
    assert cap < members // 10  # refused before a tenth of the members was written
    peak = int(out.rsplit("peak-rss-kib", 1)[1])
    assert peak < 200 * 1024, f"peak RSS {peak // 1024} MiB"  # KiB; the limit: 1 GiB
    assert os.listdir(data) == ["flood.tar.gz"]


def _arx_small_file_system(root: Path, inodes: int) -> Callable[[object], os.statvfs_result]:
    """os.statvfs of a file system of ``inodes`` inodes, of which the entries below ``root`` are used.

    A tmpfs mounted with nr_inodes=N would be the real thing, but mounting one needs CAP_SYS_ADMIN
    (or a user namespace) that a test run cannot count on: this one counts what is really there
    each time it is asked, so the extractor sees its own files take the inodes.
    """

    def statvfs(path: object) -> os.statvfs_result:
        real = os.statvfs(path)
        used = 1 + sum(len(dirs) + len(files) for _, dirs, files in os.walk(root))
        free = max(inodes - used, 0)
        fields = (real.f_bsize, real.f_frsize, real.f_blocks, real.f_bfree, real.f_bavail)
        return os.statvfs_result((*fields, inodes, free, free, real.f_flag, real.f_namemax))

    return statvfs


@pytest.mark.parametrize("name", ["many.tar.gz", "many.zip"])
def test_hostile_archive_beyond_the_free_inodes_is_refused(tmp_path, name):
    """A file system of 400 inodes keeps 20 (5%) free: of 500 files, about 370 fit; refused, nothing left."""
    data = tmp_path / "data"
    data.mkdir()
    archive = data / name
    files = [(f"d/{i:03d}", b"") for i in range(500)]
    if name.endswith(".zip"):
        with zipfile.ZipFile(archive, "w") as zf:
            for rel, body in files:
                zf.writestr(rel, body)
    else:
        archive.write_bytes(_arx_gzip(_arx_tar_bytes(files)))
    with pytest.raises(ArchiveError) as err:
        extract(archive, ExtractLimits(), statvfs=_arx_small_file_system(tmp_path, 400))
    message = str(err.value)
    assert message.startswith(f"archive {name}: member 'd/")
    assert "new files, directories and links (inode limit: the target file system has 400 inodes" in message
    assert "and 20 of them, 5%, are kept free: the kubelet evicts pods below that): inode bomb?" in message
    assert message.endswith("; refused")
    refused = int(message.split("member 'd/")[1][:3])
    # what was used before (tmp_path, data, the archive, the temporary directory), then d and its files
    assert 360 <= refused <= 380, message
    assert os.listdir(data) == [name]
    if name.endswith(".zip"):  # counted in the central directory: refused before anything was written
        assert "more than 376 new files, directories and links" in message and "396 free now" in message


def test_hostile_archive_on_a_file_system_that_counts_no_inodes(tmp_path):
    """btrfs and some network file systems report 0 inodes: the member limits alone apply."""
    archive = tmp_path / "a.tar"
    archive.write_bytes(_arx_tar_bytes([(f"d/{i}", b"") for i in range(50)]))

    def statvfs(path: object) -> os.statvfs_result:
        real = os.statvfs(path)
        return os.statvfs_result((*real[:5], 0, 0, 0, real.f_flag, real.f_namemax))

    assert extract(archive, ExtractLimits(), statvfs=statvfs) == 50
    assert len(os.listdir(tmp_path / "d")) == 50
