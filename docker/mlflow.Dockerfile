# The MLflow image: the tracking server and model registry, started by trainforge's mlflow_setup
# (`python -m trainforge.mlflow_setup serve`) with a PostgreSQL backend store and an S3 artifact
# store, proxied by the server (clients need no S3 credentials for artifacts).
#
#   docker build -f docker/mlflow.Dockerfile -t trainforge-mlflow:0.1.0 .
#
# Configuration by environment (compose passes it from the env file):
#   MLFLOW_BACKEND_STORE_URI       postgresql://USER:PASSWORD@HOST:PORT/DB (kept off the command line)
#   MLFLOW_ARTIFACTS_DESTINATION   s3://BUCKET/PREFIX
#   MLFLOW_S3_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY   the S3 store
# Versions: requirements.lock. Runs as the non-root user `mlflow` (uid/gid 1001).

ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml requirements.lock ./
COPY docker/pip-install.sh /usr/local/bin/pip-install
# The dependencies first, in a layer of their own (a change to trainforge's code rebuilds only the
# wheel's layer); the machine's pip configuration arrives as build secrets.
RUN --mount=type=secret,id=pip.conf --mount=type=secret,id=ca.crt --mount=type=secret,id=pip-constraints.txt \
    --mount=type=cache,target=/root/.cache/pip,id=trainforge-pip \
    set -eu; \
    python3 -m venv /opt/venv; \
    pip-install /opt/venv --upgrade "pip==26.3"; \
    pip-install /opt/venv mlflow psycopg2-binary boto3 psutil
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
    /opt/venv/bin/python -c "import mlflow.server, psycopg2, boto3, trainforge.mlflow_setup"

FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title="trainforge-mlflow" \
      org.opencontainers.image.source="https://github.com/trainforge/trainforge"
# boto3 sends a checksum only where S3 requires one, so S3-compatible stores without the newer
# flexible checksums work (README "Deploy"); set both to when_supported for botocore's default.
ENV AWS_REQUEST_CHECKSUM_CALCULATION=when_required AWS_RESPONSE_CHECKSUM_VALIDATION=when_required
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/mlflow MLFLOW_PORT=5000
RUN groupadd --gid 1001 mlflow \
    && useradd --uid 1001 --gid 1001 --create-home --home-dir /home/mlflow --shell /usr/sbin/nologin mlflow \
    && mkdir -p /var/lib/mlflow && chown 1001:1001 /var/lib/mlflow
COPY --from=build /opt/venv /opt/venv
USER 1001:1001
WORKDIR /var/lib/mlflow
# Healthy: the registry store answers, webhooks included (their secrets must decrypt: a
# restart with another MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY makes this answer 500).
HEALTHCHECK --interval=15s --timeout=10s --start-period=30s --retries=5 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/api/2.0/mlflow/webhooks?max_results=1' % os.environ['MLFLOW_PORT'], timeout=5)"]
CMD ["sh", "-c", "exec python -m trainforge.mlflow_setup serve --home /var/lib/mlflow --host \"${MLFLOW_HOST:-127.0.0.1}\" --port \"$MLFLOW_PORT\""]
