#!/bin/sh
# `server DIR --address HOST:PORT` (MinIO's command line) -> moto_server -H HOST -p PORT.
set -eu
address="127.0.0.1:9000"
while [ $# -gt 0 ]; do
  case "$1" in
    --address) address="$2"; shift 2 ;;
    *) shift ;;
  esac
done
host="${address%:*}"; port="${address##*:}"
[ -n "$host" ] || host=0.0.0.0
echo "$port" > /tmp/s3-port
exec moto_server -H "$host" -p "$port"
