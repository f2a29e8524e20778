"""Command line: ``python -m trainer.sync stage-in|checkpoint-sync|restore|probe``.

Every flag has an environment variable (named in ``--help``); a flag given on the command
line wins. S3 credentials come only from the standard AWS variables or workload identity.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

# A native sidecar can get its SIGTERM while Python is still starting, when the training
# container ends within a second: remember it, so that the final pass still runs.
EARLY_SIGTERM = threading.Event()
if len(sys.argv) > 1 and sys.argv[1] == "checkpoint-sync":
    signal.signal(signal.SIGTERM, lambda *_: EARLY_SIGTERM.set())

from kubetrain_contract.cluster import ClusterError  # noqa: E402
from kubetrain_contract.pod import Env  # noqa: E402
from trainer.sync.errors import SyncError, parse_s3_uri  # noqa: E402
from trainer.sync.progress import log  # noqa: E402
from trainer.sync.s3 import S3  # noqa: E402
from trainer.sync.transfer import DEFAULT_MD5_MAX_SIZE, VERIFY_MODES  # noqa: E402


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise ValueError("expected a number of seconds >= 0")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("expected a whole number >= 1")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("expected a whole number >= 0")
    return value


def _ratio(text: str) -> float:
    value = float(text)
    if not value >= 1:
        raise ValueError("expected a ratio >= 1")
    return value


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected true or false")


class _Options:
    """Adds flags whose defaults come from environment variables, checked like the flags."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser

    def add(
        self,
        flag: str,
        env: str | None,
        help: str,
        *,
        conv: Callable[[str], Any] = str,
        default: Any = None,
        required: bool = False,
        **kwargs: Any,
    ) -> None:
        raw = os.environ.get(env) if env else None
        if raw is not None and raw != "":
            try:
                default = conv(raw)
            except ValueError as exc:
                self.parser.error(f"{env}={raw!r} is not valid: {exc}")
        shown = (
            f" (env {env}" + (f", default {default}" if default not in (None, False) else "") + ")"
            if env
            else ""
        )

        def typed(text: str) -> Any:
            try:
                return conv(text)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(f"{text!r} is not valid: {exc}") from exc

        if kwargs.get("action") == "store_true":
            self.parser.add_argument(flag, help=help + shown, default=bool(default), **kwargs)
            return
        self.parser.add_argument(
            flag,
            help=help + shown,
            type=typed,
            default=default,
            required=required and default is None,
            **kwargs,
        )


