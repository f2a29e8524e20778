"""A run's sync pass manifests (``<run>/sync/pass-<n>.json``): the newest, the final one checked
against S3, the pass the promote step writes after pruning, the pruning, and the resume step.

The manifests are :class:`kubetrain_contract.manifests.SyncPassRecord` documents, read through
the record: a manifest that is not a valid record fails verification naming the field.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowException, AirflowFailException

from kubetrain.s3_layout import RunLocation, s3_uri, utc_stamp
from kubetrain_contract.manifests import SyncPassRecord
from kubetrain_contract.records import RecordError
from kubetrain_contract.run_layout import SYNC_AREA

if TYPE_CHECKING:
    from kubetrain.run_store import RunStore

MAX_LISTED_PROBLEMS = 20
# A TensorFlow checkpoint prefix ("ckpt-12" of ckpt-12.index, ckpt-12.data-00000-of-00001) or a
# numbered Keras file ("epoch-0003" of epoch-0003.weights.h5): family name, step, rest.
_CHECKPOINT = re.compile(r"^(?P<dir>(?:.*/)?)(?P<family>[^/]*?)[-_](?P<step>\d+)(?P<rest>(?:\.[^/]*)?)$")
# A checkpoint that is a folder of files named after its step: the kit's Keras callback writes
# keras/step-0000000012/{model.weights.h5,state.json}. The innermost such folder is the checkpoint;
# hidden folders (a callback's .tmp-step-12-<pid> being written, a .damaged-step-12 set aside) are not.
_CHECKPOINT_FOLDER = re.compile(r"^(?P<family>[^/.][^/]*?)[-_](?P<step>\d+)$")


class FinalPassPending(AirflowException):
    """The run has no final sync pass yet: the checkpoint-sync sidecar has not finished its shutdown pass."""


class SyncVerificationError(AirflowFailException):
    """The run's checkpoints or output in S3 are not what its final sync pass promised; not retried."""


def checkpoint_group(path: str) -> tuple[tuple[str, str], int] | None:
    """``((directory, family), step)`` of a checkpoint file path, or ``None`` for other files.

    A numbered file is its own checkpoint (``ckpt-12.index``: ``(("", "ckpt"), 12)``); a file inside a
    numbered folder belongs to that folder's (``keras/step-0000000012/state.json``:
    ``(("keras/", "step"), 12)``), so pruning keeps or deletes the folder's files together and the run
    record reads the step. The cases are the table of tests/plugins/test_pass_checkpoint_layouts.py.
    """
    match = _CHECKPOINT.match(path)
    if match:
        return (match.group("dir"), match.group("family")), int(match.group("step"))
    parts = path.split("/")
    for depth in range(len(parts) - 2, -1, -1):  # the innermost numbered folder
        if folder := _CHECKPOINT_FOLDER.match(parts[depth]):
            return ("".join(part + "/" for part in parts[:depth]), folder.group("family")), int(
                folder.group("step")
            )
    return None


@dataclass(frozen=True)
class SyncPass:
    """One sync pass manifest of a run, as read from S3: its number, URI and record."""

    number: int
    uri: str
    record: SyncPassRecord

    @property
    def document(self) -> dict[str, Any]:
        """The manifest as JSON would hold it."""
        return self.record.to_dict()

    @property
    def files(self) -> list[dict[str, Any]]:
        """The listed files, ``{"area", "path", "key", "size", "sha256"}`` each."""
        return [dataclasses.asdict(entry) for entry in self.record.files]

    @property
    def final(self) -> bool:
        return self.record.final


