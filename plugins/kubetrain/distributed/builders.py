"""The objects each backend submits for one multi-worker run, built from typed models.

* ``indexed_job``: a headless Service ``<name>`` and one Indexed Job ``<name>-<role>`` per role
  (batch/v1, ``kubernetes.client`` models): pods ``<name>-<role>-<index>.<name>``; the replicas
  compute TF_CONFIG from ``KUBETRAIN_TF_*`` (:mod:`kubetrain.distributed.cluster`). In a Kueue
  queue, Kueue admits each Job as a workload of its own, so one Job per role could have the chief
  admitted and a worker not, burning its GPU while it waits: a queued multi-worker run is instead
  one Indexed Job ``<name>-all`` of every replica (all of one size, chief at index 0), which Kueue
  admits all or nothing. Parameter servers have a size of their own and cannot share that Job; a
  queued parameter-server run needs ``tfjob`` or ``trainjob``, which Kueue admits as one workload.
* ``tfjob``: a Kubeflow ``TFJob`` (kubeflow.org/v1, training operator v1.9) with one replica spec
  per role, built from the typed dataclasses below. The training operator's Python SDK
  (``kubeflow-training``) pins ``kubernetes<36``, which the cncf-kubernetes provider's
  ``kubernetes>=36`` excludes, so its models cannot be installed beside Airflow; these dataclasses
  follow its ``KubeflowOrgV1TFJob`` models field for field and the tests validate what they render
  against the TFJob schema derived from that SDK's models. The operator sets TF_CONFIG itself
  (container ``tensorflow``, port ``tfjob-port``).
* ``trainjob``: a Kubeflow Trainer ``TrainingRuntime`` (a JobSet with one replicated job per role)
  and the ``TrainJob`` that runs it (trainer.kubeflow.org/v1alpha1, Trainer v2.3), built from the
  ``kubeflow-trainer-api`` models. The Trainer has no TensorFlow runtime: the replicas compute
  TF_CONFIG from ``KUBETRAIN_TF_*``, with ``KUBETRAIN_TF_ROLE`` per replicated job. The Trainer sizes
  one replicated job, the one labelled as its trainer ancestor (the workers, or the chief of a
  one-replica run): it sets that job's parallelism and completions to the TrainJob's
  ``spec.trainer.numNodes`` (pkg/runtime/framework/plugins/plainml), so the TrainJob carries that
  job's count there (and the runtime's ``mlPolicy.numNodes`` the same), and the job's container is
  named ``node``, as the TrainingRuntime webhook requires of it; the other roles keep their counts.

Every replica follows the training pod contract (:func:`kubetrain.pod_spec.pod_template`):
stage-in on every replica, the checkpoint-sync sidecar on the chief only (in the one Job of a queued
run every replica has the sidecar and all but the chief's idle, as the template is shared).

In a queue, the job object (each Job, the TFJob, the TrainJob) carries Kueue's
``kueue.x-k8s.io/queue-name`` and ``kueue.x-k8s.io/priority-class`` labels; Kueue's webhook
creates it suspended and resumes it on admission.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes.client import ApiClient
from kubernetes.client import models as k8s

from kubetrain import pod_spec
from kubetrain.distributed.cluster import BACKENDS, cluster_spec, host_pattern, replica_env
from kubetrain.distributed.spec import DistributedSpec
from kubetrain.extras import missing_extra
from kubetrain.pod_startup import QUEUE_LABEL
from kubetrain_contract.cluster import REPLICAS_ENV, replicas_json

JOB_LABEL = "kubetrain.io/distributed-job"
ROLE_LABEL = "kubetrain.io/replica-role"
TFJOB_CONTAINER = "tensorflow"  # the container the training operator writes TF_CONFIG into
TFJOB_PORT_NAME = "tfjob-port"
TF_PORT_NAME = "tf"
TFJOB_REPLICA_TYPES = {"chief": "Chief", "worker": "Worker", "ps": "PS"}
# The role label of the replicas of a queued run's one Indexed Job (the chief is its index 0).
GANG_ROLE = "all"
# The label Kubernetes gives each pod of an Indexed Job: its completion index.
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
# Kubeflow Trainer's label of the replicated job it sizes with numNodes (pkg/constants: LabelTrainJobAncestor,
# AncestorTrainer), and the container name its webhook requires in that job (constants.Node).
TRAINJOB_ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
TRAINJOB_ANCESTOR_TRAINER = "trainer"
TRAINJOB_CONTAINER = "node"


def to_dict(obj: Any) -> Any:
    """A ``kubernetes.client`` model as the API's JSON (camelCase, no nulls)."""
    return ApiClient().sanitize_for_serialization(obj)


