"""Request bodies in Kubernetes' protobuf encoding (``application/vnd.kubernetes.protobuf``).

kubectl's typed commands (``kubectl create configmap|secret|job|namespace|service``) send their
objects as protobuf, not JSON. A body is the 4-byte magic ``k8s\\0`` and a ``runtime.Unknown``
envelope naming apiVersion and kind around the object's own message. The messages are decoded
with the protobuf library from ``k8s-v1.32.pb``, a FileDescriptorSet compiled from the
``generated.proto`` files of k8s.io/api and k8s.io/apimachinery v0.32.9 (regenerate with
``python -m grpc_tools.protoc -I. --include_imports --descriptor_set_out=k8s-v1.32.pb
k8s.io/api/core/v1/generated.proto k8s.io/api/batch/v1/generated.proto
k8s.io/apimachinery/pkg/runtime/generated.proto`` in a tree holding those files), and turned into
the dict the JSON encoding would give: Quantity, Time, IntOrString and RawExtension take their
JSON forms, bytes become base64, structs that Go embeds inline (``VolumeSource`` in a volume,
``LocalObjectReference`` in a key selector) are lifted into their parent, and fields the Go
structs leave empty are dropped.
"""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime
from functools import cache
from pathlib import Path

from include.devstack.kubeapi.meta import ApiError

MAGIC = b"k8s\x00"
DESCRIPTORS = Path(__file__).with_name("k8s-v1.32.pb")
MEDIA_TYPE = "application/vnd.kubernetes.protobuf"
PACKAGES = {
    "v1": "k8s.io.api.core.v1",
    "batch/v1": "k8s.io.api.batch.v1",
    "meta.k8s.io/v1": "k8s.io.apimachinery.pkg.apis.meta.v1",
    "authorization.k8s.io/v1": "k8s.io.api.authorization.v1",
}
# `kubectl auth can-i` sends a SelfSubjectAccessReview (and with --list a SelfSubjectRulesReview) as protobuf:
# their messages, as k8s.io/api's authorization/v1/generated.proto numbers their fields (the selector fields,
# alpha, left out)
AUTHORIZATION_MESSAGES = {
    "SelfSubjectAccessReview": [
        ("metadata", 1, ".k8s.io.apimachinery.pkg.apis.meta.v1.ObjectMeta"),
        ("spec", 2, ".k8s.io.api.authorization.v1.SelfSubjectAccessReviewSpec"),
        ("status", 3, ".k8s.io.api.authorization.v1.SubjectAccessReviewStatus"),
    ],
    "SelfSubjectAccessReviewSpec": [
        ("resourceAttributes", 1, ".k8s.io.api.authorization.v1.ResourceAttributes"),
        ("nonResourceAttributes", 2, ".k8s.io.api.authorization.v1.NonResourceAttributes"),
    ],
    "ResourceAttributes": [
        (name, i, "string")
        for i, name in enumerate(
            ("namespace", "verb", "group", "version", "resource", "subresource", "name"), start=1
        )
    ],
    "NonResourceAttributes": [("path", 1, "string"), ("verb", 2, "string")],
    # `kubectl auth can-i --list` sends a SelfSubjectRulesReview
    "SelfSubjectRulesReview": [
        ("metadata", 1, ".k8s.io.apimachinery.pkg.apis.meta.v1.ObjectMeta"),
        ("spec", 2, ".k8s.io.api.authorization.v1.SelfSubjectRulesReviewSpec"),
        ("status", 3, ".k8s.io.api.authorization.v1.SubjectRulesReviewStatus"),
    ],
    "SelfSubjectRulesReviewSpec": [("namespace", 1, "string")],
    "SubjectRulesReviewStatus": [
        ("resourceRules", 1, "repeated .k8s.io.api.authorization.v1.ResourceRule"),
        ("nonResourceRules", 2, "repeated .k8s.io.api.authorization.v1.NonResourceRule"),
        ("incomplete", 3, "bool"),
        ("evaluationError", 4, "string"),
    ],
    "ResourceRule": [
        ("verbs", 1, "repeated string"),
        ("apiGroups", 2, "repeated string"),
        ("resources", 3, "repeated string"),
        ("resourceNames", 4, "repeated string"),
    ],
    "NonResourceRule": [("verbs", 1, "repeated string"), ("nonResourceURLs", 2, "repeated string")],
    "SubjectAccessReviewStatus": [
        ("allowed", 1, "bool"),
        ("reason", 2, "string"),
        ("evaluationError", 3, "string"),
        ("denied", 4, "bool"),
    ],
}
META = "k8s.io.apimachinery.pkg.apis.meta.v1."
# Go structs embedded with `json:",inline"`: protobuf nests them in a field, JSON lifts their fields up
# (every such field of k8s.io/api core/v1 and batch/v1 and apimachinery's meta/v1 at v0.32)
INLINE = {
    "localObjectReference",
    "volumeSource",
    "persistentVolumeSource",
    "handler",
    "ephemeralContainerCommon",
}
# non-pointer numbers and booleans that Go always writes in protobuf and its JSON leaves out when zero
# (`json:",omitempty"`); a pointer field's 0 or false is a value of its own and stays
OMIT_ZERO = {
    "generation",
    "nodePort",
    "healthCheckNodePort",
    "publishNotReadyAddresses",
    "hostPort",
    "stdin",
    "stdinOnce",
    "tty",
    "hostNetwork",
    "hostPID",
    "hostIPC",
    "readOnly",
}


