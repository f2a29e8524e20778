"""
### Sweep the image classifier's hyperparameters

Trains the image classifier of `train_image_classifier` many times, one **trial** per point of
a search space, and promotes the best model.

**Search** (section *Sweep* of the form): `space` names hyperparameters of the training Params
(each a list of values, `{"choices": [...]}` or a range `{"low", "high", "log", "step", "type"}`;
the other training Params are the fixed values of every trial); `algorithm` `grid` (every
point), `random` (`max_trials` points drawn with `seed`) or `tpe` (Optuna's Bayesian search, in
rounds of `parallel_trials` trials, each round learning from the trials before it);
`objective` (default: the trainer's `val_accuracy`, max). A space that cannot be searched (an
unknown hyperparameter, an empty list, `low` > `high`, a grid larger than `max_trials`) is
refused before any pod starts, naming the field.

**Trials** run as mapped training pods in the `gpu` pool, `parallel_trials` at a time (this
DAG's bound is 4), each in `runs/<dag>/<run>/trials/<n>/` with its own checkpoints, so a killed
trial resumes. A trial waits for its pod in its worker slot rather than deferring (a few
seconds saved per trial). A trial trained before with the same data, Params and image is not
trained again: its result is reused.

**Median early stopping** (`early_stopping` `{"rule": "median", "min_trials": 3, "start_step": 4}`,
Katib's medianstop): once `min_trials` trials have finished, a running trial that has reported
at least `start_step` epochs is stopped when its best objective so far is worse than the median
of the finished trials' running averages of the objective over as many epochs. Its sidecar
decides and tells the trainer to stop; the trainer keeps its best epoch's model and the trial
counts as a success, marked *stopped early*.

**ASHA and Hyperband** (`{"rule": "asha", "min_resource": 1, "reduction_factor": 3, "grace": 1,
"max_resource": <epochs>}`, or `"hyperband"` with `brackets`): at rungs of `min_resource *
reduction_factor**k` epochs, only the top `1/reduction_factor` of the trials that have reached the
rung so far go on; hyperband splits the trials into brackets whose first rungs are later.

**Results**: the leaderboard (`leaderboard` task's "Training report" link: trials ranked by the
objective, a parallel-coordinates plot), each trial's own report, the best trial's model
promoted if it beats the promoted one, and the sweep record `runs/<dag>/<run>/sweep/sweep.json`.
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
from kubetrain import IMAGE_CLASSIFIER as TRAINER

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
    tags=["kubetrain", "sweep", "image-classification"],
    params=with_dialect(
        form_order(
            {
                **common_params(dataset_uri=DATASET, model=TRAINER.model),
                **TRAINING,
                **SWEEP.params(
                    space={
                        "learning_rate": {"low": 0.0003, "high": 0.01, "log": True},
                        "batch_size": [32, 64, 128],
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
