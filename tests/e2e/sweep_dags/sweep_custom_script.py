"""
### Sweep a third-party training container (e2e)

The sweep function with any image: the container gets each trial's hyperparameters as
`--name=value` arguments after its own, and reports its objective per step in
`OUTPUT_DIR/metrics.jsonl`.
"""

from __future__ import annotations

from pathlib import Path

import airflow.providers.cncf.kubernetes.operators.pod  # noqa: F401
from airflow.sdk import DAG, Param

from kubetrain import DEFAULT_ARGS, SweepSettings, common_params, sweep_pipeline, with_dialect

SWEEP = SweepSettings(
    tunable=None, objective=("score", "max"), max_parallel_trials=2, rounds=2, hyperparameter_args=True
)

with DAG(
    dag_id=Path(__file__).stem,
    doc_md=__doc__,
    schedule=None,
    catchup=False,
    default_args=DEFAULT_ARGS,
    tags=["kubetrain", "sweep", "e2e"],
    params=with_dialect(
        {
            **common_params(dataset_uri="s3://datasets/digits/", model="script-model", gpus=0),
            "promote": Param(
                "always",
                type="string",
                enum=["always", "if_better", "never"],
                title="Promote",
                description="Promotion rule.",
            ),
            # the test passes python:3.11-slim pinned by the digest the dev stack's mirror serves
            "image": Param(
                "python:3.11-slim", type="string", title="Image", description="Any image, pinned by digest."
            ),
            "command": Param(
                ["python"], type="array", items={"type": "string"}, title="Command", description="Entrypoint."
            ),
            "args": Param(
                [], type="array", items={"type": "string"}, title="Arguments", description="Its arguments."
            ),
            **SWEEP.params(space={"lr": {"low": 0.0001, "high": 0.1, "log": True}}),
        }
    ),
    render_template_as_native_obj=True,
) as dag:
    sweep_pipeline(
        SWEEP,
        title="Script sweep",
        cmds="{{ params.command }}",
        arguments="{{ params.args }}",
    )
