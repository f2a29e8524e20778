# The Airflow image of docker-compose.yaml and of the Helm values in deploy/helm/: the official
# image plus kubetrain's Airflow-side pins (providers, matplotlib for reports), buildah and skopeo
# for image builds on the worker, and the project itself (plugins/ and trainer/, the build
# context of the images). docker compose mounts dags/, plugins/, include/ and trainer/ over these.
#
#   docker build -f include/docker/airflow.Dockerfile -t <registry>/kubetrain/airflow:<tag> .
FROM apache/airflow:3.3.2-python3.11

USER root
# buildah runs daemonless with VFS storage and chroot isolation (BUILDAH_ISOLATION=chroot)
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends buildah skopeo \
 && rm -rf /var/lib/apt/lists/* \
 && echo "airflow:100000:65536" >> /etc/subuid && echo "airflow:100000:65536" >> /etc/subgid
USER airflow

COPY --chown=airflow:root requirements.txt /tmp/kubetrain-requirements.txt
RUN grep -E '^(apache-airflow-providers-|matplotlib==)' /tmp/kubetrain-requirements.txt > /tmp/pins.txt \
 && pip install --no-cache-dir "apache-airflow==3.3.2" -r /tmp/pins.txt

COPY --chown=airflow:root plugins/ /opt/airflow/plugins/
COPY --chown=airflow:root include/ /opt/airflow/include/
COPY --chown=airflow:root trainer/ /opt/airflow/trainer/
ENV KUBETRAIN_TRAINER_DIR=/opt/airflow/trainer \
    BUILDAH_ISOLATION=chroot \
    STORAGE_DRIVER=vfs