@dataclass(frozen=True)
class Resource:
    """One object to create: its API, kind, plural (the REST resource) and body."""

    api_version: str
    kind: str
    plural: str
    name: str
    body: dict[str, Any]

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    @property
    def version(self) -> str:
        return self.api_version.rpartition("/")[2]


@dataclass(frozen=True)
class Submission:
    """Everything one backend submits for a run, and how to find its pods.

    :param backend: ``tfjob``, ``trainjob`` or ``indexed_job``.
    :param name: the job's name (also the Service's and the JobSet's).
    :param namespace: where everything is created.
    :param replicas: replicas per role.
    :param hosts: the replicas' host pattern (:func:`~kubetrain.distributed.cluster.host_pattern`).
    :param container: the base container's name in every replica.
    :param resources: the objects, in creation order.
    :param gang: every replica is in one Indexed Job (``<name>-all``, a queued run's), admitted as one.
    """

    backend: str
    name: str
    namespace: str
    replicas: dict[str, int]
    hosts: str
    container: str
    resources: list[Resource] = field(default_factory=list)
    gang: bool = False

    @property
    def pod_selector(self) -> str:
        """Label selector of every replica's pods."""
        return f"{JOB_LABEL}={self.name}"

    @property
    def chief_selector(self) -> str:
        if self.gang:
            return f"{JOB_LABEL}={self.name},{INDEX_LABEL}=0"
        return f"{JOB_LABEL}={self.name},{ROLE_LABEL}=chief"

    @property
    def job_roles(self) -> list[str]:
        """The ``<role>`` of each Indexed Job ``<name>-<role>``."""
        return [GANG_ROLE] if self.gang else list(self.replicas)

    def cluster(self) -> dict[str, list[str]]:
        """The cluster the replicas form (the TF_CONFIG ``cluster``)."""
        return cluster_spec(self.replicas, self.hosts)


def role_config(
    config: pod_spec.TrainingPodConfig, spec: DistributedSpec, role: str
) -> pod_spec.TrainingPodConfig:
    """The pod settings of ``role``: its own CPU, memory and GPUs (request == limit)."""
    res = spec.resources(role)
    return dataclasses.replace(
        config, cpu=res.cpu, memory=res.memory, cpu_limit=None, memory_limit=None, gpus=res.gpus
    )


def replica_template(
    config: pod_spec.TrainingPodConfig,
    spec: DistributedSpec,
    role: str,
    *,
    name: str,
    env: Mapping[str, str],
    subdomain: str | None,
    container: str,
    port_name: str,
    restart_policy: str = "Never",
) -> k8s.V1PodTemplateSpec:
    """The pod template of ``role``'s replicas."""
    return pod_spec.pod_template(
        role_config(config, spec, role),
        sync=role == "chief",
        env=env,
        ports=[k8s.V1ContainerPort(name=port_name, container_port=spec.port, protocol="TCP")],
        labels={JOB_LABEL: name, ROLE_LABEL: role},
        subdomain=subdomain,
        restart_policy=restart_policy,
        container_name=container,
    )


def _queued(queue: Mapping[str, str] | None, spec: DistributedSpec, backend: str) -> dict[str, str]:
    """Kueue's labels for the job object; refuses what Kueue could not admit all or nothing."""
    if not queue:
        return {}
    if backend == "indexed_job" and spec.parameter_server:
        raise ValueError(
            f"backend 'indexed_job' cannot queue a parameter-server run in Kueue LocalQueue "
            f"{queue.get(QUEUE_LABEL, '')!r}: its roles are Jobs of different sizes, which Kueue "
            "admits one by one, so the chief could run while a worker waits; expected backend 'tfjob' or "
            "'trainjob' (one workload, admitted all or nothing), or ps_replicas=0"
        )
    return dict(queue)


def _meta(name: str, namespace: str, labels: Mapping[str, str]) -> k8s.V1ObjectMeta:
    return k8s.V1ObjectMeta(
        name=name,
        namespace=namespace,
        labels={**{k: pod_spec.label_value(v) for k, v in labels.items()}, JOB_LABEL: name},
    )


# -- indexed_job ---------------------------------------------------------------------------------


