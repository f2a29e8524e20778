"""The schemas the rendered objects are validated against, obtained from the pinned releases at set-up.

* batch/v1 Job and v1 Service: kubernetes-validate's strict JSON schemas (Kubernetes 1.37).
* kubeflow.org/v1 TFJob (training operator v1.9.4): derived from the Kubeflow training SDK's
  OpenAPI-generated models, ``kubeflow-training==1.9.4``, which ``make setup`` installs under
  .tools/kubeflow-training (it pins kubernetes<36 and cannot live in .venv). Each model's
  ``openapi_types`` and ``attribute_map`` become an object schema that refuses unknown fields;
  the Kubernetes types it references (``V1PodTemplateSpec``, ``V1ObjectMeta``) are checked with
  kubernetes-validate.
* trainer.kubeflow.org/v1alpha1 TrainJob and TrainingRuntime (Trainer v2.3.0): the JSON schema of
  ``kubeflow-trainer-api==2.3.0``'s pydantic models, the API's generated OpenAPI models.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate

REPO = Path(__file__).resolve().parents[3]
K8S_VERSION = "1.37.0"
KUBEFLOW_TRAINING = REPO / ".tools" / "kubeflow-training" / "kubeflow" / "training" / "models"
PRIMITIVES = {
    "int": {"type": "integer"},
    "str": {"type": "string"},
    "bool": {"type": "boolean"},
    "float": {"type": "number"},
    "datetime": {"type": "string"},
    "object": {},
    # resource.Quantity travels as a string or a number, as in Kubernetes' own schemas
    "Quantity": {"type": ["string", "number"]},
}
# The generated pydantic models describe resource.Quantity as an object; on the wire it is a string or a number.
QUANTITY = "IoK8sApimachineryPkgApiResourceQuantity"
# Kubernetes types the TFJob models reference: checked separately with kubernetes-validate.
K8S_REF = "x-kubernetes-type"


# Run in an interpreter of its own with the SDK first on the path: the models' declared class attributes.
_DUMP_MODELS = """
import json
from kubeflow.training import models
print(json.dumps({
    name: [cls.openapi_types, cls.attribute_map]
    for name, cls in vars(models).items()
    if name.startswith("KubeflowOrgV1") and isinstance(cls, type)
}))
"""


@cache
def training_models() -> dict[str, tuple[dict[str, str], dict[str, str]]]:
    """Model class -> (openapi_types, attribute_map), the SDK's own declarations.

    The SDK is imported in a child interpreter: it pins kubernetes<36 and so cannot join this
    environment; its generated models import and run with the kubernetes client installed here.
    """
    if not KUBEFLOW_TRAINING.is_dir():
        raise FileNotFoundError(
            f"{KUBEFLOW_TRAINING} is missing: run `make setup` (it installs kubeflow-training 1.9.4 there)"
        )
    sdk = KUBEFLOW_TRAINING.parents[2]
    out = subprocess.run(
        [sys.executable, "-c", _DUMP_MODELS],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(sdk), os.environ.get("PYTHONPATH", "")])},
    )
    if out.returncode != 0:
        raise RuntimeError(f"importing the Kubeflow training SDK from {sdk} failed: {out.stderr[-2000:]}")
    return {name: (types, names) for name, (types, names) in json.loads(out.stdout).items()}


def _type_schema(spec: str) -> dict[str, Any]:
    if spec in PRIMITIVES:
        return PRIMITIVES[spec]
    if m := re.fullmatch(r"list\[(.+)\]", spec):
        return {"type": "array", "items": _type_schema(m.group(1))}
    if m := re.fullmatch(r"dict\(str, (.+)\)", spec):
        return {"type": "object", "additionalProperties": _type_schema(m.group(1))}
    if spec.startswith("KubeflowOrgV1"):
        return model_schema(spec)
    if spec.startswith("V1"):
        return {K8S_REF: spec}
    raise ValueError(f"type {spec!r} of the training SDK's models is not understood")


@cache
def model_schema(name: str) -> dict[str, Any]:
    types, names = training_models()[name]
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": {names[attr]: _type_schema(kind) for attr, kind in types.items()},
    }


def tfjob_schema() -> dict[str, Any]:
    return model_schema("KubeflowOrgV1TFJob")


def _k8s_leaves(schema: dict[str, Any], value: Any, path: str) -> list[tuple[str, str, Any]]:
    """(path, Kubernetes type, value) of every Kubernetes-typed value in ``value``."""
    if K8S_REF in schema:
        return [(path, schema[K8S_REF], value)]
    out = []
    if isinstance(value, dict):
        for key, item in value.items():
            sub = (schema.get("properties") or {}).get(key) or schema.get("additionalProperties")
            if isinstance(sub, dict):
                out += _k8s_leaves(sub, item, f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            out += _k8s_leaves(schema["items"], item, f"{path}[{i}]")
    return out


def validate_tfjob(body: dict[str, Any]) -> None:
    """Raise ``jsonschema.ValidationError`` or ``kubernetes_validate.ValidationError`` when ``body`` is not a TFJob."""
    schema = tfjob_schema()
    permissive = {"$defs": {}, **_without_k8s(schema)}
    jsonschema.validate(body, permissive)
    for _path, kind, value in _k8s_leaves(schema, body, "tfjob"):
        if kind == "V1PodTemplateSpec":
            kubernetes_validate.validate(
                {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": value},
                K8S_VERSION,
                strict=True,
            )
        elif kind == "V1ObjectMeta":
            kubernetes_validate.validate(
                {"apiVersion": "v1", "kind": "ConfigMap", "metadata": value}, K8S_VERSION, strict=True
            )


def _without_k8s(schema: Any) -> Any:
    if isinstance(schema, dict):
        if K8S_REF in schema:
            return {"type": "object"}
        return {k: _without_k8s(v) for k, v in schema.items()}
    return schema


def trainer_schema(model: str) -> dict[str, Any]:
    from kubeflow_trainer_api import models

    schema = getattr(models, model).model_json_schema(by_alias=True)
    if QUANTITY in schema.get("$defs", {}):
        schema["$defs"][QUANTITY] = {"type": ["string", "number"]}
    return schema


def validate_trainer(body: dict[str, Any]) -> None:
    model = {"TrainJob": "TrainerV1alpha1TrainJob", "TrainingRuntime": "TrainerV1alpha1TrainingRuntime"}[
        body["kind"]
    ]
    jsonschema.validate(body, trainer_schema(model))


def validate_k8s(body: dict[str, Any]) -> None:
    kubernetes_validate.validate(body, K8S_VERSION, strict=True)
