# The Airflow image of docker-compose.yaml: the official image plus kubetrain's
# Airflow-side pins (providers, matplotlib for reports).
FROM apache/airflow:3.3.2-python3.11
COPY --chown=airflow:root requirements.txt /tmp/kubetrain-requirements.txt
RUN grep -E '^(apache-airflow-providers-|matplotlib==)' /tmp/kubetrain-requirements.txt > /tmp/pins.txt \
 && pip install --no-cache-dir "apache-airflow==3.3.2" -r /tmp/pins.txt
