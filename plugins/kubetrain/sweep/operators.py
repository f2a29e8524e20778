"""The operators of a sweep DAG, under the import path the DAGs and the pipeline use.

::

    stage_dataset -> plan -> round_0.suggest -> round_0.train_<p>_at_a_time (mapped trials)
                  -> round_1.suggest -> round_1.train (tpe only) -> ... -> leaderboard -> promote -> record

They live in :mod:`~kubetrain.sweep.plan` (the plan and each round's suggestions),
:mod:`~kubetrain.sweep.trial` (one trial and its record) and :mod:`~kubetrain.sweep.leaderboard`
(the leaderboard and the sweep record); the documents they share are read in
:mod:`~kubetrain.sweep.store`. Every S3 read and write goes through the run store
(:class:`~kubetrain.run_store.RunStore`), at the keys of :mod:`kubetrain.sweep.records`.
"""

from __future__ import annotations

from kubetrain.sweep.leaderboard import RecordSweepOperator, SweepReportOperator
from kubetrain.sweep.plan import TRIAL_EXCLUDE, PlanSweepOperator, SuggestTrialsOperator
from kubetrain.sweep.store import SweepStoreOperator, all_trials, load_rounds, load_trial_records
from kubetrain.sweep.trial import (
    FINAL_PASS_CHECK_SECONDS,
    TrialPodCallbacks,
    TrialPodOperator,
)

__all__ = [
    "FINAL_PASS_CHECK_SECONDS",
    "TRIAL_EXCLUDE",
    "PlanSweepOperator",
    "RecordSweepOperator",
    "SuggestTrialsOperator",
    "SweepReportOperator",
    "SweepStoreOperator",
    "TrialPodCallbacks",
    "TrialPodOperator",
    "all_trials",
    "load_rounds",
    "load_trial_records",
]
