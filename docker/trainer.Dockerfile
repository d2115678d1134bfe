# The trainer image: what the kubernetes engine's TrainJob / PyTorchJob pods run
# (`torchrun -m trainforge.trainer.train`), and any container that trains a trainforge job.
#
#   docker build -f docker/trainer.Dockerfile -t trainforge-trainer:0.1.0 .                  # CUDA torch
#   docker build -f docker/trainer.Dockerfile --build-arg TORCH_VARIANT=cpu -t trainforge-trainer:0.1.0-cpu .
#
# (docker/build.py builds every image with the machine's pip configuration; see docker/README.md.)
# Versions: requirements.lock, with torch ${TORCH_VERSION} as the CUDA build (PyPI's default on
# linux/amd64, its CUDA libraries inside; the node needs only the NVIDIA driver) or the CPU build.
# Nothing of Airflow is inside. Runs as the non-root user `trainer` (uid/gid 1000), the default
# training.kubernetes.run_as_user of the rendered pods' security context.

ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG TORCH_VARIANT=cuda
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml requirements.lock ./
COPY docker/pip-install.sh /usr/local/bin/pip-install
# The dependencies first, in a layer of their own: a change to trainforge's code rebuilds only the
# wheel's layer. The machine's pip configuration and CA bundle arrive as build secrets (never
# stored in a layer).
RUN --mount=type=secret,id=pip.conf --mount=type=secret,id=ca.crt --mount=type=secret,id=pip-constraints.txt \
    --mount=type=cache,target=/root/.cache/pip,id=trainforge-pip \
    set -eu; \
    python3 -m venv /opt/venv; \
    pip-install /opt/venv --upgrade "pip==26.3"; \
    pip-install /opt/venv --torch "$TORCH_VARIANT" "$TORCH_VERSION" "$TORCH_CPU_INDEX" \
        transformers tokenizers safetensors numpy mlflow-skinny boto3 pyyaml psutil pydantic \
        pyarrow zstandard peft torchao
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
    /opt/venv/bin/python -c "import trainforge.trainer.train, torch.distributed.run"

FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title="trainforge-trainer" \
      org.opencontainers.image.source="https://github.com/trainforge/trainforge"
# boto3 sends a checksum only where S3 requires one, so S3-compatible stores without the newer
# flexible checksums work (README "Deploy"); set both to when_supported for botocore's default.
ENV AWS_REQUEST_CHECKSUM_CALCULATION=when_required AWS_RESPONSE_CHECKSUM_VALIDATION=when_required
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/home/trainer
RUN groupadd --gid 1000 trainer \
    && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/trainer --shell /usr/sbin/nologin trainer
# Compilers for torch.compile (framework.compile, docs/trainer.md): Triton builds its CUDA kernel
# launchers with a C compiler and the Python headers at run time, Inductor's CPU kernels need C++.
# Without them `compile: auto` trains eager and `compile: true` is refused (exit 78).
RUN set -eu; \
    headers="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h"; \
    apt-get update; \
    apt-get install -y --no-install-recommends gcc g++ libc6-dev $([ -e "$headers" ] || echo python3-dev); \
    rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/venv /opt/venv
USER 1000:1000
WORKDIR /home/trainer
# The pods give their own command (the launch script around torchrun).
CMD ["torchrun", "--help"]
