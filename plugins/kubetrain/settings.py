"""Deployment settings: every environment choice of kubetrain, read in one place.

Each setting is looked up when a task runs, never when a DAG file is parsed: the Airflow
Variable ``kubetrain_<name>`` first, then the environment variable ``KUBETRAIN_<NAME>``, then
the default below. ``.env.example`` lists the same settings with the same defaults, and
README's settings table is generated from :data:`SETTINGS` (a test keeps the three in step).
The few switches that must be known when a DAG file is parsed (schedules, retry delay) come
from the environment alone, through :func:`environ`, which reads only the names declared in
:data:`ENVIRONMENT`.

Per-run choices (a DAG's Params) beat these deployment defaults; see
:func:`kubetrain.pipeline.common_params`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Setting:
    """One environment choice.

    :param name: lower-case name; the Variable is ``kubetrain_<name>``, the environment
        variable ``KUBETRAIN_<NAME>``.
    :param default: value when neither is set ("" means unset).
    :param description: one sentence for README's table and ``.env.example``.
    :param param: the training DAGs' Param that overrides it for one run, if any.
    """

    name: str
    default: str
    description: str
    param: str | None = None

    @property
    def env(self) -> str:
        return f"KUBETRAIN_{self.name.upper()}"

    @property
    def variable(self) -> str:
        return f"kubetrain_{self.name}"


# A Kubernetes object name that is a DNS subdomain (a Secret, a Kueue LocalQueue or WorkloadPriorityClass).
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"

SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        Setting("namespace", "kubetrain", "Namespace of training, build and preflight pods."),
        Setting(
            "build_namespace",
            "",
            "Namespace of in-cluster image builds; empty: namespace. Their rootless builder needs Pod Security "
            "level privileged (seccomp and AppArmor Unconfined): give them a namespace of their own where the "
            "training namespace enforces baseline or restricted.",
        ),
        Setting(
            "s3_secret",
            "kubetrain-s3",
            "Secret with AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL, AWS_DEFAULT_REGION) "
            "for the pods' S3 access; empty for workload identity (then set service_account).",
        ),
        Setting(
            "service_account",
            "",
            "Service account of training pods; with an empty s3_secret it carries the workload identity "
            "(EKS IRSA: GKE's and Azure's give tokens that S3 clients cannot use).",
        ),
        Setting(
            "image_pull_secrets",
            "",
            "Comma-separated docker-registry Secrets for pulling the trainer and sync images.",
            param="image_pull_secrets",
        ),
        Setting(
            "node_selector",
            "",
            "Node labels training pods must match: k=v,k2=v2 or a JSON object.",
            param="node_selector",
        ),
        Setting(
            "tolerations",
            "",
            'Extra tolerations of training pods, a JSON list such as [{"key": "spot", "operator": "Exists"}].',
            param="tolerations",
        ),
        Setting(
            "gpu_resource",
            "nvidia.com/gpu",
            "Extended resource that GPUs are requested as (nvidia.com/gpu, a MIG profile such as "
            "nvidia.com/mig-1g.10gb, amd.com/gpu, ...); GPU pods tolerate its vendor's taint.",
            param="gpu_resource",
        ),
        Setting(
            "queue",
            "",
            "Kueue LocalQueue that training pods wait in (the kueue.x-k8s.io/queue-name label); empty: none, "
            "pods go straight to the scheduler.",
            param="queue",
        ),
        Setting(
            "queue_timeout",
            "86400",
            "Seconds a training pod may wait for Kueue to admit it before the task fails; its start-up "
            "budgets count from admission.",
        ),
        Setting(
            "registry",
            "localhost:5000",
            "Registry that holds the trainer and sync images: host[:port], optionally with the path the "
            "repositories live under (Artifact Registry: <region>-docker.pkg.dev/<project>/<repository>).",
        ),
        Setting(
            "image_tag",
            "latest",
            "Release tag of the default images: what `make images IMAGE_TAG=<tag>` pushed (trainer:<tag> for GPU, "
            "trainer:<tag>-cpu, sync:<tag>), and what build_trainer_image tags.",
        ),
        Setting(
            "trainer_variant",
            "gpu",
            "gpu or cpu: which trainer the default image is (trainer:<image_tag> or trainer:<image_tag>-cpu) and "
            "which build_trainer_image builds; cpu for clusters without GPUs.",
        ),
        Setting(
            "trainer_image",
            "",
            "Trainer image; empty: the one build_trainer_image published last, else "
            "<registry>/kubetrain/trainer:<image_tag> (-cpu for the cpu variant). Runs pin it to its digest.",
            param="image",
        ),
        Setting(
            "sync_image",
            "",
            "Image of the stage-in and checkpoint-sync containers; empty: the one build_trainer_image "
            "published last, else <registry>/kubetrain/sync:<image_tag>.",
        ),
        Setting("datasets_bucket", "datasets", "Bucket of the users' datasets."),
        Setting(
            "dataset_prefixes",
            "",
            "Comma-separated s3:// prefixes that runs may stage datasets from; empty: the whole datasets bucket. "
            "Never the training bucket's own areas (runs, models, manifests, ...).",
        ),
        Setting("training_bucket", "training", "Bucket of manifests, runs, reports and promoted models."),
        Setting(
            "token_services",
            "",
            "Comma-separated https:// URLs (or host[:port]) of the token services, blob stores and upload hosts a "
            "registry may send the workers to, beside the registry's own host and the known ones of Docker Hub, "
            "ECR, GCR and GHCR (e.g. a private registry's token service); other Bearer realms, blob redirects "
            "and upload Locations are refused before any request is sent there.",
        ),
        Setting(
            "mlflow_tracking_uri",
            "",
            "MLflow tracking server that every training run is also logged to (e.g. http://mlflow:5000); "
            "empty: the mlflow_default connection if there is one, else no MLflow.",
        ),
    )
}


@dataclass(frozen=True)
class EnvironmentVariable:
    """A deployment switch read from the environment alone, when a DAG file is parsed or an operator
    starts (no Variable: parsing must not reach the metadata database).

    :param name: the variable, ``KUBETRAIN_<...>``.
    :param description: what it chooses; ``.env.example`` documents it with its default.
    """

    name: str
    description: str


ENVIRONMENT: dict[str, EnvironmentVariable] = {
    v.name: v
    for v in (
        EnvironmentVariable("KUBETRAIN_RETRY_DELAY_SECONDS", "Seconds between a task's retries (every DAG)."),
        EnvironmentVariable(
            "KUBETRAIN_UNSCHEDULABLE_GRACE_SECONDS",
            "Seconds a training pod may stay unschedulable, with no autoscaler adding a node, before its "
            "task fails without a retry (every DAG).",
        ),
        EnvironmentVariable(
            "KUBETRAIN_TRAINER_DIR", "The trainer/ directory the image build DAG builds from."
        ),
        EnvironmentVariable("KUBETRAIN_REGISTRY_CONN_ID", "The registry connection of the image build DAG."),
        EnvironmentVariable(
            "KUBETRAIN_IMAGE_BUILD_CRON", "Schedule of the image build DAG; empty: manual only."
        ),
        EnvironmentVariable("KUBETRAIN_BUILDAH_ROOT", "buildah's storage (the layer cache) on the worker."),
        EnvironmentVariable(
            "KUBETRAIN_WATCHED_DATASETS", "Comma-separated S3 URIs the watch_datasets DAG stages."
        ),
        EnvironmentVariable("KUBETRAIN_WATCH_CRON", "Schedule of the watch_datasets DAG."),
        EnvironmentVariable(
            "KUBETRAIN_RUN_INDEX_CRON", "Schedule of kubetrain_run_index (the Training page's index upkeep)."
        ),
        EnvironmentVariable(
            "KUBETRAIN_IMAGE_CLASSIFIER_CRON", "Schedule of train_image_classifier; empty: none."
        ),
        EnvironmentVariable(
            "KUBETRAIN_IMAGE_CLASSIFIER_DISTRIBUTED_CRON", "Schedule of train_image_classifier_distributed."
        ),
        EnvironmentVariable(
            "KUBETRAIN_DIALOGUE_CRON", "Schedule of train_dialogue_transformer; empty: none."
        ),
        EnvironmentVariable("KUBETRAIN_KERAS_EXAMPLE_CRON", "Schedule of example_keras_model; empty: none."),
    )
}


def environ(name: str, default: str | None = None) -> str | None:
    """The environment variable ``name``, else ``default``.

    kubetrain's own variables (``KUBETRAIN_*``) must be declared in :data:`ENVIRONMENT`; a
    deployment's own DAG may name a variable of its own (``kubetrain.pipeline.schedule``).

    :param name: a key of :data:`ENVIRONMENT`, or a name outside ``KUBETRAIN_*``.
    :param default: the value when the variable is unset.
    :raises KeyError: ``name`` is a ``KUBETRAIN_*`` name not declared in :data:`ENVIRONMENT`.
    """
    if name.startswith("KUBETRAIN_") and name not in ENVIRONMENT:
        raise KeyError(
            f"undeclared kubetrain environment variable {name!r}: declare it in kubetrain.settings.ENVIRONMENT "
            "and .env.example"
        )
    return os.environ.get(name, default)


def markdown_table() -> str:
    """README's settings table, generated from :data:`SETTINGS`."""
    rows = [
        "| setting | environment variable | Airflow Variable | default | Param of a run | what it is |",
        "|---|---|---|---|---|---|",
    ]
    for s in SETTINGS.values():
        default = f"`{s.default}`" if s.default else "(empty)"
        param = f"`{s.param}`" if s.param else "-"
        what = s.description.replace("<", "&lt;").replace(">", "&gt;")
        rows.append(f"| {s.name} | `{s.env}` | `{s.variable}` | {default} | {param} | {what} |")
    return "\n".join(rows)