def indexed_job(
    config: pod_spec.TrainingPodConfig,
    spec: DistributedSpec,
    *,
    name: str,
    namespace: str,
    labels: Mapping[str, str],
    queue: Mapping[str, str] | None = None,
) -> Submission:
    """A headless Service and one Indexed Job per role; in a queue, one Indexed Job of every replica."""
    queue_labels = _queued(queue, spec, "indexed_job")
    replicas = spec.replicas()
    hosts = host_pattern("indexed_job", job=name, namespace=namespace, port=spec.port)
    meta = _meta(name, namespace, labels)
    service = k8s.V1Service(
        api_version="v1",
        kind="Service",
        metadata=meta,
        spec=k8s.V1ServiceSpec(
            cluster_ip="None",
            selector={JOB_LABEL: name},
            # Workers look each other up while they start, before they are Ready.
            publish_not_ready_addresses=True,
            ports=[
                k8s.V1ServicePort(name=TF_PORT_NAME, port=spec.port, target_port=spec.port, protocol="TCP")
            ],
        ),
    )
    resources = [Resource("v1", "Service", "services", name, to_dict(service))]
    if queue_labels:
        job = gang_job(config, spec, name=name, namespace=namespace, labels={**meta.labels, **queue_labels})
        resources.append(Resource("batch/v1", "Job", "jobs", job.metadata.name, to_dict(job)))
        gang_hosts = f"{name}-{GANG_ROLE}-{{replica}}.{name}:{spec.port}"
        return Submission(
            "indexed_job",
            name,
            namespace,
            replicas,
            gang_hosts,
            pod_spec.BASE_CONTAINER,
            resources,
            gang=True,
        )
    for role, count in replicas.items():
        job_name = f"{name}-{role}"
        template = replica_template(
            config,
            spec,
            role,
            name=name,
            env=replica_env(replicas, hosts, role),
            subdomain=name,
            container=pod_spec.BASE_CONTAINER,
            port_name=TF_PORT_NAME,
        )
        job = k8s.V1Job(
            api_version="batch/v1",
            kind="Job",
            metadata=k8s.V1ObjectMeta(
                name=job_name, namespace=namespace, labels={**meta.labels, ROLE_LABEL: role}
            ),
            spec=k8s.V1JobSpec(
                completion_mode="Indexed",
                completions=count,
                parallelism=count,
                # Each failed pod is replaced (its stage-in restores the chief's newest checkpoint).
                backoff_limit=spec.max_restarts * count,
                template=template,
            ),
        )
        resources.append(Resource("batch/v1", "Job", "jobs", job_name, to_dict(job)))
    return Submission("indexed_job", name, namespace, replicas, hosts, pod_spec.BASE_CONTAINER, resources)


def gang_job(
    config: pod_spec.TrainingPodConfig,
    spec: DistributedSpec,
    *,
    name: str,
    namespace: str,
    labels: Mapping[str, str],
) -> k8s.V1Job:
    """One Indexed Job ``<name>-all`` of every replica of a multi-worker run (no parameter servers):
    index 0 is the chief, and every replica computes its role from its index (no ``KUBETRAIN_TF_ROLE``).

    Every pod has the sidecar (the template is shared); it syncs on the chief only, and idles on the
    others, which it tells from ``KUBETRAIN_TF_REPLICAS`` and ``JOB_COMPLETION_INDEX``.
    """
    replicas = spec.replicas()
    count = sum(replicas.values())
    job_name = f"{name}-{GANG_ROLE}"
    hosts = f"{job_name}-{{replica}}.{name}:{spec.port}"
    template = pod_spec.pod_template(
        role_config(config, spec, "worker"),
        sync=True,
        env=replica_env(replicas, hosts, None),
        sidecar_env={REPLICAS_ENV: replicas_json(replicas)},
        ports=[k8s.V1ContainerPort(name=TF_PORT_NAME, container_port=spec.port, protocol="TCP")],
        labels={JOB_LABEL: name, ROLE_LABEL: GANG_ROLE},
        subdomain=name,
        container_name=pod_spec.BASE_CONTAINER,
    )
    return k8s.V1Job(
        api_version="batch/v1",
        kind="Job",
        metadata=k8s.V1ObjectMeta(
            name=job_name, namespace=namespace, labels={**labels, ROLE_LABEL: GANG_ROLE}
        ),
        spec=k8s.V1JobSpec(
            completion_mode="Indexed",
            completions=count,
            parallelism=count,
            backoff_limit=spec.max_restarts * count,
            template=template,
        ),
    )


