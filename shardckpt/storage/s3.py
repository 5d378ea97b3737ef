"""`s3://`: Amazon S3 and S3-compatible stores through TensorStore's `s3` driver.

Credentials are found the way the AWS SDKs find them: `AWS_ACCESS_KEY_ID` /
`AWS_SECRET_ACCESS_KEY` / `AWS_SESSION_TOKEN`, `AWS_PROFILE` and
`~/.aws/credentials`, instance metadata; `AWS_REGION` / `AWS_DEFAULT_REGION`;
`AWS_ENDPOINT_URL` (or `AWS_ENDPOINT_URL_S3`) for S3-compatible stores
(MinIO, moto, ...).
"""

from __future__ import annotations

import os
from typing import Any

from shardckpt.storage.location import Location
from shardckpt.storage.objectstore import ObjectStore

_FILE_SOURCES = (
    "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
)


class S3(ObjectStore):
    """S3 buckets (`s3://bucket/key`)."""

    scheme = "s3"
    driver = "s3"
    cloud = "S3"
    ls_command = "aws s3 ls"
    credential_hint = (
        "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), or AWS_PROFILE "
        "with ~/.aws/credentials; on AWS machines the instance role is used (check that one is "
        "attached)"
    )
    read_permission = "s3:GetObject and s3:ListBucket"
    write_permission = "s3:PutObject, s3:DeleteObject and s3:ListBucket"
    version_label = "ETag"

    def version_text(self, generation: bytes) -> str:
        # TensorStore's s3 generation: a flag byte, then the ETag as S3 sent it (quoted).
        return generation[1:].decode("ascii", "replace") or repr(generation)

    def settings(self, location: Location) -> dict[str, Any]:
        # TensorStore's s3 driver finds credentials in the environment itself,
        # but an endpoint only in its spec: without it, requests go to AWS even
        # when AWS_ENDPOINT_URL names a local server.
        settings = {}
        endpoint = _endpoint()
        if endpoint:
            settings["endpoint"] = endpoint
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region:
            settings["aws_region"] = region
        return settings

    def context(self) -> dict[str, Any]:
        # Keys in the environment come first in the AWS SDKs' default chain;
        # naming that source skips the chain's profile-file step, whose
        # aws-c-auth logs 5 `E` lines about a missing ~/.aws/config on every
        # run without one (the same credentials are used either way).
        if os.environ.get("AWS_ACCESS_KEY_ID") and not any(os.environ.get(n) for n in _FILE_SOURCES):
            return {"aws_credentials": {"type": "environment"}}
        return {}

    def endpoint(self) -> str:
        return _endpoint() or "https://s3.amazonaws.com (the AWS default)"

    def endpoint_hint(self) -> str:
        return "AWS_ENDPOINT_URL names an S3-compatible server; unset, requests go to AWS"

    def bucket_url(self, location: Location) -> str:
        endpoint = _endpoint()
        return f"{endpoint.rstrip('/')}/{location.bucket}" if endpoint else f"https://{location.bucket}.s3.amazonaws.com/"

    def has_credentials(self) -> bool:
        env = os.environ
        home = os.path.expanduser("~")
        files = (
            env.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.join(home, ".aws", "credentials"),
            env.get("AWS_CONFIG_FILE") or os.path.join(home, ".aws", "config"),
        )
        return any(env.get(n) for n in ("AWS_ACCESS_KEY_ID", *_FILE_SOURCES)) or any(os.path.isfile(f) for f in files)



def _endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
