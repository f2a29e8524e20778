"""The training pod, built once from ``kubernetes.client`` models.

Every training pod follows the same contract::

    initContainers:
      stage-in         sync image: the staged dataset snapshot -> /data, this run's latest
                       checkpoints -> /checkpoints (resume after a retry)
      checkpoint-sync  native sidecar (restartPolicy Always): /checkpoints and /output -> S3
                       every KUBETRAIN_SYNC_INTERVAL seconds, a final pass on SIGTERM
    containers:
      base             the training image; reads DATA_DIR, writes CHECKPOINT_DIR and OUTPUT_DIR
    volumes:           emptyDir for /data, /checkpoints, /output

S3 credentials reach the sync containers only through ``envFrom`` of a Secret (or workload
identity through a service account); the base container gets none, so a third-party
training script never sees them. Every container runs as a non-root numeric user without
privilege escalation or capabilities, and has requests and limits.

Local storage is sized from the dataset (:func:`kubetrain.pod_sizing.scratch_sizes`): the emptyDirs
get ``sizeLimit``s and the containers that write to them ``ephemeral-storage``. A single pod
(:func:`training_pod`) and the replicas of a multi-worker job (:func:`pod_template`) are built by the
same function.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kubernetes.client import models as k8s

from kubetrain import settings
from kubetrain.pod_sizing import (
    BYTES,
    COUNT,
    MILLICORES,
    check_sizes,
    checked_int,
    dataset_bytes_of,
    quantity,
    scratch_sizes,
    size_bytes,
    sync_grace,
)
from kubetrain.s3_layout import DEFAULT_S3_SECRET, prepared_uri_of
from kubetrain.sweep.stopping import EarlyStopping, MedianStopping, RungStopping
from kubetrain_contract.pod import CHECKPOINT_DIR, DATA_DIR, OUTPUT_DIR, STOP_FILE, Env

CACHE_DIR = "/cache"
BASE_CONTAINER = "base"
STAGE_IN_CONTAINER = "stage-in"
SYNC_CONTAINER = "checkpoint-sync"
GPU_RESOURCE = settings.SETTINGS["gpu_resource"].default

# STOP_FILE: where the checkpoint-sync sidecar tells the trainer to stop (the median rule of a sweep):
# trainer/sync/README.md, "Median stopping". The sidecar skips ".kubetrain-*" names when it syncs.

STAGE_IN_COMMAND = ("python", "-m", "trainer.sync", "stage-in")
RESTORE_COMMAND = ("python", "-m", "trainer.sync", "restore")
SYNC_COMMAND = ("python", "-m", "trainer.sync", "checkpoint-sync")

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(settings.DNS_SUBDOMAIN)
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
_EXTENDED_RESOURCE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def label_value(value: str) -> str:
    """Turn any string into a valid Kubernetes label value (at most 63 characters).

    Invalid characters become ``-``; a value that had to change or be shortened gets eight
    hex digits of the original's SHA-256, so distinct inputs keep distinct labels.
    """
    value = str(value)
    if _LABEL_VALUE.fullmatch(value) and len(value) <= 63:
        return value
    digest = hashlib.sha256(value.encode()).hexdigest()[:8]
    cleaned = re.sub(r"[^A-Za-z0-9_.-]", "-", value)[:54].strip("-_.")
    return f"{cleaned}-{digest}" if cleaned else digest


def _dns_name(what: str, value: str, *, subdomain: bool = False) -> str:
    pattern = _DNS_SUBDOMAIN if subdomain else _DNS_LABEL
    if not isinstance(value, str) or not pattern.fullmatch(value):
        kind = "DNS-1123 subdomain" if subdomain else "DNS-1123 label"
        raise ValueError(
            f"{what} {value!r} is not a valid {kind}: expected lower-case letters, digits and '-'"
        )
    return value


def resolve_image(explicit: str | None, kind: str = "trainer") -> str:
    """Return the image reference to run: explicit, else the deployment's setting, else the registry's ``latest``.

    Called when a task runs, never at parse time. The reference may still carry a tag;
    :func:`kubetrain.images.pin_image` turns it into the digest that runs.

    :param explicit: the operator's argument (or a Param), used when set.
    :param kind: ``"trainer"`` or ``"sync"``: the setting ``<kind>_image`` (the Variable
        ``kubetrain_<kind>_image`` that the build DAG sets, or ``KUBETRAIN_<KIND>_IMAGE``), else
        the default name of :func:`kubetrain.imagebuild.products.default_image` in the setting
        ``registry``, of release ``image_tag`` and trainer ``trainer_variant``
        (``<registry>/kubetrain/trainer:<tag>`` or ``...:<tag>-cpu``, ``<registry>/kubetrain/sync:<tag>``).
    """
    from kubetrain.imagebuild.products import DEFAULT_PRODUCTS, default_image

    if kind not in DEFAULT_PRODUCTS:
        raise ValueError(f"unknown image kind {kind!r}: expected one of {', '.join(DEFAULT_PRODUCTS)}")
    if explicit and str(explicit).strip():
        return str(explicit).strip()
    configured = settings.get(f"{kind}_image")
    if configured:
        return configured
    return default_image(
        kind,
        settings.get("registry"),
        settings.get("image_tag") or "latest",
        settings.get("trainer_variant") or "gpu",
    )


def code_version_of(image: str) -> str:
    """The code version an image reference implies: its digest, else its tag, else ``latest``."""
    if "@" in image:
        return image.rsplit("@", 1)[1]
    last = image.rsplit("/", 1)[-1]
    return last.rsplit(":", 1)[1] if ":" in last else "latest"


@dataclass(frozen=True)
class TrainingPodConfig:
    """Everything that varies between training pods; checks itself on creation.

    :param image: training image (base container).
    :param sync_image: image with ``python -m trainer.sync`` (stage-in and checkpoint-sync).
    :param run_uri: ``s3://<training>/runs/<dag_id>/<run>``: where checkpoints and output go.
    :param command: base container command (``None``: the image's entrypoint).
    :param args: base container arguments.
    :param dataset_manifest: ``s3://`` URI of the staged dataset manifest, or ``None`` (no dataset).
    :param dataset_version: the manifest's version.
    :param code_version: recorded by trainers in params.json (default: the image tag or digest).
    :param gpus: number of GPUs (request == limit), requested as ``gpu_resource``.
    :param gpu_resource: the extended resource GPUs are requested as: ``nvidia.com/gpu``, a MIG
        profile (``nvidia.com/mig-1g.10gb``), ``amd.com/gpu``, ...
    :param cpu: CPU request of the base container; ``cpu_limit`` defaults to it.
    :param memory: memory request of the base container; ``memory_limit`` defaults to it.
    :param s3_secret: Secret with the AWS_* variables for the sync containers; ``None`` for
        workload identity, which then needs ``service_account_name``.
    :param service_account_name: service account of the pod.
    :param image_pull_secrets: names of registry Secrets.
    :param node_selector: node labels the pod must match.
    :param tolerations: extra tolerations (GPU pods always tolerate their GPU vendor's taint).
    :param run_as_user: numeric non-root user of every container.
    :param sync_interval: seconds between checkpoint-sync passes.
    :param sync_quiet: seconds a file must be unmodified before it is uploaded.
    :param termination_grace_period: seconds the sidecar gets for its final pass on shutdown.
    :param cache_claim: PersistentVolumeClaim for the stage-in cache (keyed by dataset version).
    :param dataset_bytes: the staged manifest's ``total_bytes`` (the stage task's XCom), from which
        the /data volume is sized (:func:`kubetrain.pod_sizing.scratch_sizes`); ``None``: unknown.
    :param prepared_bytes: bytes of the prepared copy the trainer keeps in /data/.kubetrain-prepared
        (:func:`kubetrain.pod_sizing.prepared_bytes_of`), added to the derived /data size; ``None``: none.
    :param data_size: ``sizeLimit`` of the /data volume, e.g. ``"50Gi"``, instead of the size derived
        from ``dataset_bytes`` (archives that expand more than :data:`DATA_SIZE_FACTOR` need it).
    :param checkpoint_size: ``sizeLimit`` of the /checkpoints volume when the data size is known.
    :param output_size: ``sizeLimit`` of the /output volume when the data size is known.
    :param env: extra environment of the base container (plain values only, never secrets).
    :param labels: pod labels (values are made label-safe).
    :param annotations: pod annotations.
    :param early_stopping: median, asha or hyperband stopping by the sidecar (a sweep trial), or ``None``.
    """

    image: str
    sync_image: str
    run_uri: str
    command: Sequence[str] | None = None
    args: Sequence[str] | None = None
    dataset_manifest: str | None = None
    dataset_version: str | None = None
    code_version: str | None = None
    gpus: int = 0
    gpu_resource: str = GPU_RESOURCE
    cpu: str = "1"
    memory: str = "2Gi"
    cpu_limit: str | None = None
    memory_limit: str | None = None
    s3_secret: str | None = DEFAULT_S3_SECRET
    service_account_name: str | None = None
    image_pull_secrets: Sequence[str] = ()
    node_selector: Mapping[str, str] | None = None
    tolerations: Sequence[k8s.V1Toleration] = ()
    run_as_user: int = 10001
    sync_interval: int = 30
    sync_quiet: int = 2
    termination_grace_period: int = 300
    cache_claim: str | None = None
    dataset_bytes: int | None = None
    prepared_bytes: int | None = None
    data_size: str | None = None
    checkpoint_size: str = "4Gi"
    output_size: str = "2Gi"
    env: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    namespace: str | None = None
    early_stopping: EarlyStopping | None = None

    def __post_init__(self) -> None:
        for name in ("image", "sync_image"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip() or any(c.isspace() for c in value):
                raise ValueError(
                    f"{name}={value!r} is not an image reference: expected e.g. registry:5000/kubetrain/trainer:1.0"
                )
        if (
            not isinstance(self.run_uri, str)
            or not self.run_uri.startswith("s3://")
            or self.run_uri.endswith("/")
        ):
            raise ValueError(
                f"run_uri={self.run_uri!r} is not valid: expected s3://<bucket>/<prefix> without a trailing '/'"
            )
        if self.node_selector:  # the API server's label rules, whichever way the mapping came
            settings.parse_node_selector(dict(self.node_selector))
        if self.dataset_manifest is not None and not str(self.dataset_manifest).startswith("s3://"):
            raise ValueError(
                f"dataset_manifest={self.dataset_manifest!r} is not valid: expected an s3:// URI of a manifest"
            )
        object.__setattr__(self, "gpus", checked_int("gpus", self.gpus, minimum=0))
        if self.gpus:
            quantity("gpus", self.gpus, unit=COUNT)
        if not isinstance(self.gpu_resource, str) or not _EXTENDED_RESOURCE.match(self.gpu_resource):
            raise ValueError(
                f"gpu_resource={self.gpu_resource!r} is not an extended resource name: expected e.g. "
                "nvidia.com/gpu, nvidia.com/mig-1g.10gb or amd.com/gpu"
            )
        object.__setattr__(self, "tolerations", tuple(_toleration(t) for t in self.tolerations))
        if self.namespace is not None:
            _dns_name("namespace", self.namespace)
        object.__setattr__(self, "run_as_user", checked_int("run_as_user", self.run_as_user, minimum=1))
        object.__setattr__(self, "sync_interval", checked_int("sync_interval", self.sync_interval, minimum=1))
        object.__setattr__(self, "sync_quiet", checked_int("sync_quiet", self.sync_quiet, minimum=0))
        object.__setattr__(
            self,
            "termination_grace_period",
            checked_int("termination_grace_period", self.termination_grace_period, minimum=1),
        )
        for name, limit_name, unit in (("cpu", "cpu_limit", MILLICORES), ("memory", "memory_limit", BYTES)):
            request = quantity(name, getattr(self, name), unit=unit)
            if request is None:
                raise ValueError(
                    f"{name} must be set: every container of a training pod has requests and limits"
                )
            limit = quantity(limit_name, getattr(self, limit_name), unit=unit)
            if limit is not None and limit < request:
                raise ValueError(
                    f"{limit_name}={getattr(self, limit_name)!r} is below {name}={getattr(self, name)!r}: a limit must be >= its request"
                )
        object.__setattr__(self, "dataset_bytes", dataset_bytes_of(self.dataset_bytes))
        if self.prepared_bytes is not None:
            object.__setattr__(
                self, "prepared_bytes", checked_int("prepared_bytes", self.prepared_bytes, minimum=0)
            )
        # a rendered template of an empty Param: "" or "None"
        data_size = None if self.data_size in (None, "", "None", "null") else str(self.data_size).strip()
        object.__setattr__(self, "data_size", data_size)
        check_sizes(self)
        if self.s3_secret is None and not self.service_account_name:
            raise ValueError(
                "s3_secret=None (workload identity) needs service_account_name: the pod has no other way to reach S3"
            )
        if self.s3_secret is not None:
            _dns_name("s3_secret", self.s3_secret, subdomain=True)
        if self.service_account_name:
            _dns_name("service_account_name", self.service_account_name, subdomain=True)
        for secret in self.image_pull_secrets:
            _dns_name("image pull secret", secret, subdomain=True)
        if self.cache_claim:
            _dns_name("cache_claim", self.cache_claim, subdomain=True)
        for name in self.env:
            if not _ENV_NAME.match(name):
                raise ValueError(f"environment variable name {name!r} is not valid")
        if self.early_stopping is not None and not isinstance(
            self.early_stopping, MedianStopping | RungStopping
        ):
            raise ValueError(
                f"early_stopping={self.early_stopping!r} is not valid: expected a MedianStopping, a RungStopping "
                "or None"
            )

    @property
    def resolved_code_version(self) -> str:
        return self.code_version or code_version_of(self.image)


# -- named building blocks -----------------------------------------------------------------------


SHM_VOLUME = "dshm"


def _with_storage(
    resources: k8s.V1ResourceRequirements, size: str, limited: bool
) -> k8s.V1ResourceRequirements:
    resources.requests["ephemeral-storage"] = size
    if limited:
        resources.limits["ephemeral-storage"] = size
    return resources


def needs_shm(config: TrainingPodConfig) -> bool:
    """More than one GPU in the pod: NCCL's all-reduce between them goes through /dev/shm, whose 64 MiB container
    default starves it, so the pod gets a memory-backed one."""
    return config.gpus > 1


def scratch_volumes(config: TrainingPodConfig) -> list[k8s.V1Volume]:
    """The emptyDir volumes for /data, /checkpoints and /output (plus the cache claim, and /dev/shm for several
    GPUs)."""
    sizes = scratch_sizes(config)
    volumes = [
        k8s.V1Volume(name=name, empty_dir=k8s.V1EmptyDirVolumeSource(size_limit=getattr(sizes, name)))
        for name in ("data", "checkpoints", "output")
    ]
    if needs_shm(config):
        # counted against the container's memory limit, as memory-backed emptyDirs are, not against its
        # ephemeral storage: at most its memory
        volumes.append(
            k8s.V1Volume(
                name=SHM_VOLUME,
                empty_dir=k8s.V1EmptyDirVolumeSource(
                    medium="Memory", size_limit=config.memory_limit or config.memory
                ),
            )
        )
    if config.cache_claim:
        volumes.append(
            k8s.V1Volume(
                name="dataset-cache",
                persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(
                    claim_name=config.cache_claim
                ),
            )
        )
    return volumes


def pod_security_context(config: TrainingPodConfig) -> k8s.V1PodSecurityContext:
    """Pod-wide: numeric non-root user and group, volumes group-writable by it, default seccomp."""
    return k8s.V1PodSecurityContext(
        run_as_non_root=True,
        run_as_user=config.run_as_user,
        run_as_group=config.run_as_user,
        fs_group=config.run_as_user,
        seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault"),
    )


def container_security_context(config: TrainingPodConfig) -> k8s.V1SecurityContext:
    """Per container: no root, no privilege escalation, no capabilities."""
    return k8s.V1SecurityContext(
        run_as_non_root=True,
        run_as_user=config.run_as_user,
        allow_privilege_escalation=False,
        privileged=False,
        capabilities=k8s.V1Capabilities(drop=["ALL"]),
        seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault"),
    )


def base_resources(config: TrainingPodConfig) -> k8s.V1ResourceRequirements:
    """Requests and limits of the base container; GPUs are extended resources, so request == limit."""
    requests = {"cpu": str(config.cpu), "memory": str(config.memory)}
    limits = {"cpu": str(config.cpu_limit or config.cpu), "memory": str(config.memory_limit or config.memory)}
    if config.gpus:
        requests[config.gpu_resource] = limits[config.gpu_resource] = str(config.gpus)
    sizes = scratch_sizes(config)
    return _with_storage(
        k8s.V1ResourceRequirements(requests=requests, limits=limits), sizes.base, sizes.limited
    )


def _helper_resources(config: TrainingPodConfig, cpu: tuple[str, str], memory: tuple[str, str], storage: str):
    """Requests and limits of a transfer container: (request, limit) of CPU and memory, and its disk."""
    return _with_storage(
        k8s.V1ResourceRequirements(
            requests={"cpu": cpu[0], "memory": memory[0]}, limits={"cpu": cpu[1], "memory": memory[1]}
        ),
        storage,
        scratch_sizes(config).limited,
    )


def stage_in_resources(config: TrainingPodConfig) -> k8s.V1ResourceRequirements:
    # Archive extraction is CPU-bound and streams; memory stays small.
    return _helper_resources(config, ("250m", "1"), ("256Mi", "1Gi"), scratch_sizes(config).stage_in)


def sync_resources(config: TrainingPodConfig) -> k8s.V1ResourceRequirements:
    return _helper_resources(config, ("100m", "500m"), ("128Mi", "512Mi"), scratch_sizes(config).sync)


def gpu_tolerations(gpus: int, gpu_resource: str = GPU_RESOURCE) -> list[k8s.V1Toleration]:
    """The taints GPU node pools carry, tolerated by GPU pods.

    Pools are tainted with the GPU vendor's ``<domain>/gpu`` (``nvidia.com/gpu``, ``amd.com/gpu``)
    or with the resource name itself; a pod that requests a MIG profile such as
    ``nvidia.com/mig-1g.10gb`` tolerates both.
    """
    if not gpus:
        return []
    keys = [gpu_resource]
    vendor = f"{gpu_resource.split('/', 1)[0]}/gpu"
    if vendor not in keys:
        keys.append(vendor)
    return [k8s.V1Toleration(key=key, operator="Exists", effect="NoSchedule") for key in keys]


def _toleration(value: k8s.V1Toleration | Mapping[str, object]) -> k8s.V1Toleration:
    """A checked V1Toleration, whichever way it came (a Param's JSON, a dict, an object): the settings' rules."""
    if isinstance(value, k8s.V1Toleration):
        value = {
            k8s.V1Toleration.attribute_map[a]: getattr(value, a)
            for a in k8s.V1Toleration.attribute_map
            if getattr(value, a) is not None
        }
    if not isinstance(value, Mapping):
        raise ValueError(f"toleration {value!r} is not a V1Toleration or a mapping of its fields")
    (checked,) = settings.parse_tolerations([dict(value)])
    fields = {"tolerationSeconds": "toleration_seconds"}
    return k8s.V1Toleration(**{fields.get(k, k): v for k, v in checked.items()})


def pod_tolerations(config: TrainingPodConfig) -> list[k8s.V1Toleration] | None:
    """The GPU tolerations and the extra ones, each once."""
    found: list[k8s.V1Toleration] = []
    for toleration in [*gpu_tolerations(config.gpus, config.gpu_resource), *config.tolerations]:
        if toleration not in found:
            found.append(toleration)
    return found or None


def contract_env(config: TrainingPodConfig) -> list[k8s.V1EnvVar]:
    """The pod contract's environment, the same in every container (no secrets in it)."""
    values = {
        Env.DATA_DIR: DATA_DIR,
        Env.CHECKPOINT_DIR: CHECKPOINT_DIR,
        Env.OUTPUT_DIR: OUTPUT_DIR,
        Env.RUN_URI: config.run_uri,
        Env.IMAGE: config.image,
        Env.CODE_VERSION: config.resolved_code_version,
    }
    if config.dataset_manifest:
        values[Env.DATASET_MANIFEST] = config.dataset_manifest
    if config.dataset_version:
        values[Env.DATASET_VERSION] = config.dataset_version
    data = scratch_sizes(config).data
    if data is not None:
        values[Env.DATA_SIZE_BYTES] = str(size_bytes("data_size", data))
    return [k8s.V1EnvVar(name=k, value=v) for k, v in values.items()]


def prepared_env(config: TrainingPodConfig) -> list[k8s.V1EnvVar]:
    """``KUBETRAIN_PREPARED_URI`` when the dataset version is known: the stage-in downloads the prepared copies
    made of that version earlier, the sidecar uploads one the trainer makes (trainer/sync/prepared.py)."""
    if not (config.dataset_manifest and config.dataset_version):
        return []
    try:
        uri = prepared_uri_of(config.dataset_manifest)
    except ValueError:
        return []  # a manifest outside the layout (made by hand): no shared copies, the trainer prepares its own
    return [k8s.V1EnvVar(name=Env.PREPARED_URI, value=uri)]


def s3_env_from(config: TrainingPodConfig) -> list[k8s.V1EnvFromSource]:
    """AWS_* variables from the S3 Secret, by reference; empty for workload identity."""
    if config.s3_secret is None:
        return []
    return [k8s.V1EnvFromSource(secret_ref=k8s.V1SecretEnvSource(name=config.s3_secret))]


def _mount(name: str, path: str, *, read_only: bool = False) -> k8s.V1VolumeMount:
    return k8s.V1VolumeMount(name=name, mount_path=path, read_only=read_only or None)


def stage_in_container(config: TrainingPodConfig) -> k8s.V1Container:
    """Init container: download the dataset snapshot and this run's latest checkpoints.

    Without a dataset (a trainer that fetches nothing) it only restores the checkpoints.
    """
    env = contract_env(config)
    mounts = [_mount("data", DATA_DIR), _mount("checkpoints", CHECKPOINT_DIR)]
    if config.cache_claim:
        env.append(k8s.V1EnvVar(name=Env.CACHE_DIR, value=CACHE_DIR))
        mounts.append(_mount("dataset-cache", CACHE_DIR))
    env.extend(prepared_env(config))
    return k8s.V1Container(
        name=STAGE_IN_CONTAINER,
        image=config.sync_image,
        command=list(STAGE_IN_COMMAND if config.dataset_manifest else RESTORE_COMMAND),
        env=env,
        env_from=s3_env_from(config),
        volume_mounts=mounts,
        resources=stage_in_resources(config),
        security_context=container_security_context(config),
    )


def stop_env(config: TrainingPodConfig, *, rule: bool = True) -> list[k8s.V1EnvVar]:
    """``KUBETRAIN_STOP_FILE`` (and, for the sidecar, the rule's settings) when the trial may be stopped early."""
    if config.early_stopping is None:
        return []
    values = {Env.STOP_FILE: STOP_FILE, **(config.early_stopping.env() if rule else {})}
    return [k8s.V1EnvVar(name=k, value=v) for k, v in values.items()]


def _plain_env(values: Mapping[str, object] | None) -> list[k8s.V1EnvVar]:
    return [k8s.V1EnvVar(name=k, value=str(v)) for k, v in (values or {}).items()]


def checkpoint_sync_container(
    config: TrainingPodConfig, *, env: Mapping[str, str] | None = None
) -> k8s.V1Container:
    """Native sidecar (``restartPolicy: Always`` init container): upload checkpoints and output.

    :param env: plain variables added after the contract's (a multi-worker job's replica count).
    """
    prepared = prepared_env(config)
    variables = [
        *contract_env(config),
        *prepared,
        k8s.V1EnvVar(name=Env.SYNC_INTERVAL, value=str(config.sync_interval)),
        k8s.V1EnvVar(name=Env.SYNC_QUIET, value=str(config.sync_quiet)),
        k8s.V1EnvVar(name=Env.SYNC_GRACE, value=str(sync_grace(config.termination_grace_period))),
        # A native sidecar gets its SIGTERM only once every main container has exited (at the pod's
        # end, and on deletion or eviction since Kubernetes 1.29, the oldest kubetrain supports), so
        # no writer is left when its final pass starts: the settle period, which waits for a file a
        # trainer may still be writing, would only add its 0.5 s to every run's and trial's end.
        k8s.V1EnvVar(name=Env.SYNC_SETTLE, value="0"),
        *stop_env(config),
        # The pod name goes into every pass manifest.
        k8s.V1EnvVar(
            name=Env.HOSTNAME,
            value_from=k8s.V1EnvVarSource(field_ref=k8s.V1ObjectFieldSelector(field_path="metadata.name")),
        ),
        *_plain_env(env),
    ]
    return k8s.V1Container(
        name=SYNC_CONTAINER,
        image=config.sync_image,
        command=list(SYNC_COMMAND),
        restart_policy="Always",
        env=variables,
        env_from=s3_env_from(config),
        # The sidecar only reads what the trainer writes; with early stopping it may also
        # write the stop file into CHECKPOINT_DIR.
        volume_mounts=[
            _mount("checkpoints", CHECKPOINT_DIR, read_only=config.early_stopping is None),
            _mount("output", OUTPUT_DIR, read_only=True),
            # the prepared copies the trainer makes in DATA_DIR/.kubetrain-prepared, to upload
            *([_mount("data", DATA_DIR, read_only=True)] if prepared else []),
        ],
        resources=sync_resources(config),
        security_context=container_security_context(config),
    )


def base_container(
    config: TrainingPodConfig,
    *,
    name: str = BASE_CONTAINER,
    env: Mapping[str, str] | None = None,
    ports: Sequence[k8s.V1ContainerPort] = (),
) -> k8s.V1Container:
    """The training container: the image and command, the contract's directories and environment.

    :param name: the container's name (a TFJob's must be ``tensorflow``).
    :param env: plain variables added after ``config.env`` (a replica's cluster variables).
    :param ports: the container's ports (a replica's TensorFlow server).
    """
    return k8s.V1Container(
        name=name,
        image=config.image,
        command=list(config.command) if config.command else None,
        args=[str(a) for a in config.args] if config.args else None,
        env=[*contract_env(config), *stop_env(config, rule=False), *_plain_env(config.env), *_plain_env(env)],
        ports=list(ports) or None,
        volume_mounts=[
            _mount("data", DATA_DIR),
            _mount("checkpoints", CHECKPOINT_DIR),
            _mount("output", OUTPUT_DIR),
            *([_mount(SHM_VOLUME, "/dev/shm")] if needs_shm(config) else []),
        ],
        resources=base_resources(config),
        security_context=container_security_context(config),
        termination_message_policy="FallbackToLogsOnError",
    )


def pod_labels(config: TrainingPodConfig) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": "kubetrain", "app.kubernetes.io/component": "training"}
    labels.update({k: label_value(v) for k, v in config.labels.items()})
    return labels


def pod_template(
    config: TrainingPodConfig,
    *,
    sync: bool = True,
    env: Mapping[str, str] | None = None,
    sidecar_env: Mapping[str, str] | None = None,
    ports: Sequence[k8s.V1ContainerPort] = (),
    labels: Mapping[str, str] | None = None,
    subdomain: str | None = None,
    restart_policy: str = "Never",
    container_name: str = BASE_CONTAINER,
) -> k8s.V1PodTemplateSpec:
    """The training pod contract as a pod template: the one builder of every training pod.

    With the defaults it is the single training pod (:func:`training_pod` gives it a name and a
    namespace). The replicas of a multi-worker job (:mod:`kubetrain.distributed`) each get the
    stage-in init container (the dataset, and the run's checkpoints, which are the chief's: only the
    chief syncs), the base container with the cluster variables and the TensorFlow server's port, and,
    on the chief only (``sync``), the checkpoint-sync sidecar.

    :param config: the pod's settings (a replica's: its role's resources).
    :param sync: whether the pod has the checkpoint-sync sidecar.
    :param env: plain variables added to the base container.
    :param sidecar_env: plain variables added to the checkpoint-sync sidecar.
    :param ports: container ports of the base container.
    :param labels: labels added to the pod's (values are made label-safe).
    :param subdomain: the headless Service the pod's hostname lives under.
    :param restart_policy: the pod's restart policy.
    :param container_name: the base container's name (a TFJob's must be ``tensorflow``).
    """
    annotations = {"kubetrain.io/run-uri": config.run_uri, **config.annotations}
    if config.dataset_manifest:
        annotations["kubetrain.io/dataset-manifest"] = config.dataset_manifest
    init = [stage_in_container(config)]
    if sync:
        init.append(checkpoint_sync_container(config, env=sidecar_env))
    return k8s.V1PodTemplateSpec(
        metadata=k8s.V1ObjectMeta(
            labels={**pod_labels(config), **{k: label_value(v) for k, v in (labels or {}).items()}},
            annotations=annotations,
        ),
        spec=k8s.V1PodSpec(
            restart_policy=restart_policy,
            init_containers=init,
            containers=[base_container(config, name=container_name, env=env, ports=ports)],
            volumes=scratch_volumes(config),
            security_context=pod_security_context(config),
            service_account_name=config.service_account_name,
            # Only workload identity needs the projected token; nothing else talks to the API.
            automount_service_account_token=bool(config.service_account_name and config.s3_secret is None),
            image_pull_secrets=[k8s.V1LocalObjectReference(name=s) for s in config.image_pull_secrets]
            or None,
            node_selector=dict(config.node_selector) if config.node_selector else None,
            tolerations=pod_tolerations(config),
            termination_grace_period_seconds=config.termination_grace_period,
            subdomain=subdomain,
        ),
    )


def training_pod(
    config: TrainingPodConfig, *, name: str | None = None, namespace: str | None = None
) -> k8s.V1Pod:
    """The whole training pod of ``config``: :func:`pod_template`'s pod, named.

    :param config: the pod's settings.
    :param name: pod name (the KubernetesPodOperator sets its own when ``None``).
    :param namespace: namespace (default: ``config.namespace``; the connection's when both are ``None``).
    """
    template = pod_template(config)
    template.metadata.name = name
    template.metadata.namespace = namespace or config.namespace
    return k8s.V1Pod(api_version="v1", kind="Pod", metadata=template.metadata, spec=template.spec)
