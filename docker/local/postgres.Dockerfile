# Stand-in for the official postgres image where no registry can be reached (docker/README.md,
# "Without a registry"): Debian's PostgreSQL 15 with the official image's interface — POSTGRES_USER,
# POSTGRES_PASSWORD, POSTGRES_DB, PGDATA, /docker-entrypoint-initdb.d/*.sql|*.sh on first start,
# and `postgres -c ...` as the command.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends postgresql-15 \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /var/lib/postgresql/data /var/run/postgresql /docker-entrypoint-initdb.d \
    && chown -R postgres:postgres /var/lib/postgresql /var/run/postgresql
ENV PATH=/usr/lib/postgresql/15/bin:$PATH PGDATA=/var/lib/postgresql/data
COPY docker/local/postgres-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
USER postgres
STOPSIGNAL SIGINT
HEALTHCHECK --interval=5s --timeout=5s --retries=20 CMD ["sh", "-c", "pg_isready -q -h 127.0.0.1 -p \"${PGPORT:-5432}\" -U \"${POSTGRES_USER:-postgres}\""]
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["postgres"]
