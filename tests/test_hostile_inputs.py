"""The hostile-input catalogue: what an attacker (or a careless user) can hand kubetrain, and what it does.

One section per area, each a table-driven test (one ``@pytest.mark.parametrize`` table with
ids), each case asserting the exact refusal (a fragment of the message, naming what was
refused) or the confinement (what was written stays where it belongs). A new finding
becomes a row here before it is fixed.

Areas:

* archives: the dataset archives stage-in extracts into DATA_DIR (trainer/sync/archive.py;
  the rules are in trainer/sync/README.md, "Stage-in"). Issue #31 items 3 and 6.

Sections for Params (trigger-form values), UI requests and images follow below, each
with its own header and its own helpers.

Runs under the Airflow environment (.venv): what it imports from the pod side
(trainer.sync.archive) is standard library only.
"""

from __future__ import annotations

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

    from kubetrain.imagebuild.oci import error_detail

    response = requests.Response()
    response.status_code, response._content = 502, body
    response.headers["Content-Type"] = content_type
    assert error_detail(response) == shown
