# The Airflow image: Airflow 3.3.2 with the Celery and PostgreSQL extras and the trainforge wheel
# (operators, hooks, triggers, the plugin, and the trainer for the `local` engine, which trains
# inside the Celery worker). One image serves every Airflow role by its command:
#
#   api-server | scheduler | dag-processor | triggerer | celery worker | db migrate | ...
#
#   docker build -f docker/airflow.Dockerfile -t trainforge-airflow:0.1.0 .
#
# Versions: requirements.lock (the set the test suite runs against), torch as the CPU build by
# default (TORCH_VARIANT=cuda for workers that train on their own GPUs). Runs as the non-root user
# `airflow` (uid 50000, gid 0), like the official Airflow image.

ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG TORCH_VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml requirements.lock ./
COPY docker/pip-install.sh /usr/local/bin/pip-install
# The dependencies first (pyproject.toml's, with the deploy extra: Airflow's Celery and PostgreSQL
# providers, and the postgres extra: the metadata database's drivers), in a layer of their own: a change to trainforge's code rebuilds only the wheel's
# layer. The machine's pip configuration and CA bundle arrive as build secrets (never in a layer).
RUN --mount=type=secret,id=pip.conf --mount=type=secret,id=ca.crt --mount=type=secret,id=pip-constraints.txt \
    --mount=type=cache,target=/root/.cache/pip,id=trainforge-pip \
    set -eu; \
    python3 -m venv /opt/venv; \
    pip-install /opt/venv --upgrade "pip==26.3"; \
    python3 -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
print("\n".join(d for d in p["dependencies"] + p["optional-dependencies"]["deploy"] + p["optional-dependencies"]["postgres"] if not d.startswith("torch")))' \
        > /tmp/requirements.txt; \
    pip-install /opt/venv --torch "$TORCH_VARIANT" "$TORCH_VERSION" "$TORCH_CPU_INDEX" -r /tmp/requirements.txt
COPY README.md ./
COPY operators ./operators
COPY plugins ./plugins
COPY trainer ./trainer
COPY mlflow_setup ./mlflow_setup
RUN --mount=type=secret,id=pip.conf --mount=type=secret,id=ca.crt --mount=type=secret,id=pip-constraints.txt \
    --mount=type=cache,target=/root/.cache/pip,id=trainforge-pip \
    set -eu; \
    pip-install /opt/venv wheel --no-deps --wheel-dir /wheels /src; \
    /opt/venv/bin/pip install --no-deps /wheels/trainforge-*.whl; \
    /opt/venv/bin/pip check; \
    /opt/venv/bin/python -c "import airflow, trainforge.plugins.plugin, trainforge.trainer.train, airflow.providers.celery, airflow.providers.postgres, psycopg2, asyncpg"

FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title="trainforge-airflow" \
      org.opencontainers.image.source="https://github.com/trainforge/trainforge"
# boto3 sends a checksum only where S3 requires one, so S3-compatible stores without the newer
# flexible checksums work (README "Deploy"); set both to when_supported for botocore's default.
ENV AWS_REQUEST_CHECKSUM_CALCULATION=when_required AWS_RESPONSE_CHECKSUM_VALIDATION=when_required
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/airflow \
    AIRFLOW_HOME=/opt/airflow \
    AIRFLOW__CORE__DAGS_FOLDER=/opt/airflow/dags \
    AIRFLOW__CORE__LOAD_EXAMPLES=False \
    AIRFLOW__LOGGING__COLORED_CONSOLE_LOG=False \
    TRAINFORGE_HOME=/opt/trainforge/home \
    TRAINFORGE_PIPELINES=/opt/trainforge/specs
# procps: ps/kill for operators; the `local` engine's process-group signals need nothing more.
RUN apt-get update \
    && apt-get install -y --no-install-recommends procps \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 50000 --gid 0 --create-home --home-dir /home/airflow --shell /bin/bash airflow \
    && mkdir -p /opt/airflow/dags /opt/airflow/logs /opt/airflow/plugins \
                /opt/trainforge/home /opt/trainforge/specs /opt/trainforge/data \
    && chown -R 50000:0 /opt/airflow /opt/trainforge \
    && chmod -R g+rwX /opt/airflow /opt/trainforge
COPY --from=build /opt/venv /opt/venv
COPY --chown=50000:0 dags/trainforge_pipelines.py /opt/airflow/dags/
COPY docker/airflow-entrypoint.sh /usr/local/bin/airflow-entrypoint
COPY docker/stack-init.sh /usr/local/bin/stack-init
USER 50000:0
WORKDIR /opt/airflow
HEALTHCHECK --interval=30s --timeout=30s --start-period=60s --retries=5 CMD ["airflow-entrypoint", "healthcheck"]
ENTRYPOINT ["airflow-entrypoint"]
CMD ["version"]
