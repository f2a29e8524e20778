"""Preflight: check that a cluster, its S3 store and registry are ready for kubetrain's training pods.

    make preflight            # in the checkout; kubetrain-preflight where the wheel is installed;
                              # or trigger the kubetrain_preflight DAG

Each check prints one line, ``PASS``, ``FAIL``, ``WARN``, ``INFO`` or ``SKIP``, and every FAIL
says how to fix it. The exit status is 1 when any check failed. The settings are the
deployment's (:mod:`kubetrain.settings`); the cluster is the ``kubernetes_default`` connection,
the registry the ``kubetrain_registry_default`` connection (else the ``registry`` setting).

Checks, in order:

* ``api``: the Kubernetes API answers, is at least 1.29 (the checkpoint-sync sidecar is a native
  sidecar, which older servers drop: pods would hang in Init) and the namespace exists;
* ``access``: the worker's account may do everything kubetrain does (access reviews of every verb
  and resource, as deploy/rbac.yaml grants them); the triggerer's account is reviewed from the
  triggerer by the kubetrain_preflight DAG (:class:`kubetrain.triggers.access.AccessReviewTrigger`);
* ``s3-secret``: the S3 Secret has the keys the pods read and the workers may read it (or, with
  workload identity, the service account carries an IAM role: GKE's and Azure's identities give
  tokens that S3's SigV4 cannot use);
* ``image:trainer`` / ``image:sync``: each image is pullable, seen by a short-lived pod that
  runs it (deleted afterwards);
* ``s3-from-pod`` / ``s3-region`` / ``s3-write``: a pod of the sync image, with the pods' credentials, runs
  ``python -m trainer.sync probe``: it lists the datasets bucket, asks S3 each bucket's region (FAIL when it is
  not the one the pods sign for), and writes, reads back through the CRT (stage-in's download path) and
  deletes an object under ``preflight/`` in the training bucket;
* ``gpu-nodes``: nodes that offer the GPU resource, with their taints (WARN when none; INFO when a node says,
  by the annotation ``kubetrain.io/gpu-requests-served-on-cpu``, that it runs GPU requests on CPU, as the dev
  stack's does unless started with ``--strict-gpu``);
* ``gpu-pool``: the Airflow pool ``gpu`` that bounds concurrent GPU pods, read through Airflow's REST API
  (below);
* ``registry``: the registry answers the Airflow workers (where images are built and pushed);
* ``training-apis``: which distributed-training APIs the cluster serves, and whether Kueue does, with the
  versions served.
* ``queue``: the Kueue LocalQueue that ``KUBETRAIN_QUEUE`` names exists in the namespace (INFO when none is
  configured).

The pool is read through Airflow's public REST API, never through the ORM (:mod:`~kubetrain.preflight.airflow_api`
says why). The API is the connection ``airflow_api`` (type http:
``AIRFLOW_CONN_AIRFLOW_API='http://admin:<password>@localhost:8080'``, or ``airflow connections add``): its host
and port are the API server's, its login and password a user's, exchanged for a JWT at ``POST /auth/token``
(the simple auth manager's and FAB's endpoint), or its extra ``{"token": "<JWT>"}`` a token used as is. The CLI's
``--airflow-api-url`` replaces the connection's host; Airflow's ``[api] base_url`` stands in for a host neither
gives, and from the CLI without the connection the API is asked there with no credentials. With neither, the
line is INFO and names ``airflow pools get gpu``; an API that does not answer or refuses is WARN naming the URL
and what to set.

The package, one module per group of checks, composed by :class:`~kubetrain.preflight.suite.Preflight`:

* :mod:`~kubetrain.preflight.check`: the line (:class:`Check`) and how a check that raised becomes one;
* :mod:`~kubetrain.preflight.cluster`: the cluster's lines (``api``, ``access``, ``gpu-nodes``,
  ``training-apis``, ``queue``), the access lists deploy/rbac.yaml grants, and the connection every group shares;
* :mod:`~kubetrain.preflight.s3`: ``s3-secret`` and the lines of the sync image's probe;
* :mod:`~kubetrain.preflight.registry`: ``image:trainer``, ``image:sync`` and ``registry``;
* :mod:`~kubetrain.preflight.airflow_api`: ``gpu-pool`` and the REST client it reads the pool with;
* :mod:`~kubetrain.preflight.pods`: the preflight's pods, run and deleted;
* :mod:`~kubetrain.preflight.suite`: the order of the lines and what a failed line skips;
* :mod:`~kubetrain.preflight.cli`: the command line (``__main__`` runs it).
"""

from kubetrain.preflight.check import Check
from kubetrain.preflight.suite import Preflight, fail_on_failures, run_preflight

__all__ = ["Check", "Preflight", "fail_on_failures", "run_preflight"]
