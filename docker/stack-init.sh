#!/bin/bash
# The stack's one-off preparation (compose service airflow-init): Airflow's database migrations
# and the S3 buckets named in TRAINFORGE_BUCKETS (space-separated); both idempotent.
set -euo pipefail
airflow db migrate
python3 - <<'PY'
import os

import boto3
from botocore.exceptions import ClientError

s3 = boto3.client("s3")
for bucket in os.environ.get("TRAINFORGE_BUCKETS", "").split():
    try:
        s3.head_bucket(Bucket=bucket)
        print(f"bucket {bucket}: exists")
    except ClientError:
        s3.create_bucket(Bucket=bucket)
        print(f"bucket {bucket}: created")
PY
