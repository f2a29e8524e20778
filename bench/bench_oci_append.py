"""Appending a code layer to a base image in the registry: our OCI client vs. oras-py and skopeo.

Why kubetrain.imagebuild.oci and append.py are hand-written: each case below appends the same
small code layer (the trainer package, gzipped) onto a base image already in the registry
(busybox + a 200 MB layer of incompressible random bytes, standing in for TensorFlow) and tags
the result in another repository of the same registry, as the build DAG does. Every client talks
to Debian's docker-registry through a loopback proxy that counts wire bytes (headers included)
each way, outside the clients.

* ours: ``append_layer`` (kubetrain.imagebuild.append over kubetrain.imagebuild.oci): the base
  layers are mounted across repositories (``POST /blobs/uploads/?mount=&from=``), never pulled;
* oras-py (PyPI ``oras``): ``Registry.get_manifest``/``get_blob``/``upload_blob``/
  ``upload_manifest``; it has no cross-repository mount, so a base layer missing from the target
  repository is pulled and pushed again. Measured also with the base in the target repository,
  where its ``blob_exists`` check finds every layer;
* skopeo (Debian): it copies images but cannot add a layer, so the base is copied to a local OCI
  layout, the layer, config and manifest are edited there (the same manifest code append.py has),
  and the layout is copied to the registry; ``skopeo copy docker:// docker://`` of the base alone is
  measured too, the least any skopeo-based append would move; and skopeo alone: the base copied
  registry to registry (mounted), then a `dir:` image holding only the new blobs.

Each case ships a different one-line change of the trainer package and pushes to a repository of
its own, so no case finds another's blobs. Results go to bench/results/oci_append.md. oras-py is
installed by ``make bench`` into .tools/oras (``uv pip install --target .tools/oras --no-deps
oras==0.2.43``: it cannot join the Airflow environment's pins; requests and jsonschema come from there).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "plugins"), str(REPO / "bench"), str(REPO / ".tools" / "oras")]

from bench_image_update import BASE_MB, CountingProxy, make_base, measure  # noqa: E402

from include.devstack import registry as devstack_registry  # noqa: E402
from include.devstack.stack import free_port, wait_http  # noqa: E402
from kubetrain.imagebuild.append import AppendSpec, append_layer  # noqa: E402
from kubetrain.imagebuild.layer import DEFAULT_EXCLUDES, select_files, write_layer  # noqa: E402
from kubetrain.imagebuild.oci import (  # noqa: E402
    DOCKER_CONFIG,
    DOCKER_LAYER_GZIP,
    OCI_CONFIG,
    OCI_LAYER_GZIP,
    OCI_MANIFEST,
    RegistryClient,
    canonical_json,
    push_image,
)
from kubetrain.imagebuild.reference import parse_reference  # noqa: E402

RUNS = 3
RESOLVES = 10
BASE_REPOSITORY = "bench/trainer"  # where bench_image_update.make_base pushes :deps
DOCKER_BASE = "bench/docker-base"
RESULTS = REPO / "bench" / "results" / "oci_append.md"
SKOPEO_TLS = ("--src-tls-verify=false", "--dest-tls-verify=false")


def code_tree(work: Path) -> Path:
    """A copy of the trainer package as the image ships it."""
    dest = work / "code"
    for rel in select_files(REPO / "trainer", DEFAULT_EXCLUDES):
        src, dst = REPO / "trainer" / rel, dest / rel
        if src.is_dir():
            dst.mkdir(parents=True, exist_ok=True)
        elif src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    return dest


def change_code(code: Path, n: int) -> None:
    path = code / "__init__.py"
    path.write_text(path.read_text().split("\n# change")[0] + f"\n# change {n}\n")


def appended(manifest: dict[str, Any], config: dict[str, Any], layer) -> tuple[dict[str, Any], bytes]:
    """The base's manifest and config plus ``layer``, media types of the base's kind: (manifest, config)."""
    oci = manifest.get("mediaType", OCI_MANIFEST) == OCI_MANIFEST
    config = copy.deepcopy(config)
    config["rootfs"]["diff_ids"].append(layer.diff_id)
    config.setdefault("history", []).append({"created_by": "bench append"})
    raw_config = canonical_json(config)
    new = copy.deepcopy(manifest)
    new["config"] = {
        "mediaType": OCI_CONFIG if oci else DOCKER_CONFIG,
        "digest": "sha256:" + hashlib.sha256(raw_config).hexdigest(),
        "size": len(raw_config),
    }
    new["layers"] = [
        *manifest["layers"],
        layer.blob(OCI_LAYER_GZIP if oci else DOCKER_LAYER_GZIP).descriptor(),
    ]
    return new, raw_config


def ours(host: str, code: Path, repository: str, tag: str, base: str = BASE_REPOSITORY) -> None:
    with RegistryClient(host, insecure=True) as client:
        append_layer(
            client,
            base=parse_reference(f"{host}/{base}:deps"),
            repository=repository,
            spec=AppendSpec(source=code, dest="/app/trainer"),
            tag=tag,
        )


def oras_append(
    host: str, code: Path, repository: str, tag: str, work: Path, base_repository: str = BASE_REPOSITORY
) -> None:
    import oras.provider

    registry = oras.provider.Registry(hostname=host, insecure=True)
    base = f"{host}/{base_repository}:deps"
    target = f"{host}/{repository}:{tag}"
    manifest = registry.get_manifest(base)
    config = registry.get_blob(base, manifest["config"]["digest"]).json()
    layer = write_layer(code, work / f"oras-{tag}.tar.gz", dest="/app/trainer", opaque=True)
    new, raw_config = appended(manifest, config, layer)
    container = registry.get_container(target)
    for desc in manifest["layers"]:
        if registry.blob_exists(desc, container):
            continue
        # no cross-repository mount in oras-py: the layer comes down and goes up again
        path = work / "oras-blob"
        with registry.get_blob(base, desc["digest"], stream=True) as response, open(path, "wb") as out:
            for chunk in response.iter_content(1 << 20):
                out.write(chunk)
        registry.upload_blob(str(path), container, desc)
        path.unlink()
    registry.upload_blob(str(layer.path), container, new["layers"][-1])
    config_path = work / "oras-config.json"
    config_path.write_bytes(raw_config)
    registry.upload_blob(str(config_path), container, new["config"])
    response = registry.upload_manifest(new, container)
    if response.status_code != 201:
        raise RuntimeError(f"oras-py: manifest PUT answered {response.status_code}: {response.text}")


def skopeo(*args: str) -> None:
    subprocess.run(["skopeo", *args], check=True, capture_output=True, text=True)


def skopeo_append(host: str, code: Path, repository: str, tag: str, work: Path) -> None:
    layout = work / f"layout-{tag}"
    skopeo("copy", *SKOPEO_TLS, f"docker://{host}/{BASE_REPOSITORY}:deps", f"oci:{layout}:base")
    index = json.loads((layout / "index.json").read_text())
    blobs = layout / "blobs" / "sha256"
    manifest_digest = index["manifests"][0]["digest"]
    manifest = json.loads((blobs / manifest_digest.split(":")[1]).read_bytes())
    config = json.loads((blobs / manifest["config"]["digest"].split(":")[1]).read_bytes())
    layer = write_layer(code, work / f"skopeo-{tag}.tar.gz", dest="/app/trainer", opaque=True)
    new, raw_config = appended(manifest, config, layer)
    shutil.copy(layer.path, blobs / layer.digest.split(":")[1])
    (blobs / new["config"]["digest"].split(":")[1]).write_bytes(raw_config)
    raw = canonical_json(new)
    digest = hashlib.sha256(raw).hexdigest()
    (blobs / digest).write_bytes(raw)
    index["manifests"] = [
        {
            "mediaType": new["mediaType"],
            "digest": f"sha256:{digest}",
            "size": len(raw),
            "annotations": {"org.opencontainers.image.ref.name": "app"},
        }
    ]
    (layout / "index.json").write_text(json.dumps(index))
    skopeo("copy", *SKOPEO_TLS, f"oci:{layout}:app", f"docker://{host}/{repository}:{tag}")
    shutil.rmtree(layout)


def skopeo_mount_append(
    host: str, code: Path, repository: str, tag: str, work: Path, base_repository: str = BASE_REPOSITORY
) -> None:
    """skopeo only: the base copied registry to registry (mounted), then a ``dir:`` image of just the new blobs."""
    base = f"docker://{host}/{base_repository}:deps"
    raw_manifest = skopeo_out("inspect", "--tls-verify=false", "--raw", base).encode()
    # to the base's digest, not a tag: no other image is ever under a tag of the target repository
    base_digest = "sha256:" + hashlib.sha256(raw_manifest).hexdigest()
    skopeo("copy", *SKOPEO_TLS, base, f"docker://{host}/{repository}@{base_digest}")
    manifest = json.loads(raw_manifest)
    config = json.loads(skopeo_out("inspect", "--tls-verify=false", "--config", "--raw", base))
    layer = write_layer(code, work / f"skopeo-{tag}.tar.gz", dest="/app/trainer", opaque=True)
    new, raw_config = appended(manifest, config, layer)
    image = work / f"partial-{tag}"
    image.mkdir()
    (image / "version").write_text("Directory Transport Version: 1.1\n")
    shutil.copy(layer.path, image / layer.digest.split(":")[1])
    (image / new["config"]["digest"].split(":")[1]).write_bytes(raw_config)
    (image / "manifest.json").write_bytes(canonical_json(new))
    # the base layers are not in the directory: skopeo finds them in the target repository and skips them
    skopeo("copy", *SKOPEO_TLS, f"dir:{image}", f"docker://{host}/{repository}:{tag}")
    shutil.rmtree(image)


def skopeo_out(*args: str) -> str:
    return subprocess.run(["skopeo", *args], check=True, capture_output=True, text=True).stdout


def resolve_times(host: str) -> dict[str, float]:
    """Median seconds to resolve the base's tag to its digest, as every training task does (pin_image)."""
    times: dict[str, list[float]] = {"ours": [], "skopeo": []}
    reference = f"docker://{host}/{BASE_REPOSITORY}:deps"
    with RegistryClient(host, insecure=True) as client:
        for _ in range(RESOLVES):
            start = time.perf_counter()
            client.manifest_digest(BASE_REPOSITORY, "deps")
            times["ours"].append(time.perf_counter() - start)
            start = time.perf_counter()
            skopeo_out("inspect", "--tls-verify=false", "--format", "{{.Digest}}", reference)
            times["skopeo"].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def skopeo_copy(host: str, repository: str, tag: str) -> None:
    skopeo(
        "copy", *SKOPEO_TLS, f"docker://{host}/{BASE_REPOSITORY}:deps", f"docker://{host}/{repository}:{tag}"
    )


