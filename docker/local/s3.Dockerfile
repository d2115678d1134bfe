# Stand-in for the S3 store's image where no registry can be reached (docker/README.md,
# "Without a registry"): moto's S3 server (the version of requirements.lock), started with the
# MinIO command line the stack gives (`server DIR --address HOST:PORT`). It keeps objects in
# memory and accepts any credentials: a test store, not a place for real data.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE} AS build
WORKDIR /src
COPY requirements.lock ./
COPY docker/pip-install.sh /usr/local/bin/pip-install
RUN --mount=type=secret,id=pip.conf --mount=type=secret,id=ca.crt --mount=type=secret,id=pip-constraints.txt \
    --mount=type=cache,target=/root/.cache/pip,id=trainforge-pip \
    python3 -m venv /opt/venv && pip-install /opt/venv "moto[server]==5.2.5"

FROM ${BASE_IMAGE}
COPY --from=build /opt/venv /opt/venv
COPY docker/local/s3-entrypoint.sh /usr/local/bin/s3-entrypoint
COPY docker/local/s3-server.py /usr/local/lib/s3-server.py
ENV PATH=/opt/venv/bin:$PATH
RUN useradd --uid 1002 --create-home s3
USER 1002
HEALTHCHECK --interval=5s --timeout=5s --retries=20 CMD ["sh", "-c", "python3 -c \"import urllib.request; urllib.request.urlopen('http://127.0.0.1:$(cat /tmp/s3-port)/', timeout=4)\""]
ENTRYPOINT ["s3-entrypoint"]
CMD ["server", "/data", "--address", "127.0.0.1:9000"]
