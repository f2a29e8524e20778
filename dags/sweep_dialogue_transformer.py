"""
### Sweep the dialogue Transformer's hyperparameters

Trains the dialogue Transformer of `train_dialogue_transformer` once per point of a search
space (`space`: hyperparameters of the training Params, each a list, `{"choices": [...]}` or a
range `{"low", "high", "log", "step", "type"}`), by `grid`, `random` (with `seed`) or `tpe`
(Optuna, in rounds of `parallel_trials`), ranks the trials by `objective` (default the
trainer's `val_accuracy`, max) and promotes the best model if it beats the promoted one.

Trials are mapped training pods in the `gpu` pool, at most `parallel_trials` at a time (this
DAG's bound is 4), each with its own checkpoints, waiting for its pod in its worker slot; a
trial trained before with the same data, Params and image is reused, not trained again. An
invalid space is refused before any pod starts.

**Median early stopping** (`early_stopping.rule` `median`, Katib's medianstop): once
`min_trials` trials have finished, a trial that has reported `start_step` epochs is stopped when
its best objective so far is worse than the median of the finished trials' running averages over
as many epochs; it keeps its best epoch's model and counts as a success, marked *stopped early*.
`asha` (`min_resource`, `reduction_factor`, `grace`, `max_resource`) and `hyperband` (with
`brackets`) stop by rank instead: at each rung only the top `1/reduction_factor` go on.

The `leaderboard` task links the sweep's report; the record is `runs/<dag>/<run>/sweep/sweep.json`.
"""

from __future__ import annotations

from pathlib import Path

# The DAG processor imports a DAG file's `airflow.*` modules once, before it forks each parse
# ([dag_processor] parsing_pre_import_modules): naming the pod operator's module keeps the
# cncf-kubernetes provider and the Kubernetes clients loaded across parses.
import airflow.providers.cncf.kubernetes.operators.pod  # noqa: F401
from airflow.sdk import DAG

from kubetrain import (
    DEFAULT_ARGS,
    SweepSettings,
    common_params,
    form_order,
    sweep_pipeline,
    tunable_schemas,
    with_dialect,
)
from kubetrain import DIALOGUE_TRANSFORMER as TRAINER

DATASET = TRAINER.dataset_uri
TRAINING = TRAINER.params()
SWEEP = SweepSettings(
    tunable=tunable_schemas(TRAINING, TRAINER.tunable),
    objective=TRAINER.objective,
    max_parallel_trials=4,
    rounds=4,
)

with DAG(
    dag_id=Path(__file__).stem,
    doc_md=__doc__,
    schedule=None,
    catchup=False,
    default_args=DEFAULT_ARGS,
    tags=["kubetrain", "sweep", "nlp", "transformer"],
    params=with_dialect(
        form_order(
            {
                **common_params(dataset_uri=DATASET, model=TRAINER.model),
                **TRAINING,
                **SWEEP.params(
                    space={
                        "hidden_size": [64, 128],
                        "num_layers": {"low": 1, "high": 3, "type": "int"},
                        "dropout": [0.1, 0.2],
                    }
                ),
            }
        )
    ),
    render_template_as_native_obj=True,
) as dag:
    sweep_pipeline(
        SWEEP,
        title=f"{TRAINER.title} sweep",
        cmds=TRAINER.cmds,
        arguments=TRAINER.arguments,
        check_params=TRAINER.check_run,
    )
