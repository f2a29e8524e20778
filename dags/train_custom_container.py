"""
### Train with any container

Runs a training image of your own — a script from a paper, a framework's example, anything
that trains — on the cluster, unmodified. It needs no S3 code: the platform gives it

| variable | directory | what |
|---|---|---|
| `DATA_DIR` | `/data` | the staged dataset (archives extracted) |
| `CHECKPOINT_DIR` | `/checkpoints` | write checkpoints here; they are synced to S3 while it runs and restored on a retry |
| `OUTPUT_DIR` | `/output` | write the model and, if you like, `metrics.json` / `history.csv` for the report |

Set **image**, **command** and **args** in the trigger form; `$(DATA_DIR)` style references
in them are expanded by Kubernetes. Checkpoints survive a killed pod: the retry finds them in
`CHECKPOINT_DIR` again.
"""

from __future__ import annotations

from pathlib import Path

# The DAG processor imports a DAG file's `airflow.*` modules once, before it forks each parse
# ([dag_processor] parsing_pre_import_modules): naming the pod operator's module keeps the
# cncf-kubernetes provider and the Kubernetes clients loaded across parses.
import airflow.providers.cncf.kubernetes.operators.pod  # noqa: F401
from airflow.sdk import DAG, Param

from kubetrain import DEFAULT_ARGS, common_params, form_order, training_pipeline, with_dialect

with DAG(
    dag_id=Path(__file__).stem,
    doc_md=__doc__,
    schedule=None,
    catchup=False,
    default_args=DEFAULT_ARGS,
    tags=["kubetrain", "training", "custom"],
    params=with_dialect(
        form_order(
            {
                **common_params(dataset_uri="s3://datasets/digits/", model="custom-model", gpus=0),
                "promote": Param(
                    "always",
                    type="string",
                    enum=["always", "if_better", "never"],
                    title="Promote",
                    description="Promote the output: always, only if its metrics.json beats the promoted one, or never.",
                    section="Promotion",
                ),
                "image": Param(
                    "tensorflow/tensorflow:2.21.0-gpu",
                    type="string",
                    minLength=1,
                    title="Training image",
                    description="Any image that trains: it reads $DATA_DIR and writes $CHECKPOINT_DIR and $OUTPUT_DIR.",
                    section="Container",
                ),
                "command": Param(
                    ["python"],
                    type="array",
                    items={"type": "string"},
                    minItems=1,
                    title="Command",
                    description="The container's command (entrypoint), one item per line.",
                    section="Container",
                ),
                "args": Param(
                    ["train.py"],
                    type="array",
                    items={"type": "string"},
                    title="Arguments",
                    description="The container's arguments, one item per line.",
                    section="Container",
                ),
                "metrics_required": Param(
                    False,
                    type="boolean",
                    title="Metrics required",
                    description="Fail unless the container writes OUTPUT_DIR/metrics.json; without it the run gets no report.",
                    section="Container",
                ),
            }
        )
    ),
    render_template_as_native_obj=True,
) as dag:
    training_pipeline(
        title="Custom training container",
        cmds="{{ params.command }}",
        arguments="{{ params.args }}",
        require_metrics="{{ params.metrics_required }}",
    )
