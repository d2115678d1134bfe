#!/bin/bash
# The official postgres image's first-start contract, on Debian's PostgreSQL (stand-in).
set -euo pipefail
if [ "${1:-}" = postgres ] && [ ! -s "$PGDATA/PG_VERSION" ]; then
  : "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD is required (the env file)}"
  user="${POSTGRES_USER:-postgres}"
  pwfile="$(mktemp)"; printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
  initdb -D "$PGDATA" --username="$user" --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256 >/dev/null
  rm -f "$pwfile"
  pg_ctl -D "$PGDATA" -o "-c listen_addresses='' -k /var/run/postgresql" -w start >/dev/null
  db="${POSTGRES_DB:-$user}"
  if [ "$db" != postgres ]; then
    psql -h /var/run/postgresql -U "$user" -d postgres -v ON_ERROR_STOP=1 -q -c "CREATE DATABASE \"$db\""
  fi
  for f in /docker-entrypoint-initdb.d/*; do
    case "$f" in
      *.sql) psql -h /var/run/postgresql -U "$user" -d "$db" -v ON_ERROR_STOP=1 -q -f "$f" ;;
      *.sh) PGHOST=/var/run/postgresql PGUSER="$user" bash "$f" ;;
    esac
  done
  pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
  echo "PostgreSQL initialized in $PGDATA"
fi
exec "$@"
