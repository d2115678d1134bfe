#!/bin/bash
# The stack's one-off preparation (compose service airflow-init): Airflow's database migrations,
# the fingerprints of the shared keys (trainforge.preflight), and the S3 buckets named in
# TRAINFORGE_BUCKETS (space-separated); all idempotent.
set -euo pipefail
airflow db migrate
# The fingerprints of the keys every Airflow container must share (trainforge.preflight).
python3 -m trainforge.preflight record "${TRAINFORGE_HOME:-/opt/trainforge/home}/preflight/fingerprints.json"
python3 - <<'PY'
import os

import boto3
from botocore.exceptions import ClientError

s3 = boto3.client("s3")
for bucket in os.environ.get("TRAINFORGE_BUCKETS", "").split():
    try:
        s3.head_bucket(Bucket=bucket)
        print(f"bucket {bucket}: exists")
    except ClientError as err:
        code = err.response.get("Error", {}).get("Code", "")
        if code not in ("404", "NoSuchBucket", "NotFound"):
            raise SystemExit(
                f"bucket {bucket}: the S3 store at {os.environ.get('AWS_ENDPOINT_URL', 'AWS')} answered "
                f"{code}: check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in docker/.env") from None
        s3.create_bucket(Bucket=bucket)
        print(f"bucket {bucket}: created")
PY
