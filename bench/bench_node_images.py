"""The node's image cache: how big the sync and CPU trainer images are, what pulling them costs on a cold and
a warm node, and what a code-only update (AppendLayerOperator's one layer) costs the next pod's start.

Starts a private dev stack, pushes the CPU trainer and sync images (built from their Dockerfiles) to its
registry, then, on a local Kubernetes API of its own:

* sizes: compressed (the registry's manifest) and unpacked (the node's store);
* pull + unpack of each image into an empty store (cold node), then again into the same store (warm node,
  pull policy Always: the reference is resolved, nothing is fetched);
* pod start (pod created -> its container running) of the trainer image on a warm node, three ways:
  unchanged image; a new code layer appended to it (a new digest whose base layers the node has);
  the same appended image on a node with an empty store (a full re-pull, what a node without the cache pays);
* the per-container cost of the store and of runc: ``buildah from`` + ``mount`` + ``rm`` of the trainer's
  root file system, and starting a container with runc.

Target: the appended code layer starts the next pod within 2 s of an unchanged image. Results go to
bench/results/images.md, with the load average before and after.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "plugins"), str(Path(__file__).parent)]

from bench_sweep import publish_images  # noqa: E402

from include.devstack.kubeapi.images import ImageStore  # noqa: E402
from include.devstack.stack import Stack  # noqa: E402

RESULTS = REPO / "bench" / "results" / "images.md"
RUNS = 3
TARGET_S = 2.0


def load() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def manifest(registry: str, repository: str, tag: str) -> tuple[str, dict]:
    from kubetrain.imagebuild.oci import RegistryClient

    with RegistryClient(registry, insecure=True, timeout=30) as client:
        got = client.get_manifest(repository, tag)
    return got.digest, got.data


def store_sizes(store: Path) -> dict[str, int]:
    layers = json.loads((store / "storage" / "overlay-layers" / "layers.json").read_text())
    return {layer.get("compressed-diff-digest", ""): int(layer.get("diff-size", 0)) for layer in layers}


async def timed_pull(store: ImageStore, image: str) -> float:
    start = time.monotonic()
    await store.pull(image, "Always")
    return time.monotonic() - start


async def measure_store(
    store: ImageStore, store_dir: Path, registry: str, images: dict, trainer: str
) -> tuple:
    """Pulls (cold, then warm) of each image into an empty store, then the per-container costs."""
    rows = []
    for what, (repository, tag) in images.items():
        digest, data = manifest(registry, repository, tag)
        image = f"{registry}/{repository}@{digest}"
        cold = await timed_pull(store, image)
        warm = [await timed_pull(store, image) for _ in range(RUNS)]
        unpacked = store_sizes(store_dir)
        layer_digests = [layer["digest"] for layer in data["layers"]]
        size = (
            sum(layer["size"] for layer in data["layers"]),
            sum(unpacked.get(d, 0) for d in layer_digests),
            len(layer_digests),
        )
        rows.append((what, size, cold, statistics.median(warm)))
    found, _ = await store.pull(trainer, "Always")
    rootfs = []
    for i in range(5):
        start = time.monotonic()
        await store.create_rootfs(f"bench-{i}", found)
        await store.remove_rootfs(f"bench-{i}")
        rootfs.append(time.monotonic() - start)
    root = await store.create_rootfs("bench-runc", found)
    runc = runc_start(root, 5)
    await store.remove_rootfs("bench-runc")
    return rows, rootfs, runc


def runc_start(root: Path, runs: int) -> list[float]:
    """runc run of `true` in a prepared bundle of the trainer's root file system (the runtime's own cost)."""
    times = []
    with tempfile.TemporaryDirectory(prefix="runc-bench-") as tmp:
        spec = {
            "ociVersion": "1.0.2-dev",
            "process": {
                "terminal": False,
                "user": {"uid": 10001, "gid": 10001},
                "args": ["/bin/true"],
                "env": ["PATH=/usr/bin:/bin"],
                "cwd": "/",
            },
            "root": {"path": str(root)},
            "hostname": "bench",
            "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
            "linux": {"namespaces": [{"type": "pid"}, {"type": "mount"}, {"type": "uts"}, {"type": "ipc"}]},
        }
        (Path(tmp) / "config.json").write_text(json.dumps(spec))
        for i in range(runs):
            start = time.monotonic()
            subprocess.run(
                ["runc", "--root", f"{tmp}/state", "run", "--bundle", tmp, f"bench-{i}"],
                check=True,
                capture_output=True,
            )
            times.append(time.monotonic() - start)
    return times


class Node:
    """A local Kubernetes API with an image store of its own (tests/devstack/support.py starts it)."""

    def __init__(self, tmp: Path, store: Path, mirror: str) -> None:
        from kubernetes import client

        from tests.devstack.support import start_server

        home = tmp / f"node-{store.name}"
        home.mkdir()
        self.api, self.proc = start_server(home, "--image-store", str(store), mirror=mirror)
        self.core = client.CoreV1Api(self.api.api_client())

    def pod_start(self, name: str, image: str) -> float:
        """Seconds from the pod's creation to its container running (the image's command starts)."""
        from kubernetes import watch

        body = {
            "metadata": {"name": name},
            "spec": {
                "restartPolicy": "Never",
                "containers": [
                    {"name": "main", "image": image, "imagePullPolicy": "Always", "command": ["sleep", "30"]}
                ],
            },
        }
        start = time.monotonic()
        self.core.create_namespaced_pod("default", body)
        for event in watch.Watch().stream(
            self.core.list_namespaced_pod,
            "default",
            field_selector=f"metadata.name={name}",
            timeout_seconds=600,
        ):
            statuses = event["object"].status.container_statuses or []
            if statuses and (statuses[0].state.running or statuses[0].state.terminated):
                took = time.monotonic() - start
                break
        else:
            raise SystemExit(f"pod {name} did not start")
        self.core.delete_namespaced_pod(name, "default", grace_period_seconds=0)
        return took

    def stop(self) -> None:
        from tests.devstack.support import stop_server

        stop_server(self.proc)


def append_code(registry: str, base: str, marker: int, tmp: Path) -> str:
    """AppendLayerOperator's operation: the trainer package with a one-line change, appended as one layer."""
    from kubetrain.imagebuild.append import AppendSpec, append_layer
    from kubetrain.imagebuild.oci import RegistryClient
    from kubetrain.imagebuild.reference import parse_reference

    code = tmp / f"code-{marker}"
    shutil.copytree(REPO / "trainer", code, ignore=shutil.ignore_patterns(".venv", "__pycache__", "*.pyc"))
    (code / "bench_marker.py").write_text(f"MARKER = {marker}\n")
    spec = AppendSpec(source=code, dest="/app/trainer")
    with RegistryClient(registry, insecure=True, timeout=60) as client:
        result = append_layer(
            client,
            base=parse_reference(base, default_registry=registry),
            repository="kubetrain/trainer",
            spec=spec,
            tag=f"bench-code-{marker}",
            work_dir=tmp,
        )
    return result.reference


