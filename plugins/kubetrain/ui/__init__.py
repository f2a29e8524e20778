"""The Training page of the Airflow UI: runs, leaderboards, promotions, comparisons and sweeps.

Served by kubetrain's FastAPI app on the API server (:mod:`kubetrain.ui.app`) and shown in the
Airflow UI as an external view (the plugin's navigation entry "Training"). Nothing here is
imported outside the API server.
"""
