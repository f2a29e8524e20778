"""The training container's exit codes: what each means and whether a retry could help.

The trainers exit with these (their ``--help`` and trainer/README.md list them); the training and
sweep operators fail a task without its retries on each code whose ``retry`` is false.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExitCode:
    """One exit code: its number, its constant's name, what it means, whether a retry could help, and what a
    user can do about it (``advice``, shown in the trainers' ``--help``)."""

    code: int
    name: str
    meaning: str
    retry: bool
    advice: str = ""


EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2  # argparse's own convention
EXIT_DIVERGED = 3
EXIT_DATAERR = 65  # EX_DATAERR
EXIT_NOINPUT = 66  # EX_NOINPUT
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: told apart from 143 (SIGTERM unhandled) and 137 (SIGKILL)
EXIT_STOPPED = 79

EXIT_CODES: tuple[ExitCode, ...] = (
    ExitCode(EXIT_OK, "EXIT_OK", "training finished; OUTPUT_DIR holds the contract files", retry=False),
    ExitCode(EXIT_FAILURE, "EXIT_FAILURE", "unexpected error", retry=True),
    ExitCode(
        EXIT_USAGE,
        "EXIT_USAGE",
        "bad parameters: a bad flag value or combination, or a checkpoint that does not fit them",
        retry=False,
    ),
    ExitCode(
        EXIT_DIVERGED,
        "EXIT_DIVERGED",
        "training diverged: the loss or the weights stopped being finite (the last finite checkpoint is kept)",
        retry=False,
        advice="lower the learning rate, clip the gradients, check the data",
    ),
    ExitCode(
        EXIT_DATAERR,
        "EXIT_DATAERR",
        "unusable data (empty, a single class, no parsable pairs, ...)",
        retry=False,
    ),
    # the stage-in container succeeded, so a DATA_DIR the trainer cannot find or read is the container's own
    # setting or permissions: a retry would find the same
    ExitCode(EXIT_NOINPUT, "EXIT_NOINPUT", "DATA_DIR missing or unreadable", retry=False),
    ExitCode(
        EXIT_PREEMPTED,
        "EXIT_PREEMPTED",
        "SIGTERM received after a checkpoint was written: a rerun resumes",
        retry=True,
        advice="run again with the same CHECKPOINT_DIR to resume (EX_TEMPFAIL: not 143, death by SIGTERM)",
    ),
    # a sweep's trial stopped by its early-stopping rule ends as a success (the sweep's operator decides); a run
    # stopped by hand is retried as any other interruption
    ExitCode(
        EXIT_STOPPED,
        "EXIT_STOPPED",
        "stopped on request (the stop file appeared): outputs written",
        retry=True,
        advice="a sweep's early stopping writes KUBETRAIN_STOP_FILE; the best epoch's model is the output",
    ),
)


def exit_codes_help(width: int = 100) -> str:
    """The ``exit codes:`` section of a trainer's ``--help``, made from :data:`EXIT_CODES`."""
    import textwrap

    lines = ["exit codes:"]
    for entry in EXIT_CODES:
        text = entry.meaning + (f"; {entry.advice}" if entry.advice else "")
        lines += textwrap.wrap(
            text,
            width,
            initial_indent=f"  {entry.code:<3} ",
            subsequent_indent="      ",
            break_on_hyphens=False,
        )
    return "\n".join(lines) + "\n"


def final_exit_codes() -> dict[int, str]:
    """``{code: meaning}`` of the failures a retry would only repeat."""
    return {c.code: c.meaning for c in EXIT_CODES if c.code != EXIT_OK and not c.retry}