# The API server's rules for label keys and values (k8s.io/apimachinery/pkg/util/validation/validation.go,
# IsQualifiedName and IsValidLabelValue), which node selectors (ValidateLabels) and tolerations
# (pkg/apis/core/validation ValidateTolerations: key a qualified name, value a label value) follow:
#
#   qualified name  [prefix/]name: prefix a DNS-1123 subdomain (at most 253 characters, dot-separated
#                   parts of [a-z0-9-] starting and ending with [a-z0-9]); name at most 63 characters,
#                   [A-Za-z0-9][-A-Za-z0-9_.]* ending with [A-Za-z0-9]; at most one '/'
#   label value     empty, or a name as above (at most 63 characters)
LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
DNS1123_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
# The same rules as JSON Schema patterns for the trigger form (ECMA-262 and Python's re read them
# alike; "$(?!\n)" because Python's "$" also matches before a final newline).
LABEL_VALUE_PATTERN = rf"^(?=.{{0,63}}$(?!\n))({LABEL_NAME})?$(?!\n)"
QUALIFIED_NAME_PATTERN = (
    rf"^((?=[^/]{{1,253}}/){DNS1123_SUBDOMAIN}/)?(?=[^/]{{1,63}}$(?!\n)){LABEL_NAME}$(?!\n)"
)
_LABEL_NAME = re.compile(LABEL_NAME)
_DNS1123_SUBDOMAIN = re.compile(DNS1123_SUBDOMAIN)
_NAME_CHARS = "letters, digits, '-', '_' and '.', starting and ending with a letter or digit"


