#!/bin/bash
# What `make stack-up` does before `compose up`, with Docker and compose only (no Python here):
#   stack-prepare.sh env             docker/.env is there and complete, its values well-formed
#   stack-prepare.sh images          every image docker/compose.yaml names is built or pulled
#   stack-prepare.sh data DEST       the demo corpus in DEST/shakespeare (the stack's data folder)
# The corpus is fetched with the checkout's venv when there is one, else in a container of the
# Airflow image (trainforge is installed there) on the host's network, as this user, with this
# machine's pip configuration read-only: its files, the PIP_* variables and the local paths they
# name (CA bundle, constraints, find-links, file:// indexes), so pip there sees what pip here sees.
set -euo pipefail
cd "$(dirname "$0")/.."
docker="${DOCKER:-docker}"
compose="${COMPOSE:-docker compose}"

env_value() {  # NAME DEFAULT: the environment's, else docker/.env's, else DEFAULT
  local value="${!1:-}"
  [ -n "$value" ] || value="$(sed -n "s/^$1=//p" docker/.env 2>/dev/null | tail -1)"
  echo "${value:-$2}"
}

need_docker() {
  command -v "${docker%% *}" >/dev/null || { echo "stack: $docker is not installed (Docker is needed)" >&2; exit 2; }
  $docker info >/dev/null 2>&1 || { echo "stack: the Docker engine does not answer ($docker info failed): start dockerd, or run as a user in the docker group" >&2; exit 2; }
}

check_env() {  # every problem of docker/.env, one line each with its line number; never a value
  [ -f docker/.env ] || { echo "docker/.env is missing: cp docker/.env.example docker/.env and set its values" >&2; exit 2; }
  awk -F= '/^[A-Za-z_][A-Za-z0-9_]*=/ { v = substr($0, length($1) + 2); gsub(/^["\047]|["\047]$/, "", v)
      where = sprintf("docker/.env:%d: %s", NR, $1)
      if (v ~ /^CHANGE-/) { print where " is still the placeholder of .env.example"; bad = 1 }
      else if (v == "") { print where " is empty"; bad = 1 }
      else if ($1 == "POSTGRES_PASSWORD" && v !~ /^[A-Za-z0-9._~-]+$/) {
        print where " holds characters a connection URL cannot carry as they are (expected letters, digits and - _ . ~; e.g. openssl rand -hex 32)"; bad = 1 }
      else if ($1 ~ /^(AIRFLOW_FERNET_KEY|MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY)$/ && (length(v) != 44 || v !~ /^[A-Za-z0-9_-]+=$/)) {
        print where " is not a Fernet key (expected 32 url-safe base64-encoded bytes: 44 characters ending in =; openssl rand -base64 32 | tr \047+/\047 \047-_\047)"; bad = 1 } }
      END { if (bad) { print "docker/.env: set the values named above (values are never printed)"; exit 2 } }' docker/.env >&2
  local missing key
  missing="$(comm -23 <(grep -o '${[A-Z0-9_]*:?' docker/compose.yaml | tr -d '${:?' | sort -u) \
    <(sed -n 's/^\([A-Za-z_][A-Za-z0-9_]*\)=.*/\1/p' docker/.env | sort -u))"
  for key in $missing; do
    echo "docker/.env: $key is missing; compose requires it (docker/.env.example says what it is)" >&2
  done
  [ -z "$missing" ] || exit 2
}

