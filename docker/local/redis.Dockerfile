# Stand-in for the official redis image where no registry can be reached (docker/README.md,
# "Without a registry"): Debian's redis-server; the command is redis-server's, as there.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /data && chown redis:redis /data
USER redis
WORKDIR /data
HEALTHCHECK --interval=5s --timeout=5s --retries=20 CMD ["sh", "-c", "redis-cli -h 127.0.0.1 -p \"${REDIS_PORT:-6379}\" ping | grep -q PONG"]
CMD ["redis-server"]