def qualified_name_problem(value: object) -> str | None:
    """What makes ``value`` no Kubernetes qualified name (a label key, a toleration key); ``None``: it is one.

    The rule (IsQualifiedName in k8s.io/apimachinery/pkg/util/validation): an optional prefix, a
    DNS-1123 subdomain of at most 253 characters, and '/'; then a name of at most 63 characters,
    :data:`LABEL_NAME`.
    """
    if not isinstance(value, str):
        return "expected text"
    parts = value.split("/")
    if len(parts) > 2:
        return "expected at most one '/', between an optional DNS subdomain prefix and the name"
    if len(parts) == 2:
        prefix = parts[0]
        if not prefix:
            return "its prefix before '/' is empty: expected a DNS subdomain such as example.com"
        if len(prefix) > 253:
            return f"its prefix has {len(prefix)} characters: expected at most 253"
        if not _DNS1123_SUBDOMAIN.fullmatch(prefix):
            return (
                f"its prefix {prefix!r} is not a DNS-1123 subdomain: expected lower-case letters, digits, '-' "
                "and '.', each dot-separated part starting and ending with a letter or digit"
            )
    name = parts[-1]
    if not name:
        return "its name is empty: expected 1 to 63 " + _NAME_CHARS
    if len(name) > 63:
        return f"its name part has {len(name)} characters: expected at most 63"
    if not _LABEL_NAME.fullmatch(name):
        return f"its name part {name!r} is not valid: expected {_NAME_CHARS}"
    return None


def label_value_problem(value: object) -> str | None:
    """What makes ``value`` no Kubernetes label value; ``None``: it is one.

    The rule (IsValidLabelValue in k8s.io/apimachinery/pkg/util/validation): empty, or at most 63
    characters of :data:`LABEL_NAME`.
    """
    if not isinstance(value, str):
        return "expected text"
    if len(value) > 63:
        return f"it has {len(value)} characters: expected at most 63"
    if value and not _LABEL_NAME.fullmatch(value):
        return f"expected empty or {_NAME_CHARS}"
    return None