class PassRepository:
    """The sync pass manifests of runs, through the store's S3 gateway.

    :param store: the S3 gateway.
    """

    def __init__(self, store: RunStore) -> None:
        self.store = store

    def numbers(self, run: RunLocation) -> list[tuple[int, str]]:
        """``(pass number, key)`` of each of the run's pass manifests, in pass order."""
        found = []
        for item in self.store.list(run.bucket, run.area_prefix(SYNC_AREA)):
            number = RunLocation.pass_number(item["Key"])
            if number is not None:
                found.append((number, item["Key"]))
        return sorted(found)

    def newest(self, run: RunLocation) -> SyncPass | None:
        """The run's newest sync pass manifest, or ``None`` when the sidecar has written none.

        :raises SyncVerificationError: the newest manifest is not JSON or not a valid sync pass.
        """
        found = self.numbers(run)
        if not found:
            return None
        number, key = found[-1]
        uri = s3_uri(run.bucket, key)
        try:
            document = self.store.read_json(run.bucket, key)
            record = SyncPassRecord.from_dict(document, uri)
        except (ValueError, RecordError) as exc:
            raise SyncVerificationError(str(exc)) from exc
        return SyncPass(number, uri, record)

    def final(self, run: RunLocation, *, checksums: bool = True) -> SyncPass:
        """The run's newest pass when it is final, complete and matches S3.

        :param checksums: compare SHA-256 digests too, not only sizes.
        :raises FinalPassPending: no pass yet, or the newest is not final.
        :raises SyncVerificationError: the final pass is incomplete or S3 does not match it.
        """
        found = self.newest(run)
        if found is None:
            raise FinalPassPending(
                f"no sync pass manifest under {s3_uri(run.bucket, run.area_prefix('sync'))}: the checkpoint-sync "
                "sidecar has not finished a pass for this run"
            )
        if not found.final:
            raise FinalPassPending(
                f"the newest sync pass {found.uri} (pass {found.number}) is not final: the sidecar has not "
                "finished its shutdown pass, so the newest checkpoints and output may be missing"
            )
        if not found.record.complete or found.record.errors:
            errors = "; ".join(f"{e.area}/{e.path}: {e.error}" for e in found.record.errors)
            raise SyncVerificationError(
                f"the final sync pass {found.uri} is incomplete: {errors or 'complete is false'}"
            )
        problems = self.verify_files(run, found.files, checksums=checksums)
        if problems:
            shown = problems[:MAX_LISTED_PROBLEMS]
            more = f" (and {len(problems) - len(shown)} more)" if len(problems) > len(shown) else ""
            raise SyncVerificationError(
                f"S3 does not match the final sync pass {found.uri}: {len(problems)} problem(s){more}:\n  "
                + "\n  ".join(shown)
            )
        return found

    def verify_files(
        self, run: RunLocation, files: Sequence[dict[str, Any]], *, checksums: bool = True
    ) -> list[str]:
        """Check that every listed file is in S3 with its size (and SHA-256); return the problems found.

        The SHA-256 is taken from the object's ``sha256`` metadata when the uploader set it,
        else computed by reading the object.

        :param files: the pass's files, as :attr:`SyncPass.files` lists them.
        :param checksums: compare SHA-256 digests too, not only sizes.
        """
        problems = []
        heads = self.store.head_many(
            run.bucket,
            [
                key
                for entry in files
                if entry.get("area") in ("checkpoints", "output")
                and isinstance(key := entry.get("key"), str)
                and key.startswith(run.area_prefix(entry["area"]))
            ],
        )
        for entry in files:
            area, path, key = entry.get("area"), entry.get("path"), entry.get("key")
            where = f"{area}/{path}"
            if (
                area not in ("checkpoints", "output")
                or not isinstance(key, str)
                or not key.startswith(run.area_prefix(area))
            ):
                problems.append(
                    f"{where}: key {key!r} is not inside the run's {area} area {run.area_prefix(str(area))}"
                )
                continue
            head = heads[key]
            if head is None:
                problems.append(f"{where}: missing from {s3_uri(run.bucket, key)}")
                continue
            if head["ContentLength"] != entry.get("size"):
                problems.append(
                    f"{where}: size in S3 is {head['ContentLength']}, the manifest says {entry.get('size')}"
                )
                continue
            if not checksums or not entry.get("sha256"):
                continue
            # Metadata names come back as the server keeps them: MinIO and rclone say "Sha256".
            metadata = {name.lower(): value for name, value in (head.get("Metadata") or {}).items()}
            actual = metadata.get("sha256") or self.store.sha256(run.bucket, key)
            if actual != entry["sha256"]:
                problems.append(f"{where}: sha256 in S3 is {actual}, the manifest says {entry['sha256']}")
        return problems

    def record(
        self, run: RunLocation, previous: SyncPass, files: list[dict[str, Any]], *, writer: str
    ) -> SyncPass:
        """Write the next pass manifest, final and complete, listing ``files`` (what is in S3 after pruning).

        Readers trust only the newest pass; after pruning it must list what is really there.

        :param previous: the pass the files were pruned from.
        :param files: the files left, as :attr:`SyncPass.files` lists them.
        :param writer: recorded as the pass's ``pod`` (who wrote it).
        """
        now = utc_stamp()
        number = previous.number + 1
        document = {
            **previous.document,
            "pass": number,
            "final": True,
            "complete": True,
            "started_at": now,
            "finished_at": now,
            "pod": writer,
            "files": files,
            "errors": [],
        }
        key = run.pass_key(number)
        record = SyncPassRecord.from_dict(document, s3_uri(run.bucket, key))
        uri = self.store.write_json(run.bucket, key, record.to_dict())
        return SyncPass(number, uri, record)

    def prune(
        self, run: RunLocation, files: list[dict[str, Any]], keep: int
    ) -> tuple[list[str], list[dict[str, Any]]]:
        """Delete checkpoints beyond the newest ``keep`` prefixes of each family.

        The newest prefixes are those the final pass lists; for them, exactly the listed files
        are kept. Objects of older prefixes (uploaded in earlier passes and since deleted in the
        pod) go. Files that are not numbered checkpoints (TensorFlow's ``checkpoint`` state file) stay.

        :param files: the final pass's files.
        :param keep: how many of each family's newest prefixes to keep.
        :return: the deleted keys and the pass's file list without the deleted files.
        """
        steps: dict[tuple[str, str], set[int]] = {}
        for entry in files:
            if entry.get("area") == "checkpoints" and (group := checkpoint_group(entry["path"])):
                steps.setdefault(group[0], set()).add(group[1])
        kept_steps = {family: set(sorted(found, reverse=True)[:keep]) for family, found in steps.items()}
        listed = {entry["key"] for entry in files}

        def keep_object(path: str, key: str) -> bool:
            group = checkpoint_group(path)
            if group is None:
                return True
            family, step = group
            return step in kept_steps.get(family, set()) and key in listed

        prefix = run.area_prefix("checkpoints")
        doomed = [
            item["Key"]
            for item in self.store.list(run.bucket, prefix)
            if not keep_object(item["Key"][len(prefix) :], item["Key"])
        ]
        if doomed:
            self.store.delete(run.bucket, doomed)
        gone = set(doomed)
        return doomed, [entry for entry in files if entry["key"] not in gone]

    def last_checkpoints(self, run: RunLocation, pods: Sequence[str]) -> dict[str, tuple[int | None, bool]]:
        """``{pod: (newest checkpointed step, final)}`` of the last sync pass each of ``pods`` wrote.

        For the run record's interruptions: the step a replaced pod left behind (where the next pod
        resumed) and whether its sidecar's shutdown pass kept it. The manifests are read leniently
        and in parallel (``read_many``); a pod that wrote no pass is left out.

        :param pods: the pod names to look for.
        """
        wanted = set(pods)
        if not wanted:
            return {}
        numbers = self.numbers(run)
        documents = self.store.read_many(run.bucket, [key for _, key in numbers])
        found: dict[str, tuple[int | None, bool]] = {}
        for document in documents:
            if not isinstance(document, dict) or document.get("pod") not in wanted:
                continue
            steps = [
                group[1]
                for entry in document.get("files") or []
                if isinstance(entry, dict)
                and entry.get("area") == "checkpoints"
                and (group := checkpoint_group(str(entry.get("path"))))
            ]
            found[str(document["pod"])] = (max(steps) if steps else None, bool(document.get("final")))
        return found

    def resumed_from_step(self, run: RunLocation) -> int | None:
        """The step the run's last pod resumed from, from its sync pass manifests; 0 when it started fresh.

        For containers that do not say so in metrics.json. Pass numbers continue across the pods
        of a run and pods follow each other, so the last pod's first pass is found by a binary
        search over the pass manifests (a few reads, however long the run); the pass before it
        is what that pod restored, and its newest checkpoint is the step it resumed from.
        ``None`` when the run has no pass manifests, or the previous pod's last pass lists no
        numbered checkpoint. The manifests are read leniently (only ``pod`` and ``files``): a
        record field is information here, never a reason to fail.
        """
        numbers = [number for number, _ in self.numbers(run)]
        if not numbers:
            return None
        pods: dict[int, str] = {}

        def pod(index: int) -> str:
            if index not in pods:
                document = self.store.read_json(run.bucket, run.pass_key(numbers[index]))
                pods[index] = str(document.get("pod") or "") if isinstance(document, dict) else ""
            return pods[index]

        last = len(numbers) - 1
        while last > 0 and pod(last).startswith("airflow:"):  # passes the promote step rewrote after pruning
            last -= 1
        trainer_pod = pod(last)
        low, high = 0, last
        while low < high:
            middle = (low + high) // 2
            if pod(middle) == trainer_pod:
                high = middle
            else:
                low = middle + 1
        if low == 0:
            return 0
        before = self.store.read_json(run.bucket, run.pass_key(numbers[low - 1]))
        steps = [
            group[1]
            for entry in (before if isinstance(before, dict) else {}).get("files") or []
            if entry.get("area") == "checkpoints" and (group := checkpoint_group(str(entry.get("path"))))
        ]
        return max(steps) if steps else None