images() {  # the images compose would start, by the variable that names each
  need_docker
  local missing=0 var image default why
  for var in AIRFLOW_IMAGE MLFLOW_IMAGE POSTGRES_IMAGE REDIS_IMAGE S3_IMAGE; do
    default="$(sed -n "s/.*\${$var:-\([^}]*\)}.*/\1/p" docker/compose.yaml | head -n1)"
    image="$(env_value "$var" "$default")"
    [ -n "$image" ] || continue
    $docker image inspect "$image" >/dev/null 2>&1 && continue
    case "$image" in
      trainforge-local/*)
        echo "stack: image $image ($var) is not built: IMAGES_ARGS=--local-services make images" >&2; missing=1 ;;
      trainforge-*)
        echo "stack: image $image ($var) is not built: make images builds the tags of this checkout's version ($(sed -n 's/^version *= *"\(.*\)"/\1/p' pyproject.toml)); set $var in docker/.env to one, or build it" >&2; missing=1 ;;
      *)
        why="$($docker pull -q "$image" 2>&1 >/dev/null)" && continue
        echo "stack: image $image ($var) cannot be pulled: ${why##*: }" >&2
        case "$var" in POSTGRES_IMAGE|REDIS_IMAGE|S3_IMAGE)
          echo "  without a registry: IMAGES_ARGS=--local-services make images, and $var=trainforge-local/$(echo "${var%_IMAGE}" | tr 'A-Z' 'a-z'):<version> in docker/.env (README \"Deploy\")" >&2 ;;
        esac
        missing=1 ;;
    esac
  done
  return "$missing"
}

data() {
  local dest="$1"
  mkdir -p "$dest"
  if [ -x .venv/bin/python ] && [ -f .venv/.installed ]; then
    .venv/bin/python -m trainforge.data.corpus fetch --dest "$dest/shakespeare" || fetch_failed "$dest"
    return 0
  fi
  need_docker
  local image; image="$(env_value AIRFLOW_IMAGE "trainforge-airflow:$(sed -n 's/^version *= *"\(.*\)"/\1/p' pyproject.toml)")"
  $docker image inspect "$image" >/dev/null 2>&1 || { echo "stack: no venv here, and the image $image that would fetch the corpus is not built: make images first" >&2; exit 2; }
  local abs; abs="$(cd "$dest" && pwd)"  # mounted at its own path: messages name the host's
  local args=(run --rm --network host -u "$(id -u):$(id -g)" -e HOME=/tmp/home -e XDG_CACHE_HOME=/tmp/cache
              -v "$abs:$abs")
  local files=() file user_home="${HOME:-/nonexistent}"
  for file in /etc/pip.conf /etc/xdg/pip/pip.conf "$user_home/.config/pip/pip.conf" "$user_home/.pip/pip.conf"; do
    [ -f "$file" ] || continue
    files+=("$file")
    case "$file" in
      "$user_home"/*) args+=(-v "$file:/tmp/home/${file#"$user_home"/}:ro") ;;
      *) args+=(-v "$file:$file:ro") ;;
    esac
  done
  if [ -n "${PIP_CONFIG_FILE:-}" ] && [ -f "$PIP_CONFIG_FILE" ]; then
    files+=("$PIP_CONFIG_FILE"); args+=(-v "$PIP_CONFIG_FILE:$PIP_CONFIG_FILE:ro")
  fi
  local name
  for name in $(compgen -e | grep '^PIP_' || true); do args+=(-e "$name"); done
  local path
  for path in $( (cat "${files[@]}" /dev/null; compgen -e | grep '^PIP_' | while read -r name; do echo "${!name}"; done) \
                 | grep -oE '(file://)?/[^[:space:]"'"'"',;]+' | sed 's|^file://||' | sort -u); do
    case "$path" in /|/etc|/usr|/tmp|/opt|/home|/root|/var) continue ;; esac
    [ -e "$path" ] && args+=(-v "$path:$path:ro")
  done
  echo "stack: no venv here: fetching the corpus in a container of $image" >&2
  $docker "${args[@]}" "$image" python -m trainforge.data.corpus fetch --dest "$abs/shakespeare" \
    || fetch_failed "$dest"
}

fetch_failed() {
  echo "stack: the demo corpus could not be fetched into $1/shakespeare (TRAINFORGE_DATA, docker/.env): see above; or set TRAINFORGE_DATA to another folder" >&2
  exit 1
}

case "${1:-}" in
  env) check_env ;;
  images) images ;;
  data) [ -n "${2:-}" ] || { echo "usage: $0 data DEST" >&2; exit 2; }; data "$2" ;;
  *) echo "usage: $0 env | images | data DEST" >&2; exit 2 ;;
esac
