"""The preflight as one run: :class:`Preflight` composes the groups of checks, runs them in order and skips
what a failed line makes pointless; :func:`run_preflight` and :func:`fail_on_failures` serve the CLI and the
DAG."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from kubetrain.preflight.airflow_api import AIRFLOW_API_CONN_ID, AirflowChecks
from kubetrain.preflight.check import Check, guarded, short_error
from kubetrain.preflight.cluster import Cluster, ClusterChecks
from kubetrain.preflight.pods import PodRunner
from kubetrain.preflight.registry import TRAINER_COMMAND, RegistryChecks
from kubetrain.preflight.s3 import S3_CHECKS, S3Checks
from kubetrain.settings import Deployment


@dataclass
class Preflight:
    """The checks against one deployment.

    :param deployment: the settings (namespace, Secret, images, ...).
    :param kubernetes_conn_id: the cluster's connection.
    :param registry_conn_id: the registry's connection; the ``registry`` setting when it is not defined.
    :param pool: the Airflow pool of GPU training tasks.
    :param pod_timeout: seconds a preflight pod may take to pull and run.
    :param airflow_api_conn_id: the connection to Airflow's REST API (where the pool is read).
    :param airflow_api_url: the API server's URL, over the connection's host (the CLI's ``--airflow-api-url``).
    :param airflow_api_default_url: the URL when neither gives one (the CLI: Airflow's ``[api] base_url``).
    """

    deployment: Deployment
    kubernetes_conn_id: str = "kubernetes_default"
    registry_conn_id: str = "kubetrain_registry_default"
    pool: str = "gpu"
    pod_timeout: float = 45.0
    airflow_api_conn_id: str = AIRFLOW_API_CONN_ID
    airflow_api_url: str | None = None
    airflow_api_default_url: str | None = None
    results: list[Check] = field(default_factory=list)

    # -- the groups, sharing one connection to the cluster ---------------------------------

    @cached_property
    def cluster(self) -> Cluster:
        return Cluster(self.deployment, self.kubernetes_conn_id)

    @cached_property
    def cluster_checks(self) -> ClusterChecks:
        return ClusterChecks(self.cluster)

    @cached_property
    def s3_checks(self) -> S3Checks:
        return S3Checks(self.cluster)

    @cached_property
    def registry_checks(self) -> RegistryChecks:
        return RegistryChecks(self.deployment, self.registry_conn_id)

    @cached_property
    def airflow_checks(self) -> AirflowChecks:
        return AirflowChecks(
            self.pool, self.airflow_api_conn_id, self.airflow_api_url, self.airflow_api_default_url
        )

    @cached_property
    def pods(self) -> PodRunner:
        return PodRunner(self.cluster, self.pod_timeout)

    # -- running ---------------------------------------------------------------------------

    def run(self, emit: Callable[[Check], None] | None = None) -> list[Check]:
        """Run every check; ``emit`` receives each line as it is decided."""

        def add(check: Check) -> None:
            self.results.append(check)
            if emit:
                emit(check)

        cluster = self.cluster_checks
        api = cluster.check_api()
        add(api)
        cluster_ok = api.status == "PASS"
        if cluster_ok:
            add(guarded("access", cluster.check_access))
            add(guarded("s3-secret", self.s3_checks.check_s3_secret))
            try:
                pod_checks = self.check_pods()
            except Exception as exc:  # noqa: BLE001 - one line, never a traceback
                pod_checks = [
                    Check(
                        "image:trainer",
                        "FAIL",
                        f"could not be checked: {short_error(exc)}",
                        "check the cluster's API server",
                    )
                ]
            for check in pod_checks:
                add(check)
        else:
            for name in ("access", "s3-secret", "image:trainer", "image:sync", *S3_CHECKS):
                add(Check(name, "SKIP", "needs the API and the namespace (see api)"))
        reachable = cluster_ok or api.detail.startswith("API ")
        add(cluster.check_gpu_nodes() if reachable else Check("gpu-nodes", "SKIP", "needs the API (see api)"))
        add(self.airflow_checks.check_pool())
        add(self.registry_checks.check_registry())
        add(
            cluster.check_training_apis()
            if reachable
            else Check("training-apis", "SKIP", "needs the API (see api)")
        )
        add(
            guarded("queue", cluster.check_queue)
            if reachable
            else Check("queue", "SKIP", "needs the API (see api)")
        )
        return self.results

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.results if c.status == "FAIL"]

    def check_pods(self) -> list[Check]:
        """Pull each image in a pod of its own, in parallel: the ``image:*`` lines; the sync image's pod also
        runs the S3 probe, whose report gives the S3 lines."""
        images = self.registry_checks.images()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            trainer = pool.submit(
                self.pods.run_pod, "trainer", images["trainer"], TRAINER_COMMAND, with_s3=False
            )
            sync = pool.submit(
                self.pods.run_pod, "sync", images["sync"], self.s3_checks.probe_command(), with_s3=True
            )
            outcomes = {"trainer": trainer.result(), "sync": sync.result()}
        checks = [
            self.registry_checks.image_check(name, images[name], outcomes[name])
            for name in ("trainer", "sync")
        ]
        checks.extend(self.s3_checks.probe_checks(images["sync"], outcomes["sync"]))
        return checks


def run_preflight(emit: Callable[[Check], None] | None = None, **kwargs: Any) -> Preflight:
    """Run the preflight against the deployment's settings; ``kwargs`` go to :class:`Preflight`."""
    preflight = Preflight(Deployment.from_environment(), **kwargs)
    preflight.run(emit)
    return preflight


def fail_on_failures(preflight: Preflight) -> list[str]:
    """The lines of a finished preflight; raises ``AirflowFailException`` (no retry) naming each FAIL."""
    from airflow.sdk.exceptions import AirflowFailException

    if preflight.failed:
        raise AirflowFailException(
            f"{len(preflight.failed)} preflight check(s) failed:\n"
            + "\n".join(c.line() for c in preflight.failed)
        )
    return [c.line() for c in preflight.results]
