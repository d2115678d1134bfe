#!/bin/sh
# pip inside the images' build stages, with the build machine's pip configuration when the build
# was given it as secrets (docker/build.py): pip.conf, its CA bundle and its constraints file.
# Every install is constrained by the repository's requirements.lock (torch aside: its variant is
# chosen here).
#
#   pip-install VENV ARGS...                                  pip install ARGS
#   pip-install VENV wheel ARGS...                            pip wheel ARGS
#   pip-install VENV --torch VARIANT VERSION CPU_INDEX ARGS... torch (cuda|cpu) and ARGS
set -eu
venv="$1"; shift
[ -f /run/secrets/pip.conf ] && export PIP_CONFIG_FILE=/run/secrets/pip.conf
[ -f /run/secrets/ca.crt ] && export PIP_CERT=/run/secrets/ca.crt
grep -v '^torch==' /src/requirements.lock > /tmp/lock.txt
if [ -f /run/secrets/pip-constraints.txt ]; then cat /run/secrets/pip-constraints.txt >> /tmp/lock.txt; fi
verb=install
if [ "${1:-}" = wheel ]; then verb=wheel; shift; fi
if [ "${1:-}" = --torch ]; then
  variant="$2"; version="$3"; cpu_index="$4"; shift 4
  case "$variant" in
    cuda) set -- "torch==$version" "$@" ;;
    cpu)  set -- "torch==$version+cpu" "$@"
          [ -n "$cpu_index" ] && set -- --extra-index-url "$cpu_index" "$@" ;;
    *) echo "TORCH_VARIANT must be cuda or cpu, not '$variant'" >&2; exit 2 ;;
  esac
fi
exec "$venv/bin/pip" "$verb" --progress-bar off -c /tmp/lock.txt "$@"