def get(name: str) -> str:
    """The value of setting ``name``: Airflow Variable, else environment variable, else default.

    Outside a task (``python -m kubetrain.preflight``, tests) a Variable that cannot be read
    counts as unset.

    :param name: a key of :data:`SETTINGS`.
    """
    setting = SETTINGS.get(name)
    if setting is None:
        raise KeyError(f"unknown kubetrain setting {name!r}: expected one of {', '.join(SETTINGS)}")
    value = _variable(setting.variable)
    if value in (None, ""):
        value = os.environ.get(setting.env, setting.default)
    return str(value).strip()


def get_from_environment(name: str) -> str:
    """The value of setting ``name`` as the environment gives it (its variable, else its default), without
    its Airflow Variable: what a DAG file may read when it is parsed (a trigger form's schema).

    :param name: a key of :data:`SETTINGS`.
    """
    setting = SETTINGS[name]
    return str(os.environ.get(setting.env) or setting.default).strip()


def _variable(name: str) -> Any:
    try:
        from airflow.sdk import Variable

        return Variable.get(name, default=None)
    except Exception:  # no task context and no metadata database: the environment decides
        return None


def parse_list(name: str, value: str) -> tuple[str, ...]:
    """A comma-separated list (spaces around items ignored, empty items dropped)."""
    return tuple(part.strip() for part in str(value or "").split(",") if part.strip())


def parse_node_selector(value: str | Mapping[str, str] | None) -> dict[str, str]:
    """Node labels from ``k=v,k2=v2``, a JSON object, or a mapping; ``{}`` when empty.

    The API server's rules apply (ValidateLabels of a pod's nodeSelector): each key a qualified
    name (:func:`qualified_name_problem`), each value a label value (:func:`label_value_problem`).
    """
    if not value:
        return {}
    if isinstance(value, Mapping):
        labels = dict(value)
    elif str(value).strip().startswith("{"):
        try:
            labels = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"node_selector {value!r} is not a JSON object: {exc}") from None
    else:
        labels = {}
        for item in parse_list("node_selector", str(value)):
            key, sep, val = item.partition("=")
            if not sep:
                raise ValueError(
                    f"node_selector item {item!r} is not key=value: expected e.g. pool=gpu,zone=a"
                )
            labels[key.strip()] = val.strip()
    for key, val in labels.items():
        if not isinstance(key, str) or not isinstance(val, str):
            raise ValueError(
                f"node_selector {key!r}={val!r} is not a valid node label: expected key=value strings"
            )
        problem = qualified_name_problem(key)
        if problem:
            raise ValueError(f"node_selector key {key!r} is not a valid label key: {problem}")
        problem = label_value_problem(val)
        if problem:
            raise ValueError(f"node_selector value {val!r} of {key!r} is not a valid label value: {problem}")
    return labels


TRAINER_VARIANTS = ("gpu", "cpu")
TOLERATION_KEYS = {"key", "operator", "value", "effect", "tolerationSeconds", "toleration_seconds"}


def parse_tolerations(value: str | list[Any] | None) -> list[dict[str, Any]]:
    """Tolerations from a JSON list of objects (or such a list); ``[]`` when empty.

    The API server's rules apply (ValidateTolerations in pkg/apis/core/validation): a key is a
    qualified name (:func:`qualified_name_problem`) and may be empty only with operator Exists;
    a value is a label value (:func:`label_value_problem`) and must be empty with Exists;
    tolerationSeconds (an int64) only with effect NoExecute.
    """
    if not value:
        return []
    items = value
    if isinstance(value, str):
        try:
            items = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"tolerations {value!r} is not a JSON list: {exc}") from None
    if not isinstance(items, list) or not all(isinstance(t, dict) for t in items):
        raise ValueError(
            f'tolerations {value!r} is not a list of objects: expected e.g. [{{"key": "spot", "operator": "Exists"}}]'
        )
    for item in items:
        unknown = set(item) - TOLERATION_KEYS
        if unknown:
            raise ValueError(
                f"toleration {item!r} has unknown field(s) {', '.join(sorted(unknown))}: expected "
                "key, operator, value, effect, tolerationSeconds"
            )
        operator = item.get("operator") or "Equal"
        if operator not in ("Equal", "Exists"):
            raise ValueError(f"toleration {item!r}: operator {operator!r} must be Equal or Exists")
        if item.get("effect") not in (None, "", "NoSchedule", "PreferNoSchedule", "NoExecute"):
            raise ValueError(
                f"toleration {item!r}: effect {item.get('effect')!r} must be NoSchedule, PreferNoSchedule "
                "or NoExecute"
            )
        for name in ("key", "value", "effect"):
            if item.get(name) is not None and not isinstance(item[name], str):
                raise ValueError(f"toleration {item!r}: {name} must be a string")
        if operator == "Exists" and item.get("value"):
            raise ValueError(f"toleration {item!r}: value must be empty when operator is Exists")
        if operator == "Equal" and not item.get("key"):
            raise ValueError(
                f"toleration {item!r}: an empty key needs operator Exists (it tolerates every taint)"
            )
        if item.get("key"):
            problem = qualified_name_problem(item["key"])
            if problem:
                raise ValueError(
                    f"toleration {item!r}: key {item['key']!r} is not a valid label key: {problem}"
                )
        if item.get("value"):
            problem = label_value_problem(item["value"])
            if problem:
                raise ValueError(
                    f"toleration {item!r}: value {item['value']!r} is not a valid label value: {problem}"
                )
        seconds = item.get("tolerationSeconds", item.get("toleration_seconds"))
        if seconds is not None and (
            isinstance(seconds, bool) or not isinstance(seconds, int) or not -(2**63) <= seconds < 2**63
        ):
            raise ValueError(
                f"toleration {item!r}: tolerationSeconds must be a whole number of seconds (a 64-bit integer)"
            )
        if seconds is not None and item.get("effect") != "NoExecute":
            raise ValueError(f"toleration {item!r}: tolerationSeconds applies only with effect NoExecute")
    return [dict(t) for t in items]