def docker_base(work: Path, port: int, host: str, code: Path) -> dict[str, str]:
    """Each client appends to a small base pushed as Docker v2 schema 2 (``buildah push --format v2s2``,
    Docker Hub's images): whether it works, else the client's error."""
    small = work / "small"
    small.mkdir()
    (small / "f").write_text("base\n")
    layer = write_layer(small, work / "small.tar.gz", excludes=())
    with RegistryClient(f"127.0.0.1:{port}", insecure=True) as client:
        config = {"architecture": "amd64", "os": "linux", "config": {}}
        push_image(client, DOCKER_BASE, "deps", [layer.blob(DOCKER_LAYER_GZIP)], config, oci=False)
    outcome = {}
    for name, run in (
        ("ours", lambda: ours(host, code, "bench/docker-ours", "code", DOCKER_BASE)),
        ("oras-py", lambda: oras_append(host, code, DOCKER_BASE, "oras", work, DOCKER_BASE)),
        ("skopeo", lambda: skopeo_mount_append(host, code, "bench/docker-skopeo", "code", work, DOCKER_BASE)),
    ):
        try:
            run()
            outcome[name] = "works"
        except Exception as exc:  # the outcome is the figure
            detail = getattr(exc, "stderr", "") or str(exc)
            outcome[name] = f"fails: {' '.join(detail.split())[:160]}"
    return outcome


