"""Create the cold tier's S3 bucket if it does not exist yet (compose `s3-init`, the dev overlay's Job).

Runs once before the ru-pool starts, from the ru-pool image. It reads the same settings as the tiers
(kite_shared.config.TierConfig: KITE_S3_ENDPOINT, KITE_S3_BUCKET, KITE_S3_REGION) and builds its client
the way kite_shared.tiers.cold does; credentials come from boto3's own sources (AWS_* variables,
profile, instance role). The ru-pool also tries to create the bucket, but a failure there only marks the
tier down in a log line; here it fails the deployment step, with the real error.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Mapping

import boto3
from botocore.exceptions import ClientError, EndpointConnectionError

from kite_shared.config import TierConfig, load

_NOT_FOUND = {"404", "NoSuchBucket", "NotFound"}


def ensure_bucket(environ: Mapping[str, str], attempts: int = 30, delay_s: float = 1.0) -> str:
    """'created', 'exists', or 'local' when the cold tier is a folder (empty KITE_S3_ENDPOINT)."""
    cfg = load(TierConfig, environ)
    if not cfg.s3_endpoint:
        return "local"
    s3 = boto3.session.Session().client("s3", endpoint_url=cfg.s3_endpoint, region_name=cfg.s3_region)
    for attempt in range(1, attempts + 1):
        try:
            try:
                s3.head_bucket(Bucket=cfg.s3_bucket)
                return "exists"
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") not in _NOT_FOUND:
                    raise
            if cfg.s3_region != "us-east-1":  # S3 rejects an explicit us-east-1 constraint
                s3.create_bucket(Bucket=cfg.s3_bucket,
                                 CreateBucketConfiguration={"LocationConstraint": cfg.s3_region})
            else:
                s3.create_bucket(Bucket=cfg.s3_bucket)
            return "created"
        except EndpointConnectionError:
            # The object store may still be starting: compose's depends_on and a Job's start order
            # say nothing about it answering yet.
            if attempt == attempts:
                raise
            time.sleep(delay_s)
    raise AssertionError("unreachable")


if __name__ == "__main__":
    outcome = ensure_bucket(os.environ)
    print(f"cold tier bucket: {outcome}", file=sys.stderr)
