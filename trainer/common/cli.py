"""Process entry: logging, SIGTERM, and the mapping from failures to exit codes."""

from __future__ import annotations

import atexit
import logging
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from trainer.common.contract import (
    EXIT_DATAERR,
    EXIT_DIVERGED,
    EXIT_FAILURE,
    EXIT_NOINPUT,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_STOPPED,
    EXIT_USAGE,
    DataError,
    NoInputError,
    Preempted,
    TrainingDiverged,
    UsageError,
)
from trainer.common.signals import StopRequest

log = logging.getLogger("kubetrain.trainer")


def setup_logging() -> None:
    """Timestamped lines on stderr (what ``kubectl logs`` shows); TensorFlow's C++ chatter off."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    root = logging.getLogger()
    if not any(getattr(h, "_kubetrain", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        handler._kubetrain = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    log.setLevel(logging.INFO)
    # absl (TensorFlow's Python logging) repeats warnings we already explain.
    logging.getLogger("absl").setLevel(logging.ERROR)
    logging.getLogger("tensorflow").setLevel(logging.ERROR)


def run(train: Callable[[StopRequest], None]) -> int:
    """Run ``train`` with SIGTERM handling and return the process exit code."""
    setup_logging()
    stop = StopRequest().install()
    try:
        train(stop)
    except Preempted as exc:
        log.warning(
            "%s; exit code %d: run again to resume",
            str(exc) or "stopped by SIGTERM after checkpointing",
            EXIT_PREEMPTED,
        )
        return EXIT_PREEMPTED
    except UsageError as exc:
        log.error("%s", exc)
        return EXIT_USAGE
    except NoInputError as exc:
        log.error("%s", exc)
        return EXIT_NOINPUT
    except DataError as exc:
        log.error("%s", exc)
        return EXIT_DATAERR
    except TrainingDiverged as exc:
        log.error("%s", exc)
        return EXIT_DIVERGED
    except KeyboardInterrupt:
        log.error("interrupted")
        return 130
    except Exception:
        log.exception("training failed")
        return EXIT_FAILURE
    finally:
        stop.uninstall()
    if stop.file_request is not None:
        log.info("stopped on request (%s); exit code %d", stop.stop_file, EXIT_STOPPED)
        return EXIT_STOPPED
    return EXIT_OK


def exit_process(code: int) -> NoReturn:
    """End the trainer's process with ``code``, its exit handlers run, the interpreter's teardown skipped.

    When a trainer's ``main`` returns, its outputs are written and closed (each JSON file
    renamed into place, the checkpoints saved, the summaries closed). What the interpreter
    still did on its way out, once the exit handlers had run (1 ms: logging's flush,
    multiprocessing's and Pillow's), was to free every module's objects and run TensorFlow's
    C++ destructors: 0.9 to 1.2 s on a 2-core machine, between the last line of the log and the
    kubelet seeing the container exit, on every run and sweep trial (bench/notes/sweep.md). The
    handlers are run here as the interpreter runs them (``atexit._run_exitfuncs``: the standard
    library has no public call for it), the standard streams flushed, and the process ends.
    """
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing left to say there
            pass
    os._exit(code)