@dataclass(frozen=True)
class Deployment:
    """The deployment's settings, parsed and checked (see :data:`SETTINGS`)."""

    namespace: str = SETTINGS["namespace"].default
    s3_secret: str | None = SETTINGS["s3_secret"].default
    service_account: str | None = None
    image_pull_secrets: tuple[str, ...] = ()
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()
    gpu_resource: str = SETTINGS["gpu_resource"].default
    registry: str = SETTINGS["registry"].default
    image_tag: str = SETTINGS["image_tag"].default
    trainer_variant: str = SETTINGS["trainer_variant"].default
    trainer_image: str | None = None
    sync_image: str | None = None
    datasets_bucket: str = SETTINGS["datasets_bucket"].default
    training_bucket: str = SETTINGS["training_bucket"].default
    queue: str | None = None

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", self.namespace or ""):
            raise ValueError(
                f"namespace {self.namespace!r} is not a valid namespace name: expected a DNS-1123 label"
            )
        if not self.s3_secret and not self.service_account:
            raise ValueError(
                "s3_secret is empty (workload identity) but no service_account is set: training pods would "
                "have no way to reach S3; set KUBETRAIN_SERVICE_ACCOUNT or KUBETRAIN_S3_SECRET"
            )
        if not re.fullmatch(r"([a-z0-9.-]+/)?[a-z0-9][-a-z0-9_.]*(/[-a-z0-9_.]+)?", self.gpu_resource or ""):
            raise ValueError(
                f"gpu_resource {self.gpu_resource!r} is not an extended resource name: expected e.g. nvidia.com/gpu"
            )
        if self.queue and not re.fullmatch(DNS_SUBDOMAIN, self.queue):
            raise ValueError(
                f"queue {self.queue!r} is not a Kueue LocalQueue name: expected lowercase letters, digits, '-' "
                "and '.', starting and ending with a letter or digit"
            )
        if self.trainer_variant not in TRAINER_VARIANTS:
            raise ValueError(
                f"trainer_variant {self.trainer_variant!r} is not a trainer variant: expected gpu or cpu"
            )
        from kubetrain.imagebuild.reference import check_tag, split_registry

        split_registry(self.registry)
        check_tag(self.image_tag)

    @classmethod
    def from_environment(cls) -> Deployment:
        """The settings as Variables and environment give them now."""
        return cls(
            namespace=get("namespace"),
            s3_secret=get("s3_secret") or None,
            service_account=get("service_account") or None,
            image_pull_secrets=parse_list("image_pull_secrets", get("image_pull_secrets")),
            node_selector=parse_node_selector(get("node_selector")),
            tolerations=tuple(parse_tolerations(get("tolerations"))),
            gpu_resource=get("gpu_resource"),
            registry=get("registry"),
            image_tag=get("image_tag"),
            trainer_variant=get("trainer_variant"),
            trainer_image=get("trainer_image") or None,
            sync_image=get("sync_image") or None,
            datasets_bucket=get("datasets_bucket"),
            training_bucket=get("training_bucket"),
            queue=get("queue") or None,
        )
