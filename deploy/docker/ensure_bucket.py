"""Create the ru-pool's cold-tier bucket if it does not exist yet (compose `s3-init`, the dev Job).

Runs once before the ru-pool starts, from the ru-pool image (it already carries boto3). Credentials and
region come from boto3's own variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION), so
the same script works against MinIO and against AWS S3. A production bucket is normally created by
whoever owns the storage account; there this script is not run.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Mapping

import boto3
from botocore.exceptions import ClientError, EndpointConnectionError


def ensure_bucket(environ: Mapping[str, str], attempts: int = 30, delay_s: float = 1.0) -> str:
    # Read directly (not through kite_shared.config): this is a deploy tool, and the ru-pool service
    # reads the same variables through the registry.
    bucket = environ.get("KITE_S3_BUCKET", "")
    if not bucket:
        raise SystemExit("KITE_S3_BUCKET is empty: nothing to create")
    endpoint = environ.get("KITE_S3_ENDPOINT") or None  # empty means AWS's own endpoint
    s3 = boto3.client("s3", endpoint_url=endpoint)
    for attempt in range(1, attempts + 1):
        try:
            try:
                s3.head_bucket(Bucket=bucket)
                return "exists"
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket", "NotFound"):
                    raise
            region = s3.meta.region_name
            if region and region != "us-east-1":  # S3 rejects an explicit us-east-1 constraint
                s3.create_bucket(Bucket=bucket,
                                 CreateBucketConfiguration={"LocationConstraint": region})
            else:
                s3.create_bucket(Bucket=bucket)
            return "created"
        except EndpointConnectionError:
            # The object store may still be starting; depends_on only orders container starts.
            if attempt == attempts:
                raise
            time.sleep(delay_s)
    raise AssertionError("unreachable")


if __name__ == "__main__":
    outcome = ensure_bucket(os.environ)
    print(f"bucket {os.environ['KITE_S3_BUCKET']}: {outcome}", file=sys.stderr)
