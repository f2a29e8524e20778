"""Multi-worker training on an engine the cluster already has: a Kubeflow TFJob, a Kubeflow Trainer
TrainJob, or a plain Indexed Job per role behind a headless Service.

* :mod:`.cluster`: the TF_CONFIG rule (the same as the pod side's ``trainer.common.cluster``) and
  each engine's host names;
* :mod:`.spec`: the replicas, their roles and resources, checked;
* :mod:`.builders`: the objects each backend submits, built from typed models;
* :mod:`.backends`: which backends the cluster serves (API discovery).
"""
