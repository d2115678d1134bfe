#!/usr/bin/env bash
# Build the images' base locally where no registry can be reached: a Debian bookworm root file
# system from debootstrap, with Python 3.11 (Debian's python3), venv and the CA certificates,
# imported as the base the Dockerfiles name (python:3.11-slim-bookworm) and as
# debian:bookworm-slim (the stand-ins of docker/local/).
#
#   sudo docker/base-image.sh            # skips when the base exists
#   sudo docker/base-image.sh --force    # rebuilds it
#
# The mirror is the one apt on this machine is configured with (its deb822 or one-line
# sources); BASE_MIRROR overrides it. Needs root, debootstrap and a running Docker engine.
set -euo pipefail

BASE_TAG="${BASE_TAG:-python:3.11-slim-bookworm}"
DEBIAN_TAG="${DEBIAN_TAG:-debian:bookworm-slim}"
SUITE=bookworm
force=0
[ "${1:-}" = "--force" ] && force=1
docker="${DOCKER:-docker}"

if [ "$force" = 0 ] && "$docker" image inspect "$BASE_TAG" >/dev/null 2>&1 \
    && "$docker" image inspect "$DEBIAN_TAG" >/dev/null 2>&1; then
  echo "base image $BASE_TAG exists (--force rebuilds it)"
  exit 0
fi
[ "$(id -u)" -eq 0 ] || { echo "base-image.sh: debootstrap needs root (run with sudo)" >&2; exit 2; }
command -v debootstrap >/dev/null || { echo "base-image.sh: debootstrap is not installed (apt-get install debootstrap)" >&2; exit 2; }

apt_mirror() {
  # The first Debian archive URI apt knows (not the security archive).
  local uri=""
  if compgen -G "/etc/apt/sources.list.d/*.sources" >/dev/null; then
    uri="$(awk 'tolower($1)=="uris:" {for (i=2;i<=NF;i++) print $i}' /etc/apt/sources.list.d/*.sources \
           | grep -v -- '-security' | head -n 1 || true)"
  fi
  if [ -z "$uri" ] && [ -r /etc/apt/sources.list ]; then
    uri="$(awk '$1=="deb" {for (i=2;i<=NF;i++) if ($i ~ /^(https?|file):/) {print $i; break}}' /etc/apt/sources.list \
           | grep -v -- '-security' | head -n 1 || true)"
  fi
  echo "$uri"
}
mirror="${BASE_MIRROR:-$(apt_mirror)}"
[ -n "$mirror" ] || { echo "base-image.sh: no Debian mirror in apt's sources; set BASE_MIRROR" >&2; exit 2; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "debootstrap $SUITE from $mirror"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
  "$SUITE" "$work/root" "$mirror" >"$work/debootstrap.log" 2>&1 \
  || { tail -n 20 "$work/debootstrap.log" >&2; exit 1; }
# What the official slim images leave out of a minimal system: apt caches and lists.
chroot "$work/root" apt-get clean
rm -rf "$work/root"/var/lib/apt/lists/* "$work/root"/var/cache/apt/*.bin
# apt inside image builds uses the same mirror.
echo "deb $mirror $SUITE main" >"$work/root/etc/apt/sources.list"
ln -sf /usr/bin/python3 "$work/root/usr/local/bin/python"

tar -C "$work/root" -c . | "$docker" import \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["python3"]' \
  - "$BASE_TAG" >/dev/null
"$docker" tag "$BASE_TAG" "$DEBIAN_TAG"
echo "base image $BASE_TAG ($DEBIAN_TAG): $("$docker" image inspect -f '{{.Size}}' "$BASE_TAG") bytes"
