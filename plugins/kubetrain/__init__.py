"""kubetrain's Airflow side: operators, hooks, pod-spec building, S3 run layout and reports.

Importing this package is cheap (no boto3, TensorFlow or network): DAG files import from
it at parse time.
"""
