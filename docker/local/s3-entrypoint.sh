#!/bin/sh
# `server DIR --address HOST:PORT` (MinIO's command line) -> moto's S3 server on HOST:PORT
# (s3-server.py: S3_REFUSE_FLEXIBLE_CHECKSUMS=1 makes it answer like a store without them).
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
exec python3 /usr/local/lib/s3-server.py "$host" "$port"