# -- tfjob ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TFReplicaSpec:
    """``KubeflowOrgV1ReplicaSpec``: replicas of one type, their restart policy and pod template."""

    replicas: int
    template: k8s.V1PodTemplateSpec
    restart_policy: str = "ExitCode"

    def __post_init__(self) -> None:
        if self.restart_policy not in ("Always", "OnFailure", "Never", "ExitCode"):
            raise ValueError(
                f"restart_policy {self.restart_policy!r}: expected Always, OnFailure, Never or ExitCode"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "replicas": self.replicas,
            "restartPolicy": self.restart_policy,
            "template": to_dict(self.template),
        }


@dataclass(frozen=True)
class TFRunPolicy:
    """``KubeflowOrgV1RunPolicy``: what happens to pods and retries."""

    clean_pod_policy: str = "All"
    backoff_limit: int | None = None
    active_deadline_seconds: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"cleanPodPolicy": self.clean_pod_policy}
        if self.backoff_limit is not None:
            out["backoffLimit"] = self.backoff_limit
        if self.active_deadline_seconds is not None:
            out["activeDeadlineSeconds"] = self.active_deadline_seconds
        return out


@dataclass(frozen=True)
class TFJob:
    """``KubeflowOrgV1TFJob`` (kubeflow.org/v1): one replica spec per type (Chief, Worker, PS)."""

    metadata: k8s.V1ObjectMeta
    replica_specs: Mapping[str, TFReplicaSpec]
    run_policy: TFRunPolicy = field(default_factory=TFRunPolicy)
    api_version: str = "kubeflow.org/v1"
    kind: str = "TFJob"

    def __post_init__(self) -> None:
        unknown = set(self.replica_specs) - {"Chief", "Worker", "PS", "Evaluator", "Master"}
        if unknown:
            raise ValueError(
                f"TFJob replica types {sorted(unknown)} are not Chief, Worker, PS, Evaluator or Master"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "metadata": to_dict(self.metadata),
            "spec": {
                "runPolicy": self.run_policy.to_dict(),
                "tfReplicaSpecs": {k: v.to_dict() for k, v in self.replica_specs.items()},
            },
        }


def tfjob(
    config: pod_spec.TrainingPodConfig,
    spec: DistributedSpec,
    *,
    name: str,
    namespace: str,
    labels: Mapping[str, str],
    queue: Mapping[str, str] | None = None,
) -> Submission:
    """A TFJob whose Chief, Worker and PS replicas follow the training pod contract."""
    queue_labels = _queued(queue, spec, "tfjob")
    replicas = spec.replicas()
    hosts = host_pattern("tfjob", job=name, namespace=namespace, port=spec.port)
    replica_specs = {
        TFJOB_REPLICA_TYPES[role]: TFReplicaSpec(
            replicas=count,
            # ExitCode: the operator replaces a pod killed by a signal (exit 128+N); an exit of 1-127
            # (75 after SIGTERM included) fails the TFJob and the task's retry resumes the run.
            restart_policy="ExitCode",
            template=replica_template(
                config,
                spec,
                role,
                name=name,
                env={},
                subdomain=None,
                container=TFJOB_CONTAINER,
                port_name=TFJOB_PORT_NAME,
            ),
        )
        for role, count in replicas.items()
    }
    job = TFJob(
        metadata=_meta(name, namespace, {**labels, **queue_labels}),
        replica_specs=replica_specs,
        run_policy=TFRunPolicy(clean_pod_policy="All", backoff_limit=spec.max_restarts * spec.total),
    )
    return Submission(
        "tfjob",
        name,
        namespace,
        replicas,
        hosts,
        TFJOB_CONTAINER,
        [Resource("kubeflow.org/v1", "TFJob", "tfjobs", name, job.to_dict())],
    )


# -- trainjob ------------------------------------------------------------------------------------


