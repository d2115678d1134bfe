#!/bin/bash
# Entry point of the Airflow image: `airflow ARGS...` for every role, after two preparations.
#  - The admin password of the simple auth manager comes from AIRFLOW_ADMIN_PASSWORD_FILE (a
#    Docker secret) or AIRFLOW_ADMIN_PASSWORD (the env file); it is written to a file only this
#    user reads and never printed. Deployments with a real auth manager set neither.
#  - `celery worker` gets a name of its own (several workers can share a host's network).
#  - The preflight (trainforge.preflight): the keys every Airflow container shares must match
#    the fingerprints airflow-init recorded, else the role is not started: the container stays
#    up, unhealthy, and says why every minute. Unknown AIRFLOW__SECTION__KEY variables are
#    warned about.
# `healthcheck` (the image's HEALTHCHECK) checks the role this container runs, and that the shared
# keys are still the ones airflow-init recorded last; a scheduler's and a worker's also have the
# API server accept a task token signed with their keys (preflight token).
set -euo pipefail
refused=/tmp/trainforge-refused
fingerprints="${TRAINFORGE_HOME:-/opt/trainforge/home}/preflight/fingerprints.json"

if [ "${1:-}" = healthcheck ]; then
  if [ -s "$refused" ]; then cat "$refused"; exit 1; fi
  # A failing check also says why in the container's log (docker logs), not only in inspect.
  # (The main process's stderr by its pid: the Airflow services share the host's pid namespace.)
  unhealthy() {
    echo "$1"
    main="$(cat /tmp/trainforge-main-pid 2>/dev/null || true)"
    [ -z "$main" ] || echo "$1" >"/proc/$main/fd/2" 2>/dev/null || true
    exit 1
  }
  out="$(python3 -m trainforge.preflight health "$fingerprints" 2>&1)" || unhealthy "$out"
  role="$(cat /tmp/trainforge-role 2>/dev/null || true)"
  case "$role" in
    api-server)
      exec python3 -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/api/v2/monitor/health' % os.environ.get('AIRFLOW__API__PORT', '8080'), timeout=10)" ;;
    scheduler)  # its health server answers, and the API server accepts the tokens it signs
      python3 -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_SERVER_PORT', '8974'), timeout=10)" || exit 1
      out="$(python3 -m trainforge.preflight token 2>&1)" || unhealthy "$out" ;;
    triggerer) exec airflow jobs check --job-type TriggererJob --local ;;
    dag-processor) exec airflow jobs check --job-type DagProcessorJob --local ;;
    "celery worker")  # answers the broker and reaches the Execution API with a token it takes
      celery --app airflow.providers.celery.executors.celery_executor.app inspect ping \
        -d "celery@$(cat /tmp/trainforge-celery-name)" --timeout 10 || exit 1
      out="$(python3 -m trainforge.preflight token 2>&1)" || unhealthy "$out" ;;
    *) exit 0 ;;
  esac
  exit 0
fi

echo $$ > /tmp/trainforge-main-pid  # exec keeps it: the role's process
case "${1:-}" in
  celery) echo "celery ${2:-}" > /tmp/trainforge-role ;;
  *) echo "${1:-}" > /tmp/trainforge-role ;;
esac

password=""
if [ -n "${AIRFLOW_ADMIN_PASSWORD_FILE:-}" ]; then
  password="$(cat "$AIRFLOW_ADMIN_PASSWORD_FILE")"
elif [ -n "${AIRFLOW_ADMIN_PASSWORD:-}" ]; then
  password="$AIRFLOW_ADMIN_PASSWORD"
fi
unset AIRFLOW_ADMIN_PASSWORD
if [ -n "$password" ]; then
  passwords="$AIRFLOW_HOME/simple_auth_manager_passwords.json"
  (umask 077; ADMIN_PASSWORD="$password" python3 -c \
    "import json, os, sys; json.dump({'admin': os.environ['ADMIN_PASSWORD']}, open(sys.argv[1], 'w'))" \
    "$passwords")
  export AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS="${AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS:-admin:admin}"
  export AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE="$passwords"
fi

case "${1:-}" in
  stack-init|bash|sh|python|python3|version) exec "$@" ;;
esac
rm -f "$refused"
status=0
python3 -m trainforge.preflight check "$fingerprints" "$(cat /tmp/trainforge-role)" "$refused" || status=$?
if [ "$status" = 3 ]; then
  trap 'exit 0' TERM INT
  while true; do sleep 60 & wait $!; cat "$refused" >&2; done  # (said once already)
elif [ "$status" != 0 ]; then
  echo "trainforge preflight: could not run (exit $status); starting without it" >&2
fi
if [ "${1:-}" = celery ] && [ "${2:-}" = worker ]; then
  name="worker-$(cat /proc/sys/kernel/random/uuid | cut -c1-8)"
  echo "$name" > /tmp/trainforge-celery-name
  shift 2
  exec airflow celery worker --celery-hostname "$name" "$@"
fi
exec airflow "$@"
