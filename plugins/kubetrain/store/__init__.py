"""The repositories of kubetrain's documents in S3, one per document type, over :class:`~kubetrain.run_store.RunStore`.

Each knows its document's keys (from :mod:`kubetrain.s3_layout`) and format, and nothing else:

* :mod:`~kubetrain.store.passes`: a run's sync pass manifests (verification, pruning, resume step);
* :mod:`~kubetrain.store.models`: promoted model versions and the ``latest`` pointer;
* :mod:`~kubetrain.store.promotions`: the promotion history of each model;
* :mod:`~kubetrain.store.runs`: run records and their index copies;
* :mod:`~kubetrain.store.markers`: the train-once markers;
* :mod:`~kubetrain.store.manifests`: staged dataset manifests;
* :mod:`~kubetrain.store.reports`: run reports.
"""