def _common(opts: _Options, workers: int) -> None:
    opts.add("--workers", Env.SYNC_WORKERS, "concurrent S3 requests", conv=_positive_int, default=workers)
    opts.add(
        "--progress-interval",
        Env.PROGRESS_INTERVAL,
        "seconds between progress lines (0: summary only)",
        conv=_seconds,
        default=5.0,
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the commands."""
    from trainer.sync.transfer import default_workers

    parser = argparse.ArgumentParser(
        prog="python -m trainer.sync", description="kubetrain's pod-side S3 transfer tool."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "stage-in",
        help="download a staged dataset into DATA_DIR and restore this run's checkpoints",
        description="Download a staged dataset snapshot into DATA_DIR, verifying every object, extract its "
        "archives safely, then restore this run's newest verified checkpoints into CHECKPOINT_DIR.",
    )
    o = _Options(p)
    o.add("--manifest", Env.DATASET_MANIFEST, "s3:// URI of the dataset manifest", required=True)
    o.add("--data-dir", Env.DATA_DIR, "where the dataset goes", conv=Path, default=Path("/data"))
    o.add(
        "--checkpoint-dir",
        Env.CHECKPOINT_DIR,
        "where checkpoints are restored",
        conv=Path,
        default=Path("/checkpoints"),
    )
    o.add("--run-uri", Env.RUN_URI, "s3:// URI of this run (unset: restore nothing)")
    o.add("--cache-dir", Env.CACHE_DIR, "stage-in cache keyed by dataset version", conv=Path)
    o.add(
        "--prepared-uri",
        Env.PREPARED_URI,
        "s3:// prefix of this dataset version's prepared copies, downloaded when complete (unset: none)",
    )
    o.add(
        "--prepared-dir",
        Env.PREPARED_DIR,
        "where the prepared copies go (default DATA_DIR/.kubetrain-prepared)",
        conv=Path,
    )
    o.add(
        "--keep-archives",
        Env.KEEP_ARCHIVES,
        "keep archives after extracting them",
        conv=_bool,
        action="store_true",
    )
    o.add(
        "--max-extract-ratio",
        Env.MAX_EXTRACT_RATIO,
        "most uncompressed bytes per compressed byte",
        conv=_ratio,
        default=250.0,
    )
    o.add(
        "--max-extract-bytes",
        Env.MAX_EXTRACT_BYTES,
        "most bytes one archive may expand to",
        conv=_positive_int,
        default=100 * 1024**3,
    )
    o.add(
        "--max-extract-members",
        Env.MAX_EXTRACT_MEMBERS,
        "most members one archive may have",
        conv=_positive_int,
        default=1_000_000,
    )
    o.add(
        "--min-extract-member-bytes",
        Env.MIN_EXTRACT_MEMBER_BYTES,
        "fewest bytes of an archive per member: an archive may have at most max(10,000, its size / this) "
        "members (0: no such limit) (default 8)",
        conv=_non_negative_int,
        default=8,
    )
    o.add(
        "--verify",
        Env.VERIFY,
        "auto: size, ETag, and the content against the store's checksum (CRC64NVME, CRC32C, CRC32, SHA) "
        "where it keeps one, else against the ETag's MD5 up to --md5-max-size; md5: the MD5 of every "
        "object; size: sizes only",
        choices=list(VERIFY_MODES),
        default="auto",
    )
    o.add(
        "--md5-max-size",
        Env.MD5_MAX_SIZE,
        "with --verify auto, the largest object (bytes) whose MD5 is computed when the store keeps no "
        "checksum of it",
        conv=_non_negative_int,
        default=DEFAULT_MD5_MAX_SIZE,
    )
    o.add(
        "--part-size",
        Env.PART_SIZE,
        "part size in bytes of multipart-uploaded objects, when S3 will not tell it",
        conv=_positive_int,
    )
    _common(o, default_workers())

    p = sub.add_parser(
        "checkpoint-sync",
        help="upload CHECKPOINT_DIR and OUTPUT_DIR to the run every few seconds (sidecar)",
        description="Upload new or changed files from CHECKPOINT_DIR and OUTPUT_DIR to the run every INTERVAL "
        "seconds and commit each pass with a manifest; on SIGTERM run a final pass and exit.",
    )
    o = _Options(p)
    o.add("--run-uri", Env.RUN_URI, "s3:// URI of this run", required=True)
    o.add(
        "--checkpoint-dir",
        Env.CHECKPOINT_DIR,
        "checkpoints to upload",
        conv=Path,
        default=Path("/checkpoints"),
    )
    o.add("--output-dir", Env.OUTPUT_DIR, "outputs to upload", conv=Path, default=Path("/output"))
    o.add(
        "--data-dir",
        Env.DATA_DIR,
        "the dataset, whose .kubetrain-prepared folder holds the prepared copies",
        conv=Path,
        default=Path("/data"),
    )
    o.add(
        "--prepared-uri",
        Env.PREPARED_URI,
        "s3:// prefix of this dataset version's prepared copies: upload each copy the trainer makes that "
        "is not there yet (unset: none)",
    )
    o.add(
        "--prepared-dir",
        Env.PREPARED_DIR,
        "where the trainer keeps its prepared copies (default DATA_DIR/.kubetrain-prepared)",
        conv=Path,
    )
    o.add("--interval", Env.SYNC_INTERVAL, "seconds between passes", conv=_seconds, default=30.0)
    o.add(
        "--quiet",
        Env.SYNC_QUIET,
        "seconds a file must be unmodified before upload",
        conv=_seconds,
        default=2.0,
    )
    o.add(
        "--settle",
        Env.SYNC_SETTLE,
        "final pass: seconds a recently modified file must hold still",
        conv=_seconds,
        default=0.5,
    )
    o.add(
        "--grace",
        Env.SYNC_GRACE,
        "final pass: seconds until exit, whatever is left",
        conv=_seconds,
        default=25.0,
    )
    o.add(
        "--early-stopping",
        Env.EARLY_STOPPING,
        "stop this sweep trial early by a rule: median, asha or hyperband (README, 'Median stopping')",
        choices=["off", "median", "asha", "hyperband"],
        default="off",
    )
    o.add("--objective", Env.OBJECTIVE, "median stopping: the metric of history.csv or metrics.jsonl")
    o.add(
        "--objective-mode",
        Env.OBJECTIVE_MODE,
        "median stopping: max or min",
        choices=["max", "min"],
        default="max",
    )
    o.add(
        "--min-trials",
        Env.MEDIAN_MIN_TRIALS,
        "median stopping: finished trials needed first",
        conv=_positive_int,
        default=3,
    )
    o.add(
        "--start-step",
        Env.MEDIAN_START_STEP,
        "median stopping: reports before a trial may be stopped",
        conv=_positive_int,
        default=4,
    )
    o.add(
        "--trials-uri",
        Env.SWEEP_TRIALS_URI,
        "median stopping: s3:// prefix of the finished trial records",
    )
    o.add(
        "--stop-file",
        Env.STOP_FILE,
        "median stopping: the file that tells the trainer to stop",
        conv=Path,
    )
    o.add(
        "--min-resource",
        Env.ASHA_MIN_RESOURCE,
        "asha, hyperband: reports at the first rung",
        conv=_positive_int,
        default=1,
    )
    o.add(
        "--reduction-factor",
        Env.ASHA_REDUCTION_FACTOR,
        "asha, hyperband: eta, the top 1/eta of a rung go on",
        conv=_positive_int,
        default=3,
    )
    o.add(
        "--asha-grace",
        Env.ASHA_GRACE,
        "asha, hyperband: reports before a trial may be stopped",
        conv=_positive_int,
        default=1,
    )
    o.add(
        "--max-resource",
        Env.ASHA_MAX_RESOURCE,
        "asha, hyperband: a trial's reports at full training (no rung at or above it)",
        conv=_positive_int,
    )
    o.add(
        "--brackets",
        Env.ASHA_BRACKETS,
        "asha, hyperband: the sweep's brackets (1 for asha)",
        conv=_positive_int,
        default=1,
    )
    o.add(
        "--bracket",
        Env.ASHA_BRACKET,
        "hyperband: this trial's bracket",
        conv=_non_negative_int,
        default=0,
    )
    o.add("--trial", Env.SWEEP_TRIAL, "asha, hyperband: this trial's number", conv=_non_negative_int)
    o.add(
        "--rungs-uri",
        Env.SWEEP_RUNGS_URI,
        "asha, hyperband: s3:// prefix of the sweep's rung reports",
    )
    _common(o, 8)

    p = sub.add_parser(
        "restore",
        help="download the files of the run's newest verified pass manifest",
        description="Download the files of the run's newest complete pass manifest whose files all verify "
        "(size and sha256).",
    )
    o = _Options(p)
    o.add("--run-uri", Env.RUN_URI, "s3:// URI of this run", required=True)
    o.add(
        "--checkpoint-dir",
        Env.CHECKPOINT_DIR,
        "where checkpoints go",
        conv=Path,
        default=Path("/checkpoints"),
    )
    o.add(
        "--output-dir",
        Env.OUTPUT_DIR,
        "where outputs go (with --area output)",
        conv=Path,
        default=Path("/output"),
    )
    p.add_argument(
        "--area",
        action="append",
        choices=["checkpoints", "output"],
        help="area to restore; repeat for both (default: checkpoints)",
    )
    _common(o, default_workers())

    p = sub.add_parser(
        "probe",
        help="the preflight's S3 checks from a pod: list, bucket regions, write/read/delete",
        description="List the datasets bucket, ask S3 each bucket's region, and write, read back through the "
        "download engine and delete a small object at SCRATCH_URI; the last line is KUBETRAIN_PROBE <json>.",
    )
    p.add_argument("--datasets-bucket", required=True, help="the bucket of the users' datasets")
    p.add_argument(
        "--scratch-uri", required=True, help="s3:// key in the training bucket to write and delete"
    )
    return parser


def _rung_stopper(s3: Any, args: argparse.Namespace) -> Any:
    """The sidecar's asha or hyperband early stopping (trainer.sync.asha); refuses missing settings."""
    from trainer.sync.asha import RungRule, RungStopper

    missing = [
        flag
        for flag, value in (
            ("--objective", args.objective),
            ("--trials-uri", args.trials_uri),
            ("--rungs-uri", args.rungs_uri),
            ("--trial", args.trial),
            ("--stop-file", args.stop_file),
        )
        if value is None or value == ""
    ]
    if missing:
        raise SyncError(
            f"{args.early_stopping} stopping needs {', '.join(missing)} (or their KUBETRAIN_* variables)"
        )
    try:
        rule = RungRule(
            args.objective,
            args.objective_mode,
            min_resource=args.min_resource,
            reduction_factor=args.reduction_factor,
            grace=args.asha_grace,
            max_resource=args.max_resource,
            bracket=args.bracket,
            brackets=args.brackets,
            name=args.early_stopping,
        )
    except ValueError as exc:
        raise SyncError(str(exc)) from None
    log(
        f"checkpoint-sync: {rule.name} stopping of {rule.objective} ({rule.mode}): bracket {rule.bracket} of "
        f"{rule.brackets}, rungs at {rule.first_rung} * {rule.reduction_factor}**k reports from report "
        f"{rule.start_step}" + (f" below {rule.max_resource}" if rule.max_resource else "")
    )
    return RungStopper(
        s3,
        rule,
        trial=args.trial,
        run=parse_s3_uri(args.run_uri, Env.RUN_URI),
        trials=parse_s3_uri(args.trials_uri, Env.SWEEP_TRIALS_URI),
        rungs=parse_s3_uri(args.rungs_uri, Env.SWEEP_RUNGS_URI),
        output_dir=args.output_dir,
        stop_file=args.stop_file,
    )


def _median_stopper(s3: Any, args: argparse.Namespace) -> Any:
    """The sidecar's early stopping: median when KUBETRAIN_EARLY_STOPPING is median, the rung rule
    for asha and hyperband; refuses missing settings."""
    if args.early_stopping in ("asha", "hyperband"):
        return _rung_stopper(s3, args)
    if args.early_stopping != "median":
        return None
    from trainer.sync.median import MedianRule, MedianStopper

    missing = [
        flag
        for flag, value in (
            ("--objective", args.objective),
            ("--trials-uri", args.trials_uri),
            ("--stop-file", args.stop_file),
        )
        if not value
    ]
    if missing:
        raise SyncError(f"median stopping needs {', '.join(missing)} (or their KUBETRAIN_* variables)")
    try:
        rule = MedianRule(args.objective, args.objective_mode, args.min_trials, args.start_step)
    except ValueError as exc:
        raise SyncError(str(exc)) from None
    trials = parse_s3_uri(args.trials_uri, Env.SWEEP_TRIALS_URI)
    log(
        f"checkpoint-sync: median stopping of {rule.objective} ({rule.mode}) after {rule.start_step} reports, "
        f"once {rule.min_trials} trials of {trials} have finished"
    )
    return MedianStopper(
        s3,
        rule,
        run=parse_s3_uri(args.run_uri, Env.RUN_URI),
        trials=trials,
        output_dir=args.output_dir,
        stop_file=args.stop_file,
    )


def main(argv: list[str] | None = None) -> int:
    """Run a command; the exit status (0 ok, 1 failed, 2 bad usage)."""
    args = build_parser().parse_args(argv)
    label = args.command
    try:
        if args.command == "stage-in":
            from trainer.sync.archive import ExtractLimits
            from trainer.sync.stagein import StageInConfig, stage_in

            cfg = StageInConfig(
                manifest=parse_s3_uri(args.manifest, "dataset manifest"),
                data_dir=args.data_dir,
                checkpoint_dir=args.checkpoint_dir,
                run=parse_s3_uri(args.run_uri, Env.RUN_URI) if args.run_uri else None,
                cache_dir=args.cache_dir,
                keep_archives=args.keep_archives,
                limits=ExtractLimits(
                    args.max_extract_ratio,
                    args.max_extract_bytes,
                    args.max_extract_members,
                    args.min_extract_member_bytes,
                ),
                workers=args.workers,
                progress_interval=args.progress_interval,
                verify=args.verify,
                part_size=args.part_size,
                md5_max_size=args.md5_max_size,
                prepared=parse_s3_uri(args.prepared_uri, Env.PREPARED_URI) if args.prepared_uri else None,
                prepared_dir=args.prepared_dir,
            )
            stage_in(S3(pool=max(10, args.workers), small_calls_on_crt=True), cfg)
            return 0
        if args.command == "probe":
            from trainer.sync.probe import probe

            probe(
                S3(max_attempts=2, read_timeout=10),
                args.datasets_bucket,
                parse_s3_uri(args.scratch_uri, "--scratch-uri"),
            )
            return 0
        if args.command == "restore":
            from trainer.sync.restore import restore

            areas = args.area or ["checkpoints"]
            dirs = {"checkpoints": args.checkpoint_dir, "output": args.output_dir}
            restore(
                S3(pool=max(10, args.workers), small_calls_on_crt=True),
                parse_s3_uri(args.run_uri, Env.RUN_URI),
                {a: dirs[a] for a in areas},
                workers=args.workers,
                progress_interval=args.progress_interval,
            )
            return 0
        from trainer.sync.replica import idle_reason

        idle = idle_reason(os.environ)
        if idle:  # a replica of a job whose replicas share one pod template: the chief's sidecar syncs
            log(f"{label}: idle until the pod ends: {idle}")
            EARLY_SIGTERM.wait()
            return 0
        from trainer.sync.prepared import PREPARED_DIR_NAME
        from trainer.sync.sidecar import Sidecar, SyncConfig

        s3 = sidecar_s3(args.workers)
        sidecar = Sidecar(
            s3,
            SyncConfig(
                run=parse_s3_uri(args.run_uri, Env.RUN_URI),
                dirs={"checkpoints": args.checkpoint_dir, "output": args.output_dir},
                interval=args.interval,
                quiet=args.quiet,
                settle=args.settle,
                grace=args.grace,
                workers=args.workers,
                prepared=parse_s3_uri(args.prepared_uri, Env.PREPARED_URI) if args.prepared_uri else None,
                prepared_dir=args.prepared_dir or args.data_dir / PREPARED_DIR_NAME,
            ),
            stopper=_median_stopper(s3, args),
        )
        code = sidecar.run(stopped=EARLY_SIGTERM.is_set())
        # S3 calls abandoned on SIGTERM or at the end of the grace period may still hang in
        # their threads (bounded by their timeouts): they must not hold the exit
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    except (SyncError, ClusterError) as exc:
        log(f"{label}: ERROR: {exc}")
        return 1
    except KeyboardInterrupt:
        log(f"{label}: interrupted")
        return 130


def sidecar_s3(workers: int) -> S3:
    """The checkpoint sidecar's S3 access: with keys in the environment, every call through the CRT
    (botocore's import and client cost 0.34 CPU-seconds, a fifth of a checkpoint's final pass)."""
    return S3(pool=max(10, workers), small_calls_on_crt=True)


if __name__ == "__main__":
    status = main()
    # Every command's work is done and its files closed here. The interpreter's own teardown (the
    # engine's event-loop threads joined, every module's objects freed) cost a stage-in of 2,000
    # objects 80 ms of wall time after its last file was in place (bench/notes/transfer-profile.md),
    # about half as long as its own start: skipped, as the sidecar does on its way out.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
