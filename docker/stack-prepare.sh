#!/bin/bash
# What `make stack-up` does before `compose up`, with Docker and compose only (no Python here):
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

images() {
  need_docker
  local missing=0 image
  for image in $($compose -f docker/compose.yaml --env-file docker/.env config | sed -n 's/^ *image: *//p' | tr -d "\"'" | sort -u); do
    $docker image inspect "$image" >/dev/null 2>&1 && continue
    case "$image" in
      trainforge-*) echo "stack: image $image is not built: make images (docker/README.md)" >&2; missing=1 ;;
      *) $docker pull -q "$image" >/dev/null || { echo "stack: image $image cannot be pulled: without a registry, IMAGES_ARGS=--local-services make images and set POSTGRES_IMAGE, REDIS_IMAGE, S3_IMAGE in docker/.env (README \"Deploy\")" >&2; missing=1; } ;;
    esac
  done
  return "$missing"
}

data() {
  local dest="$1"
  mkdir -p "$dest"
  if [ -x .venv/bin/python ] && [ -f .venv/.installed ]; then
    exec .venv/bin/python -m trainforge.data.corpus fetch --dest "$dest/shakespeare"
  fi
  need_docker
  local image; image="$(env_value AIRFLOW_IMAGE "trainforge-airflow:$(sed -n 's/^version *= *"\(.*\)"/\1/p' pyproject.toml)")"
  $docker image inspect "$image" >/dev/null 2>&1 || { echo "stack: no venv here, and the image $image that would fetch the corpus is not built: make images first" >&2; exit 2; }
  local args=(run --rm --network host -u "$(id -u):$(id -g)" -e HOME=/tmp/home -e XDG_CACHE_HOME=/tmp/cache
              -v "$(cd "$dest" && pwd):/data")
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
  exec $docker "${args[@]}" "$image" python -m trainforge.data.corpus fetch --dest /data/shakespeare
}

case "${1:-}" in
  images) images ;;
  data) [ -n "${2:-}" ] || { echo "usage: $0 data DEST" >&2; exit 2; }; data "$2" ;;
  *) echo "usage: $0 images | data DEST" >&2; exit 2 ;;
esac
