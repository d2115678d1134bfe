# syntax=docker/dockerfile:1
# The trainer image: what the kubernetes engine's TrainJob / PyTorchJob pods run.
#
#   docker build -f docker/trainer.Dockerfile -t registry.example.com/trainforge-trainer:0.1.0 .
#
# Contains torchrun and the `trainer` package with the exact versions of requirements.lock
# (torch, transformers, tokenizers, safetensors, numpy, mlflow, boto3), nothing of Airflow.
# Runs as the non-root user `trainer` (uid/gid 1000), which is the default
# training.kubernetes.run_as_user. The pods get the job config at /etc/trainforge/job.json
# from a ConfigMap; data and checkpoints live in S3 (credentials from Kubernetes Secrets).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/trainer

# torch from PyPI is the CUDA build on linux/amd64 (it brings its own CUDA libraries; the node
# needs only the NVIDIA driver and device plugin). Point TORCH_INDEX_URL at another PyTorch
# index (e.g. https://download.pytorch.org/whl/cpu) for a CPU-only image.
ARG TORCH_INDEX_URL=""

WORKDIR /opt/trainforge
COPY requirements.lock pyproject.toml README.md ./
RUN set -eux; \
    extra=""; if [ -n "$TORCH_INDEX_URL" ]; then extra="--extra-index-url $TORCH_INDEX_URL"; fi; \
    pip install $extra -c requirements.lock \
        torch transformers tokenizers safetensors numpy mlflow boto3 pyyaml

COPY trainer ./trainer
COPY operators ./operators
COPY mlflow_setup ./mlflow_setup
# The package itself without its orchestration dependencies (Airflow is not needed on the cluster).
RUN pip install --no-deps . \
    && python -c "import trainer.train, torch.distributed.run" \
    && groupadd --gid 1000 trainer \
    && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/trainer --shell /usr/sbin/nologin trainer

USER 1000:1000
WORKDIR /home/trainer
# The job's command is set by the manifest: sh -c <launcher> trainforge-launch torchrun ... -m trainer.train --config /etc/trainforge/job.json
CMD ["torchrun", "--help"]
