"""TriggererAccessOperator: the preflight's review of the triggerer's access, deferred to the triggerer."""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseOperator, Context


class TriggererAccessOperator(BaseOperator):
    """Defer to :class:`~kubetrain.triggers.access.AccessReviewTrigger` and report its line (FAIL: no retry).

    :param kubernetes_conn_id: the cluster's connection, as the triggerer reads it.
    :param config_file: a kubeconfig the triggerer reads instead.
    """

    template_fields = ("kubernetes_conn_id", "config_file")

    def __init__(
        self, *, kubernetes_conn_id: str = "kubernetes_default", config_file: str | None = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.kubernetes_conn_id = kubernetes_conn_id
        self.config_file = config_file

    def execute(self, context: Context) -> None:
        from kubetrain import settings
        from kubetrain.preflight.cluster import TRIGGERER_ACCESS, access_attributes
        from kubetrain.triggers.access import AccessReviewTrigger

        deployment = settings.Deployment.from_environment()
        attributes = access_attributes(TRIGGERER_ACCESS, deployment.namespace, deployment.s3_secret)
        self.defer(
            trigger=AccessReviewTrigger(
                attributes=attributes,
                kubernetes_conn_id=self.kubernetes_conn_id,
                config_file=self.config_file,
            ),
            method_name="execute_complete",
        )

    def execute_complete(self, context: Context, event: dict[str, Any]) -> str:
        from airflow.sdk.exceptions import AirflowFailException

        from kubetrain import settings
        from kubetrain.preflight.cluster import triggerer_check

        check = triggerer_check(event, settings.get("namespace"))
        print(check.line(), flush=True)
        if check.status == "FAIL":
            raise AirflowFailException(check.line())
        return check.line()