def check_complete(client: RegistryClient, repository: str, tag: str) -> None:
    """Every case must leave a whole image: the code layer on top, every blob in the repository."""
    manifest = client.get_manifest(repository, tag).data
    missing = [
        d["digest"]
        for d in [manifest["config"], *manifest["layers"]]
        if not client.blob_exists(repository, d["digest"])
    ]
    if len(manifest["layers"]) != 3 or missing:
        raise AssertionError(f"{repository}:{tag}: {len(manifest['layers'])} layers, missing blobs {missing}")


def main() -> int:
    try:
        import oras.provider  # noqa: F401
    except ImportError:
        print(
            "oras-py is missing: .tools/bin/uv pip install --target .tools/oras --no-deps oras==0.2.43",
            file=sys.stderr,
        )
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-oci-") as tmp:
        work = Path(tmp)
        port = free_port()
        log = work / "registry.log"
        with log.open("wb") as out:
            reg = subprocess.Popen(
                devstack_registry.command(work / "registry", port), stdout=out, stderr=subprocess.STDOUT
            )
        try:
            wait_http(f"http://127.0.0.1:{port}/v2/", 30, reg, log)
            proxy = CountingProxy(port)
            host = f"127.0.0.1:{proxy.port}"
            print(f"making the base image ({BASE_MB} MB of random bytes + busybox) ...", flush=True)
            with RegistryClient(f"127.0.0.1:{port}", insecure=True) as client:
                make_base(client, work / "base")
            code = code_tree(work)
            layer_bytes = write_layer(code, work / "size.tar.gz", dest="/app/trainer").size
            cases: dict[str, list[dict]] = {}
            runs = {
                "ours: append_layer (cross-repository mount)": lambda n: ours(
                    host, code, f"bench/ours-{n}", "code"
                ),
                "oras-py 0.2.43, another repository (no mount: pull + push)": lambda n: oras_append(
                    host, code, f"bench/oras-{n}", "code", work
                ),
                "oras-py 0.2.43, the base's own repository": lambda n: oras_append(
                    host, code, BASE_REPOSITORY, f"oras-{n}", work
                ),
                "skopeo 1.9 copy to an OCI layout, edit, copy back": lambda n: skopeo_append(
                    host, code, f"bench/skopeo-{n}", "code", work
                ),
                "skopeo 1.9 copy docker:// docker:// of the base (mounts), then dir: of only the new "
                "blobs": lambda n: skopeo_mount_append(host, code, f"bench/skopeo-mount-{n}", "code", work),
                "skopeo 1.9 copy docker:// docker:// of the base alone (no layer)": lambda n: skopeo_copy(
                    host, f"bench/skopeo-copy-{n}", "base"
                ),
            }
            change = 0
            for n in range(RUNS):
                for name, run in runs.items():
                    change += 1
                    change_code(code, change)
                    print(f"{name}, run {n + 1} ...", flush=True)
                    cases.setdefault(name, []).append(measure(proxy, lambda run=run, n=n: run(n)))
            load = os.getloadavg()[0]
            resolve = resolve_times(host)
            print("a Docker v2 schema 2 base ...", flush=True)
            docker = docker_base(work, port, host, code)
            with RegistryClient(f"127.0.0.1:{port}", insecure=True) as client:
                for n in range(RUNS):
                    for repository, tag in (
                        (f"bench/ours-{n}", "code"),
                        (f"bench/oras-{n}", "code"),
                        (BASE_REPOSITORY, f"oras-{n}"),
                        (f"bench/skopeo-{n}", "code"),
                        (f"bench/skopeo-mount-{n}", "code"),
                    ):
                        check_complete(client, repository, tag)
        finally:
            reg.terminate()
            reg.wait(10)

    def ratio(x: float) -> str:
        return f"{x:,.2f}x" if x < 10 else f"{x:,.0f}x"

    def mb(n: float) -> str:
        return f"{n / 1e6:,.3f} MB" if n < 1e7 else f"{n / 1e6:,.1f} MB"

    medians = {
        name: {k: statistics.median(r[k] for r in results) for k in ("wall_s", "pulled", "pushed", "moved")}
        for name, results in cases.items()
    }
    ours_row = medians["ours: append_layer (cross-repository mount)"]
    lines = [
        f"Base image: busybox + {BASE_MB} MB of random bytes in Debian's docker-registry on loopback; code "
        f"layer: the trainer package, {layer_bytes / 1e3:,.0f} kB gzipped. Bytes are wire bytes (headers "
        "included) counted by a proxy between the client and the registry; each figure is the median of "
        f"{RUNS} runs, each run to a repository of its own. Machine: {os.cpu_count()} CPU(s); load average "
        f"{load:.1f} at the end.",
        "",
        "| case | wall time | pulled | pushed | moved | moved vs ours |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in medians.items():
        lines.append(
            f"| {name} | {r['wall_s']:.2f} s | {mb(r['pulled'])} | {mb(r['pushed'])} | {mb(r['moved'])} "
            f"| {ratio(r['moved'] / ours_row['moved'])} |"
        )
    lines += [
        "",
        f"Resolving the base's tag to its digest (median of {RESOLVES}; every training task pins its image so): "
        f"ours {resolve['ours'] * 1e3:.1f} ms, `skopeo inspect --format {{{{.Digest}}}}` "
        f"{resolve['skopeo'] * 1e3:.0f} ms.",
    ]
    lines += [
        "",
        "A base pushed as Docker v2 schema 2 (`buildah push --format v2s2`; Docker Hub's images):",
        "",
    ]
    lines += [f"- {name}: {outcome}" for name, outcome in docker.items()]
    lines += ["", "Command: `make bench BENCH=oci_append` (or `.venv/bin/python bench/bench_oci_append.py`)."]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
