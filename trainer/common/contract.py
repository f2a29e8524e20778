"""The training pod contract: directories, run metadata, exit codes and atomic writes.

A sidecar uploads CHECKPOINT_DIR and OUTPUT_DIR while the trainer writes them, so every
file goes to a hidden temporary name in the same directory first and is then renamed
into place: a reader sees either the old complete file or the new complete file.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Exit codes, documented in each trainer's --help (made from the table) and in trainer/README.md: the contract's
# one table, which the Airflow side's operators follow too. Re-exported for the trainers.
from kubetrain_contract.exit_codes import (  # noqa: F401
    EXIT_DATAERR,
    EXIT_DIVERGED,
    EXIT_FAILURE,
    EXIT_NOINPUT,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_STOPPED,
    EXIT_USAGE,
    exit_codes_help,
)
from kubetrain_contract.json_values import json_safe
from kubetrain_contract.pod import Env

EXIT_CODES_EPILOG = (
    exit_codes_help()
    + f"""
environment (flags win over the environment):
  DATA_DIR, CHECKPOINT_DIR, OUTPUT_DIR   the pod contract directories
  KUBETRAIN_DATASET_VERSION              recorded in params.json
  KUBETRAIN_IMAGE, KUBETRAIN_CODE_VERSION  recorded in params.json
  KUBETRAIN_STOP_FILE                    checked between steps; when it appears, stop (exit {EXIT_STOPPED})
"""
)

CONTRACT_DIRS = {"data_dir": Env.DATA_DIR, "checkpoint_dir": Env.CHECKPOINT_DIR, "output_dir": Env.OUTPUT_DIR}


class UsageError(ValueError):
    """A flag value or combination that cannot work (exit code 2)."""


class DataError(ValueError):
    """The data cannot be trained on (exit code 65)."""


class NoInputError(OSError):
    """DATA_DIR is missing or unreadable (exit code 66)."""


class TrainingDiverged(ArithmeticError):
    """The loss, the gradients or the weights stopped being finite (exit code 3)."""


class Preempted(Exception):
    """SIGTERM arrived; the state is checkpointed and the process should exit with 75."""


@dataclass(frozen=True)
class RunInfo:
    """Where the run's inputs came from, as the Airflow side tells the pod."""

    dataset_version: str | None
    image: str | None
    code_version: str | None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RunInfo:
        """Read KUBETRAIN_DATASET_VERSION, KUBETRAIN_IMAGE and KUBETRAIN_CODE_VERSION."""
        env = os.environ if environ is None else environ
        return cls(
            dataset_version=env.get(Env.DATASET_VERSION) or None,
            image=env.get(Env.IMAGE) or None,
            code_version=env.get(Env.CODE_VERSION) or None,
        )


def check_data_dir(path: str | os.PathLike[str] | None) -> Path:
    """Return DATA_DIR as a Path after checking it is a readable directory.

    Raises:
        NoInputError: naming the path and what is wrong with it, or that none was given.
    """
    if path is None or str(path) == "":
        raise NoInputError("DATA_DIR is not set: expected --data-dir or the DATA_DIR variable")
    data = Path(path)
    if not data.exists():
        raise NoInputError(f"DATA_DIR {str(data)!r} does not exist; expected a directory holding the dataset")
    if not data.is_dir():
        raise NoInputError(
            f"DATA_DIR {str(data)!r} is not a directory; expected a directory holding the dataset"
        )
    try:
        next(os.scandir(data), None)
    except OSError as exc:
        raise NoInputError(f"DATA_DIR {str(data)!r} cannot be read: {exc.strerror or exc}") from exc
    return data


def prepare_dir(path: str | os.PathLike[str] | None, what: str) -> Path:
    """Create a writable output directory (CHECKPOINT_DIR or OUTPUT_DIR) if needed."""
    if path is None or str(path) == "":
        raise UsageError(
            f"{what} is not set: expected --{what.lower().replace('_', '-')} or the {what} variable"
        )
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{what} {str(out)!r} cannot be created: {exc.strerror or exc}") from exc
    if not os.access(out, os.W_OK):
        raise UsageError(f"{what} {str(out)!r} is not writable")
    return out


def _temp_name(target: Path, suffix: str = "") -> Path:
    return target.with_name(f".{target.name}.tmp-{os.getpid()}{suffix}")


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    target = Path(path)
    tmp = _temp_name(target)
    try:
        with open(tmp, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def write_json_atomic(path: str | os.PathLike[str], obj: Any) -> Path:
    """Write ``obj`` as indented UTF-8 JSON, atomically (NaN becomes null)."""
    text = json.dumps(json_safe(obj), indent=2, sort_keys=False, ensure_ascii=False, allow_nan=False) + "\n"
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_csv_atomic(
    path: str | os.PathLike[str], header: Sequence[str], rows: Iterable[Sequence[Any]]
) -> Path:
    """Write a CSV file with a header row, atomically."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return write_bytes_atomic(path, buf.getvalue().encode("utf-8"))


def write_params(
    output_dir: Path, trainer: str, hyperparameters: Mapping[str, Any], run: RunInfo, **extra: Any
) -> Path:
    """params.json: every hyperparameter plus the dataset version, image and code version."""
    doc: dict[str, Any] = {
        "trainer": trainer,
        "hyperparameters": dict(hyperparameters),
        "dataset_version": run.dataset_version,
        "image": run.image,
        "code_version": run.code_version,
    }
    doc.update(extra)
    return write_json_atomic(output_dir / "params.json", doc)


def temp_path_for(path: str | os.PathLike[str], suffix: str = "") -> Path:
    """A hidden temporary sibling of ``path`` for writers that need a file name (Keras)."""
    return _temp_name(Path(path), suffix)


def replace_dir_atomic(tmp_dir: Path, target: Path) -> Path:
    """Move a fully written ``tmp_dir`` to ``target``, replacing an older one.

    A directory cannot be renamed over a non-empty one, so the old tree is first renamed
    aside; readers may briefly find no ``target`` but never a half-written one.
    """
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        if old.exists():
            shutil.rmtree(old)
        os.replace(target, old)
    os.replace(tmp_dir, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return target
