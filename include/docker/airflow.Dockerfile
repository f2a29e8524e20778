# The Airflow image of docker-compose.yaml and of the Helm values in deploy/helm/: the official
# image plus kubetrain installed from its distribution (the wheel that pyproject.toml builds from
# plugins/, with every optional part: kubetrain[all]), its dependencies pinned as requirements.lock
# pins them (the deployment's constraints), buildah and skopeo for image builds on the worker, and
# trainer/ (the build context of the training images). docker compose mounts dags/ and include/.
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

# kubetrain as a provider distribution: its connection type, report link and plugin come from the
# entry points, so the plugins folder stays empty (tests/test_provider_dist.py installs the same wheel
# the same way into a fresh environment and imports every module of it).
COPY --chown=airflow:root pyproject.toml README.md requirements.lock /tmp/kubetrain/
COPY --chown=airflow:root plugins/ /tmp/kubetrain/plugins/
COPY --chown=airflow:root trainer/kubetrain_contract/ /tmp/kubetrain/trainer/kubetrain_contract/
RUN pip install --no-cache-dir --constraint /tmp/kubetrain/requirements.lock "/tmp/kubetrain[all]" \
 && rm -rf /tmp/kubetrain

COPY --chown=airflow:root include/ /opt/airflow/include/
COPY --chown=airflow:root trainer/ /opt/airflow/trainer/
ENV KUBETRAIN_TRAINER_DIR=/opt/airflow/trainer \
    BUILDAH_ISOLATION=chroot \
    STORAGE_DRIVER=vfs