@cache
def _pool():
    from google.protobuf import descriptor_pb2, descriptor_pool

    fds = descriptor_pb2.FileDescriptorSet.FromString(DESCRIPTORS.read_bytes())
    pool = descriptor_pool.DescriptorPool()
    for f in fds.file:
        pool.Add(f)
    authorization = descriptor_pb2.FileDescriptorProto(
        name="k8s.io/api/authorization/v1/generated.proto",
        package="k8s.io.api.authorization.v1",
        syntax="proto2",
        dependency=["k8s.io/apimachinery/pkg/apis/meta/v1/generated.proto"],
    )
    scalar = {
        "string": descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
        "bool": descriptor_pb2.FieldDescriptorProto.TYPE_BOOL,
    }
    for message, fields in AUTHORIZATION_MESSAGES.items():
        proto = authorization.message_type.add(name=message)
        for name, number, kind in fields:
            repeated = kind.startswith("repeated ")
            kind = kind.removeprefix("repeated ")
            field = proto.field.add(
                name=name,
                number=number,
                label=descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED
                if repeated
                else descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
            )
            if kind in scalar:
                field.type = scalar[kind]
            else:
                field.type, field.type_name = descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE, kind
    pool.Add(authorization)
    return pool


def _message(full_name: str):
    from google.protobuf import message_factory

    try:
        desc = _pool().FindMessageTypeByName(full_name)
    except KeyError:
        return None
    return message_factory.GetMessageClass(desc)


def _unsupported(what: str) -> ApiError:
    return ApiError(
        415,
        "UnsupportedMediaType",
        f"the local Kubernetes API cannot decode a protobuf body of {what}: send it as application/json",
    )


def decode(raw: bytes) -> dict:
    """The JSON-shaped object of a protobuf request body."""
    if not raw.startswith(MAGIC):
        raise ApiError(
            400, "BadRequest", "the protobuf body does not start with the Kubernetes magic bytes k8s\\0"
        )
    unknown_cls = _message("k8s.io.apimachinery.pkg.runtime.Unknown")
    try:
        envelope = unknown_cls.FromString(raw[len(MAGIC) :])
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise ApiError(400, "BadRequest", f"the protobuf body cannot be decoded: {exc}") from None
    api_version, kind = envelope.typeMeta.apiVersion, envelope.typeMeta.kind
    package = PACKAGES.get(api_version)
    cls = _message(f"{package}.{kind}") if package else None
    if cls is None:
        raise _unsupported(f'kind "{kind}" in "{api_version}"')
    try:
        msg = cls.FromString(envelope.raw)
    except Exception as exc:  # noqa: BLE001
        raise ApiError(400, "BadRequest", f"the protobuf body of {kind} cannot be decoded: {exc}") from None
    out = _to_dict(msg)
    return {"apiVersion": api_version, "kind": kind, **out}


def _time(msg, micro: bool) -> str | None:
    if not msg.seconds and not msg.nanos:
        return None
    dt = datetime.fromtimestamp(msg.seconds + msg.nanos / 1e9, UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")


def _special(msg):
    """JSON forms of the apimachinery types that do not encode as plain objects; ``...`` when none applies."""
    name = msg.DESCRIPTOR.full_name
    if name == "k8s.io.apimachinery.pkg.api.resource.Quantity":
        return msg.string
    if name == META + "Time":
        return _time(msg, micro=False)
    if name == META + "MicroTime":
        return _time(msg, micro=True)
    if name == "k8s.io.apimachinery.pkg.util.intstr.IntOrString":
        return msg.intVal if msg.type == 0 else msg.strVal
    if name in ("k8s.io.apimachinery.pkg.runtime.RawExtension", META + "FieldsV1"):
        data = msg.raw if hasattr(msg, "raw") else msg.Raw
        return json.loads(data) if data else None
    if name == META + "Duration":
        return f"{msg.duration / 1e9:g}s"
    return ...


def _value(fd, value):
    from google.protobuf.descriptor import FieldDescriptor

    if fd.type == FieldDescriptor.TYPE_MESSAGE:
        return _to_dict(value)
    if fd.type == FieldDescriptor.TYPE_BYTES:
        return base64.b64encode(value).decode()
    return value


def _to_dict(msg):
    special = _special(msg)
    if special is not ...:
        return special
    out: dict = {}
    for fd, value in msg.ListFields():
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            value_fd = fd.message_type.fields_by_name["value"]
            converted = {k: _value(value_fd, v) for k, v in value.items()}
        elif fd.is_repeated:
            converted = [_value(fd, v) for v in value]
        else:
            converted = _value(fd, value)
        # Go writes every non-pointer field; its JSON encoding leaves the empty ones out (omitempty)
        if converted in ("", None, [], {}) and not (converted == {} and fd.message_type is not None):
            continue
        if fd.name in OMIT_ZERO and converted in (0, False) and fd.message_type is None:
            continue
        if fd.name in INLINE and isinstance(converted, dict):
            out.update(converted)
            continue
        out[fd.name] = converted
    return out