def trainjob(
    config: pod_spec.TrainingPodConfig,
    spec: DistributedSpec,
    *,
    name: str,
    namespace: str,
    labels: Mapping[str, str],
    queue: Mapping[str, str] | None = None,
) -> Submission:
    """A TrainingRuntime (a JobSet template, one replicated job per role) and the TrainJob that runs it."""
    queue_labels = _queued(queue, spec, "trainjob")
    try:
        from kubeflow_trainer_api import models as kf
    except ModuleNotFoundError as exc:
        raise missing_extra("trainjob", exc) from exc

    replicas = spec.replicas()
    hosts = host_pattern("trainjob", job=name, namespace=namespace, port=spec.port)
    meta = to_dict(_meta(name, namespace, labels))
    # the replicated job whose size is the Trainer's numNodes
    trainer_role = "worker" if "worker" in replicas else "chief"
    num_nodes = replicas[trainer_role]
    replicated = []
    for role, count in replicas.items():
        template = replica_template(
            config,
            spec,
            role,
            name=name,
            env=replica_env(replicas, hosts, role),
            subdomain=None,
            container=TRAINJOB_CONTAINER,
            port_name=TF_PORT_NAME,
        )
        job_labels = {ROLE_LABEL: role}
        if role == trainer_role:
            job_labels[TRAINJOB_ANCESTOR_LABEL] = TRAINJOB_ANCESTOR_TRAINER
        job_template = k8s.V1JobTemplateSpec(
            metadata=k8s.V1ObjectMeta(labels=job_labels),
            spec=k8s.V1JobSpec(
                completion_mode="Indexed",
                completions=count,
                parallelism=count,
                backoff_limit=0,
                template=template,
            ),
        )
        replicated.append(
            kf.JobsetV1alpha2ReplicatedJob(
                name=role,
                replicas=1,
                template=kf.IoK8sApiBatchV1JobTemplateSpec.from_dict(to_dict(job_template)),
            )
        )
    runtime = kf.TrainerV1alpha1TrainingRuntime(
        api_version="trainer.kubeflow.org/v1alpha1",
        kind="TrainingRuntime",
        metadata=kf.IoK8sApimachineryPkgApisMetaV1ObjectMeta.from_dict(meta),
        spec=kf.TrainerV1alpha1TrainingRuntimeSpec(
            ml_policy=kf.TrainerV1alpha1MLPolicy(num_nodes=num_nodes),
            template=kf.TrainerV1alpha1JobSetTemplateSpec(
                spec=kf.JobsetV1alpha2JobSetSpec(
                    replicated_jobs=replicated,
                    network=kf.JobsetV1alpha2Network(
                        enable_dns_hostnames=True, publish_not_ready_addresses=True
                    ),
                    # The chief's success ends the JobSet; any failure restarts every replica together.
                    success_policy=kf.JobsetV1alpha2SuccessPolicy(
                        operator="Any", target_replicated_jobs=["chief"]
                    ),
                    failure_policy=kf.JobsetV1alpha2FailurePolicy(max_restarts=spec.max_restarts),
                ),
            ),
        ),
    )
    train = kf.TrainerV1alpha1TrainJob(
        api_version="trainer.kubeflow.org/v1alpha1",
        kind="TrainJob",
        metadata=kf.IoK8sApimachineryPkgApisMetaV1ObjectMeta.from_dict(
            to_dict(_meta(name, namespace, {**labels, **queue_labels}))
        ),
        spec=kf.TrainerV1alpha1TrainJobSpec(
            runtime_ref=kf.TrainerV1alpha1RuntimeRef(
                name=name, kind="TrainingRuntime", api_group="trainer.kubeflow.org"
            ),
            trainer=kf.TrainerV1alpha1Trainer(num_nodes=num_nodes),
        ),
    )
    return Submission(
        "trainjob",
        name,
        namespace,
        replicas,
        hosts,
        TRAINJOB_CONTAINER,
        [
            Resource(
                "trainer.kubeflow.org/v1alpha1",
                "TrainingRuntime",
                "trainingruntimes",
                name,
                runtime.to_dict(),
            ),
            Resource("trainer.kubeflow.org/v1alpha1", "TrainJob", "trainjobs", name, train.to_dict()),
        ],
    )


BUILDERS = {"tfjob": tfjob, "trainjob": trainjob, "indexed_job": indexed_job}
assert set(BUILDERS) == set(BACKENDS)


def build(
    backend: str,
    config: pod_spec.TrainingPodConfig,
    spec: DistributedSpec,
    *,
    name: str,
    namespace: str,
    labels: Mapping[str, str],
    queue: Mapping[str, str] | None = None,
) -> Submission:
    """The objects ``backend`` submits for a run of ``config`` with the replicas of ``spec``.

    :param queue: Kueue's labels (LocalQueue, priority class) for the job object; empty: not queued.
    """
    if backend not in BUILDERS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    return BUILDERS[backend](config, spec, name=name, namespace=namespace, labels=labels, queue=queue)
