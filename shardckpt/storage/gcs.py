"""`gs://`: Google Cloud Storage through TensorStore's `gcs` driver.

Credentials are found the way Google's SDKs find them: Application Default
Credentials (`GOOGLE_APPLICATION_CREDENTIALS`, `gcloud auth
application-default login`, the metadata server). `TENSORSTORE_GCS_HTTP_URL`
points at another endpoint (an emulator).
"""

from __future__ import annotations

import os
from typing import Any

from shardckpt.errors import StorageCredentialsError
from shardckpt.storage.location import Location
from shardckpt.storage.objectstore import ObjectStore

DEFAULT_ENDPOINT = "https://storage.googleapis.com"
CREDENTIALS = (
    "run `gcloud auth application-default login`, or set GOOGLE_APPLICATION_CREDENTIALS "
    "to a service-account key file; on Google Cloud machines the attached service "
    "account is used (check its access scopes)"
)
"""Where GCS credentials come from, for the fix of every credentials error."""


class Gcs(ObjectStore):
    """Google Cloud Storage buckets (`gs://bucket/key`)."""

    scheme = "gs"
    driver = "gcs"
    cloud = "GCS"
    ls_command = "gcloud storage ls"
    credential_hint = CREDENTIALS
    read_permission = "roles/storage.objectViewer on the bucket"
    write_permission = "roles/storage.objectAdmin on the bucket"
    version_label = "generation"

    def version_text(self, generation: bytes) -> str:
        # TensorStore's gcs generation: a flag byte, then the object generation (uint64, little-endian).
        if len(generation) == 9:
            return str(int.from_bytes(generation[1:], "little"))
        return repr(generation)

    def settings(self, location: Location) -> dict[str, Any]:
        _check_key_file(location)
        return {}

    def endpoint(self) -> str:
        return os.environ.get("TENSORSTORE_GCS_HTTP_URL", DEFAULT_ENDPOINT).rstrip("/")

    def endpoint_hint(self) -> str:
        return "TENSORSTORE_GCS_HTTP_URL, when set, names another endpoint"

    def bucket_url(self, location: Location) -> str:
        return f"{self.endpoint()}/storage/v1/b/{location.bucket}/o?maxResults=1"

    def has_credentials(self) -> bool:
        env = os.environ
        config = env.get("CLOUDSDK_CONFIG") or os.path.join(os.path.expanduser("~"), ".config", "gcloud")
        return bool(
            env.get("GOOGLE_APPLICATION_CREDENTIALS") or env.get("GOOGLE_AUTH_TOKEN_FOR_TESTING")
        ) or os.path.isfile(os.path.join(config, "application_default_credentials.json"))



def _check_key_file(location: Location) -> None:
    """Refuses a GOOGLE_APPLICATION_CREDENTIALS that names no file, as Google's SDKs do.

    TensorStore instead goes on to the next source (the metadata server, then
    no credentials), so the user's key would be silently ignored and a private
    bucket would answer "denied" for an unrelated reason.
    """
    key_file = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if key_file and not os.environ.get("GOOGLE_AUTH_TOKEN_FOR_TESTING") and not os.path.isfile(key_file):
        raise StorageCredentialsError(
            f"GOOGLE_APPLICATION_CREDENTIALS={key_file!r} names no file, so there are no GCS "
            f"credentials for {location.url!r}. Fix: point it at a service-account key file that "
            f"exists, or unset it; GCS credentials: {CREDENTIALS}."
        )