def main() -> int:

    before = load()
    with tempfile.TemporaryDirectory(prefix="kubetrain-bench-images-") as tmp_name:
        tmp = Path(tmp_name)
        stack = Stack(tmp / "stack")
        stack.up()
        try:
            state = stack.load_state()
            registry, mirror = state["registry"], state["mirror"]
            publish_images(stack)
            images = {
                "sync": ("kubetrain/sync", "latest"),
                "trainer (CPU)": ("kubetrain/trainer", "latest-cpu"),
            }
            trainer = f"{registry}/kubetrain/trainer:latest-cpu"
            store = ImageStore(tmp / "cold", mirror, "bench")
            rows, rootfs, runc = asyncio.run(measure_store(store, tmp / "cold", registry, images, trainer))

            node = Node(tmp, tmp / "node-store", mirror)
            try:
                node.pod_start("warm-up", trainer)  # the node pulls the image once
                unchanged = [node.pod_start(f"unchanged-{i}", trainer) for i in range(RUNS)]
                appended_images = [append_code(registry, trainer, i, tmp) for i in range(RUNS)]
                appended = [node.pod_start(f"appended-{i}", img) for i, img in enumerate(appended_images)]
            finally:
                node.stop()
            cold_node = Node(tmp, tmp / "empty-store", mirror)
            try:
                repull = cold_node.pod_start("repull", appended_images[-1])
            finally:
                cold_node.stop()
        finally:
            stack.down()
    after = load()

    extra = statistics.median(appended) - statistics.median(unchanged)
    lines = [
        f"Load average (1/5/15 min) before: {before}; after: {after}. Each warm figure is the median of {RUNS}.",
        "",
        "| image | layers | compressed | unpacked | pull + unpack, cold node | pull, warm node (Always) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for what, (compressed, unpacked, count), cold, warm in rows:
        lines.append(
            f"| {what} | {count} | {compressed / 1e6:.0f} MB | {unpacked / 1e6:.0f} MB | {cold:.1f} s | {warm:.2f} s |"
        )
    lines += [
        "",
        "| next pod of the trainer image (pod created -> container running) | time |",
        "| --- | ---: |",
        f"| unchanged image, warm node | {statistics.median(unchanged):.2f} s |",
        f"| a code layer appended (AppendLayerOperator), warm node | {statistics.median(appended):.2f} s |",
        f"| the same appended image, node without the cache (full re-pull) | {repull:.1f} s |",
        "",
        f"- an appended code layer costs the next pod start **{extra:+.2f} s** against an unchanged image "
        f"(target: within {TARGET_S:.0f} s): {'met' if extra <= TARGET_S else 'not met'}; a full re-pull costs "
        f"{repull:.1f} s.",
        f"- per container: the store's `buildah from` + `mount` + `rm` of the trainer's root file system "
        f"{statistics.median(rootfs) * 1000:.0f} ms (median of 5); runc starting `true` in a prepared bundle "
        f"{statistics.median(runc) * 1000:.0f} ms.",
        "",
        "Command: `make bench BENCH=images`.",
    ]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
