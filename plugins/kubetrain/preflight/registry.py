"""The registry's lines: ``image:trainer`` and ``image:sync`` (each image pullable by the nodes, as a pod of
it shows) and ``registry`` (the registry answers the Airflow workers, where images are built and pushed)."""

from __future__ import annotations

from dataclasses import dataclass

from kubetrain.preflight.check import Check, short_error
from kubetrain.preflight.pods import PULL_FAILURES, PodOutcome
from kubetrain.settings import Deployment

RESTRICTED_FIX = (
    "the preflight's pods pass Pod Security level restricted, as training pods do; check the namespace's "
    "pod-security.kubernetes.io labels and admission webhooks"
)
# `python`, as the training pods run it (pod_spec.STAGE_IN_COMMAND and the trainers' commands)
TRAINER_COMMAND = ("python", "-c", "import trainer; print('trainer package found')")


@dataclass
class RegistryChecks:
    """The deployment's images and the registry they come from.

    :param deployment: the settings (images, registry, pull Secrets, namespace).
    :param registry_conn_id: the registry's connection; the ``registry`` setting when it is not defined.
    """

    deployment: Deployment
    registry_conn_id: str = "kubetrain_registry_default"

    def images(self) -> dict[str, str]:
        """The trainer and sync images the pods run: the settings', else the defaults `make images` pushes."""
        from kubetrain.imagebuild.products import default_images

        d = self.deployment
        defaults = default_images(d.registry, d.image_tag, d.trainer_variant)
        return {"trainer": d.trainer_image or defaults["trainer"], "sync": d.sync_image or defaults["sync"]}

    def image_check(self, name: str, image: str, outcome: PodOutcome) -> Check:
        """The line of ``image:<name>`` from how a pod of ``image`` ended."""
        setting = f"KUBETRAIN_{name.upper()}_IMAGE"
        if outcome.pulled:
            return Check(f"image:{name}", "PASS", f"{image} was pulled and started")
        if outcome.reason == "Forbidden":
            return Check(
                f"image:{name}",
                "FAIL",
                f"a pod of {image} was refused: {outcome.message}",
                RESTRICTED_FIX
                if "PodSecurity" in outcome.message
                else "see the access line: kubectl apply -f deploy/rbac.yaml",
            )
        if outcome.reason in PULL_FAILURES:
            pull = (
                "; for a private registry name its docker-registry Secret in KUBETRAIN_IMAGE_PULL_SECRETS"
                if not self.deployment.image_pull_secrets
                else ""
            )
            return Check(
                f"image:{name}",
                "FAIL",
                f"{image} cannot be pulled: {outcome.reason} {outcome.message}".strip(),
                f"push it (make images, or the build_trainer_image DAG) or set {setting} to an image the "
                f"nodes can pull{pull}",
            )
        return Check(
            f"image:{name}",
            "FAIL",
            f"a pod of {image} did not start: {outcome.reason} {outcome.message}".strip(),
            f"see `kubectl -n {self.deployment.namespace} get events`; the pod needs to be schedulable with the "
            "deployment's node selector and tolerations",
        )

    def check_registry(self) -> Check:
        """The registry of the connection (else of the ``registry`` setting) answers a ping from here."""
        from kubetrain.hooks.registry import RegistryHook
        from kubetrain.imagebuild.oci import RegistryClient, RegistryError

        hook = RegistryHook(self.registry_conn_id)
        try:
            where = f"connection {self.registry_conn_id!r} ({hook.registry})"
            client = hook.get_conn()
        except Exception as exc:  # noqa: BLE001 - not defined: the registry setting
            if type(exc).__name__ != "AirflowNotFoundException":
                return Check(
                    "registry",
                    "FAIL",
                    f"connection {self.registry_conn_id!r}: {short_error(exc)}",
                    "fix the registry connection's host and extras",
                )
            registry = self.deployment.registry
            where = f"KUBETRAIN_REGISTRY {registry}"
            client = RegistryClient(
                registry, insecure=registry.split(":")[0] in ("localhost", "127.0.0.1"), timeout=10
            )
        try:
            with client:
                client.ping()
        except RegistryError as exc:
            return Check(
                "registry",
                "FAIL",
                f"the registry of {where} does not answer the workers: {short_error(exc)}",
                f"define connection {self.registry_conn_id} with the registry's host, port and credentials "
                "as the Airflow workers reach it",
            )
        return Check("registry", "PASS", f"the registry of {where} answers the workers")
