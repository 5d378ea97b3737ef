"""Where a checkpoint lives: a local path, a `gs://` or an `s3://` URL.

Every public entry point passes its path arguments through `parse` (or
`check_path`) first. A `scheme://` other than `gs`, `s3` and `file` is
refused with `UnsupportedURLError`: taken for a local path, `s3://bucket/ck`
became the local folder `s3:/bucket/ck` and a user who believed the
checkpoint was in the bucket lost it with the machine.

Buckets are reached through TensorStore's own `gcs` and `s3` key-value stores,
so credentials and endpoints are found the way TensorStore (and the clouds'
SDKs) find them:

- `gs://`: Application Default Credentials (`GOOGLE_APPLICATION_CREDENTIALS`,
  `gcloud auth application-default login`, the metadata server);
  `TENSORSTORE_GCS_HTTP_URL` points at another endpoint (an emulator).
- `s3://`: `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` /
  `AWS_SESSION_TOKEN`, `AWS_PROFILE` and `~/.aws/credentials`, instance
  metadata; `AWS_REGION` / `AWS_DEFAULT_REGION`; `AWS_ENDPOINT_URL` for
  S3-compatible stores (MinIO, moto, ...).

Failures of bucket requests are turned into typed errors by `translate`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from shardckpt.errors import (
    BucketNotFoundError,
    CheckpointNotFoundError,
    StorageAccessDeniedError,
    StorageCredentialsError,
    UnsupportedURLError,
)

REMOTE_SCHEMES = ("gs", "s3")
"""URL schemes of object stores shardckpt reads and writes."""
SUPPORTED_SCHEMES = ("gs", "s3", "file")
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://(.*)$", re.DOTALL)
_DRIVERS = {"gs": "gcs", "s3": "s3"}


@dataclasses.dataclass(frozen=True)
class Location:
    """A classified path argument.

    Attributes:
        scheme: "local", "gs" or "s3".
        path: For "local": the absolute local path. For buckets: the key
            prefix inside the bucket, without leading or trailing "/".
        bucket: The bucket name (None for local paths).
    """

    scheme: str
    path: str
    bucket: str | None = None

    @property
    def is_remote(self) -> bool:
        return self.scheme in REMOTE_SCHEMES

    @property
    def url(self) -> str:
        """The path as the user would write it (`gs://b/k` or `/abs/path`)."""
        if not self.is_remote:
            return self.path
        return f"{self.scheme}://{self.bucket}/{self.path}".rstrip("/")

    @property
    def name(self) -> str:
        """The last path component."""
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> Location:
        if not self.is_remote:
            return dataclasses.replace(self, path=os.path.dirname(self.path))
        head = self.path.rsplit("/", 1)[0] if "/" in self.path else ""
        return dataclasses.replace(self, path=head)

    def join(self, *names: str) -> Location:
        if not self.is_remote:
            return dataclasses.replace(self, path=os.path.join(self.path, *names))
        parts = [p for p in (self.path, *names) if p]
        return dataclasses.replace(self, path="/".join(p.strip("/") for p in parts))

    def kvstore(self, *, directory: bool = True) -> dict[str, Any]:
        """TensorStore's kvstore spec of this location (a "directory" ends in "/")."""
        if not self.is_remote:
            return {"driver": "file", "path": self.path + ("/" if directory else "")}
        path = self.path + ("/" if directory and self.path else "")
        if self.scheme == "gs":
            _check_gcs_key_file(self)
        spec: dict[str, Any] = {"driver": _DRIVERS[self.scheme], "bucket": self.bucket, "path": path}
        if self.scheme == "s3":
            spec.update(_s3_settings())
        return spec

    def __str__(self) -> str:
        return self.url


def _check_gcs_key_file(location: Location) -> None:
    """Refuses a GOOGLE_APPLICATION_CREDENTIALS that names no file, as Google's SDKs do.

    TensorStore instead goes on to the next source (the metadata server, then
    no credentials), so the user's key would be silently ignored and a private
    bucket would answer "denied" for an unrelated reason.
    """
    key_file = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if key_file and not os.environ.get("GOOGLE_AUTH_TOKEN_FOR_TESTING") and not os.path.isfile(key_file):
        raise StorageCredentialsError(
            f"GOOGLE_APPLICATION_CREDENTIALS={key_file!r} names no file, so there are no GCS "
            f"credentials for {location.url!r}. Fix: point it at a service-account key file, or "
            "unset it and run `gcloud auth application-default login` (on Google Cloud machines "
            "the attached service account is used)."
        )


def _s3_settings() -> dict[str, str]:
    # The AWS SDKs' variables. TensorStore's s3 driver finds credentials in
    # the environment itself, but an endpoint only in its spec: without it,
    # requests go to AWS even when AWS_ENDPOINT_URL names a local server.
    settings = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        settings["endpoint"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        settings["aws_region"] = region
    return settings


def parse(path: str | os.PathLike, *, what: str = "path") -> Location:
    """Classifies a path argument: local, `gs://`, `s3://`, or refused.

    Args:
        path: A local path, `file://` URL, or `gs://bucket/...` / `s3://bucket/...`.
        what: The argument's name, for error messages ("dst", "directory").

    Returns:
        A `Location`; local paths are made absolute.

    Raises:
        UnsupportedURLError: any other `scheme://`, or a bucket URL without a
            bucket name.
    """
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    match = _URL.match(text)
    if match is None:
        return Location("local", os.path.abspath(text))
    scheme, rest = match.group(1).lower(), match.group(2)
    if scheme == "file":
        return Location("local", os.path.abspath("/" + rest.lstrip("/")))
    if scheme not in REMOTE_SCHEMES:
        raise UnsupportedURLError(
            f"{what}={text!r} is a {scheme}:// URL, which shardckpt does not read or write; "
            f"it is not taken for a local folder. Fix: use a local path, a file:// URL, or a "
            f"gs://bucket/... or s3://bucket/... URL. Supported schemes: "
            f"{', '.join(s + '://' for s in SUPPORTED_SCHEMES)}. Received: {what}={text!r}"
        )
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise UnsupportedURLError(
            f"{what}={text!r} names no bucket. Fix: write {scheme}://BUCKET/path. "
            f"Received: {what}={text!r}"
        )
    key = "/".join(p for p in key.split("/") if p and p != ".")
    return Location(scheme, key, bucket)


def check_path(path: str | os.PathLike, *, what: str = "path") -> str:
    """Returns `path` as a string after refusing unsupported `scheme://` URLs.

    For entry points that hand the path on (`from_preset`): a local path or a
    `gs://` / `s3://` URL comes back unchanged (local ones absolute).

    Raises:
        UnsupportedURLError: see `parse`.
    """
    return parse(path, what=what).url


def refuse_remote(location: Location, *, what: str, reason: str) -> None:
    """Raises `UnsupportedURLError` where a bucket URL is not supported (yet).

    Args:
        location: The classified path.
        what: The argument ("src", "directory").
        reason: What is not supported, and the way around it.
    """
    if location.is_remote:
        raise UnsupportedURLError(f"{what}={location.url!r}: {reason} Received: {what}={location.url!r}")


def translate(error: BaseException, location: Location, *, action: str = "reading") -> BaseException:
    """Maps a failed bucket request to a typed shardckpt error naming the URL and the fix.

    TensorStore reports HTTP failures as `ValueError` with an absl status
    text ("NOT_FOUND: ... HTTP response code: 404 ..."); the codes and
    statuses below are the ones its `gcs` and `s3` drivers report.

    Returns:
        The typed error (to `raise ... from error`), or `error` itself when
        it is no storage failure.
    """
    text = str(error)
    url = location.url
    cloud = "GCS" if location.scheme == "gs" else "S3"
    if re.search(r"NoSuchBucket|[Bb]ucket.{0,40}(does not exist|not found)|The specified bucket", text):
        return BucketNotFoundError(
            f"The bucket {location.bucket!r} of {url!r} does not exist ({action}). Fix: create it "
            f"or correct the bucket name. {cloud} said: {_short(text)}"
        )
    refused = re.search(
        r"InvalidAccessKeyId|SignatureDoesNotMatch|ExpiredToken|InvalidToken|TokenRefreshRequired|"
        r"response code: 401|UNAUTHENTICATED|[Ii]nvalid_grant",
        text,
    )
    if refused and has_credentials(location):
        # Credentials were found and sent but are not valid: S3 says so with a
        # 403 and one of these codes, GCS with a 401; a role would not help.
        return StorageCredentialsError(
            f"The {cloud} credentials in use were refused for {url!r} while {action} "
            f"({refused.group(0)}). Fix: check or renew them ({_credential_hint(location)}). "
            f"{cloud} said: {_short(text)}"
        )
    denied = re.search(r"response code: 403|PERMISSION_DENIED|AccessDenied|Forbidden", text)
    if denied and not has_credentials(location):
        # The request went out unsigned: the fix is credentials, not a role.
        return StorageCredentialsError(
            f"Access to {url!r} was denied (HTTP 403) while {action}, and no {cloud} credentials "
            f"were found in the environment or the SDK's files. Fix: {_credential_hint(location)}. "
            f"{cloud} said: {_short(text)}"
        )
    if denied:
        return StorageAccessDeniedError(
            f"Access to {url!r} was denied (HTTP 403) while {action}. Fix: grant the "
            f"credentials in use {_permission(location, action)}, or use other credentials "
            f"({_credential_hint(location)}). {cloud} said: {_short(text)}"
        )
    if re.search(
        r"response code: 401|UNAUTHENTICATED|[Cc]redentials|No credentials|metadata server|"
        r"InvalidAccessKeyId|SignatureDoesNotMatch|ExpiredToken",
        text,
    ):
        return StorageCredentialsError(
            f"No valid credentials for {url!r} ({action}). Fix: {_credential_hint(location)}. "
            f"{cloud} said: {_short(text)}"
        )
    if action == "writing" and re.search(r"response code: 404|NOT_FOUND", text):
        # An object write never 404s on its key: the bucket itself is missing.
        return BucketNotFoundError(
            f"The bucket {location.bucket!r} of {url!r} does not exist ({action}). Fix: create it "
            f"or correct the bucket name. {cloud} said: {_short(text)}"
        )
    if re.search(r"response code: 404|NOT_FOUND|NoSuchKey", text):
        return CheckpointNotFoundError(
            f"Nothing at {url!r} (HTTP 404, {action}). Fix: check the URL; list it with "
            f"{'gcloud storage ls' if location.scheme == 'gs' else 'aws s3 ls'} {url}/. "
            f"{cloud} said: {_short(text)}"
        )
    return error


def not_found(location: Location) -> BaseException:
    """The error for "nothing at `location`": a missing bucket, or a missing path in it.

    TensorStore's `gcs` driver lists a missing bucket, and a bucket it may
    not list (HTTP 403), as empty. So when a listing finds nothing, one
    object read asks again (a refusal raises its typed error here), then
    the bucket is probed (see `bucket_missing`).
    """
    if location.is_remote:
        read_bytes(location if location.path else location.join(".shardckpt-probe"))
    if location.is_remote and bucket_missing(location):
        return BucketNotFoundError(
            f"The bucket {location.bucket!r} of {location.url!r} does not exist. Fix: create it "
            "or correct the bucket name."
        )
    return CheckpointNotFoundError(
        f"No checkpoint at {location.url!r}. Fix: check the path (a .weights.h5, .keras, "
        ".safetensors, *.safetensors.index.json file or an Orbax folder)."
    )


def bucket_missing(location: Location) -> bool:
    """True only when the store answers that `location`'s bucket does not exist.

    An unauthenticated request is enough: both clouds answer 404 for a bucket
    that does not exist and 401/403 for one that exists but is private. Only
    used on error paths; any other outcome (no network, 401, 403) is False.
    """
    import urllib.error
    import urllib.request

    if location.scheme == "gs":
        base = os.environ.get("TENSORSTORE_GCS_HTTP_URL", "https://storage.googleapis.com").rstrip("/")
        url = f"{base}/storage/v1/b/{location.bucket}/o?maxResults=1"
    elif location.scheme == "s3":
        endpoint = _s3_settings().get("endpoint")
        url = f"{endpoint.rstrip('/')}/{location.bucket}" if endpoint else f"https://{location.bucket}.s3.amazonaws.com/"
    else:
        return False
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="GET"), timeout=10):
            return False
    except urllib.error.HTTPError as e:
        return e.code == 404
    except (OSError, ValueError):
        return False


PLACEHOLDER_DIR = "/shardckpt-bucket-placeholder"
"""The local folder Orbax builds a bucket's specs for (never touched: see `ocdbt_kvstore`)."""


def ocdbt_kvstore(kvstore: dict[str, Any], tree: Location) -> dict[str, Any]:
    """Points an OCDBT kvstore spec built by Orbax for a local folder at `tree`.

    Orbax builds its TensorStore specs (`type_handlers.get_json_tspec_read` /
    `_write`) for local paths and `gs://` only; shardckpt builds them for a
    placeholder folder and swaps in the bucket here, so codecs, chunking and
    OCDBT settings stay Orbax's own for every store.
    """
    if not tree.is_remote:
        return kvstore
    spec = dict(kvstore)
    spec["base"] = tree.kvstore()
    spec.pop("manifest", None)  # the local spec's manifest override is a file path
    return spec


def has_credentials(location: Location) -> bool:
    """Whether the SDKs' usual places hold credentials for `location`'s cloud.

    Environment variables and the SDKs' files only: credentials of a machine's
    metadata server (an instance role, an attached service account) cannot be
    seen without asking it, so on such machines an error may say "none found"
    although the request was signed; its message names both cases.
    """
    env = os.environ
    home = os.path.expanduser("~")
    if location.scheme == "gs":
        config = env.get("CLOUDSDK_CONFIG") or os.path.join(home, ".config", "gcloud")
        return bool(
            env.get("GOOGLE_APPLICATION_CREDENTIALS") or env.get("GOOGLE_AUTH_TOKEN_FOR_TESTING")
        ) or os.path.isfile(os.path.join(config, "application_default_credentials.json"))
    if location.scheme == "s3":
        names = (
            "AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE",
            "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        )
        files = (
            env.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.join(home, ".aws", "credentials"),
            env.get("AWS_CONFIG_FILE") or os.path.join(home, ".aws", "config"),
        )
        return any(env.get(n) for n in names) or any(os.path.isfile(f) for f in files)
    return True


def _short(text: str) -> str:
    return " ".join(text.split())[:300]


def _permission(location: Location, action: str) -> str:
    writing = action.startswith(("writing", "deleting"))
    if location.scheme == "gs":
        return "roles/storage.objectAdmin on the bucket" if writing else "roles/storage.objectViewer on the bucket"
    return "s3:PutObject, s3:DeleteObject and s3:ListBucket" if writing else "s3:GetObject and s3:ListBucket"


def _credential_hint(location: Location) -> str:
    if location.scheme == "gs":
        return (
            "run `gcloud auth application-default login`, or set GOOGLE_APPLICATION_CREDENTIALS "
            "to a service-account key file; on Google Cloud machines the attached service "
            "account is used (check its access scopes)"
        )
    return (
        "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), or AWS_PROFILE "
        "with ~/.aws/credentials; on AWS machines the instance role is used (check that one is "
        "attached)"
    )


# ---- reading and writing objects --------------------------------------------
# Local paths go to `os`; bucket paths to TensorStore's kvstore of the bucket
# (the same driver that reads the arrays), so one set of credentials and
# endpoint settings serves both.


def _open_kvstore(location: Location) -> Any:
    import tensorstore as ts

    try:
        return ts.KvStore.open(location.kvstore()).result()
    except ValueError as e:
        raise translate(e, location, action="opening") from e


def open_store(location: Location) -> Any:
    """TensorStore's kvstore of the folder `location` (its keys are the names under it)."""
    return _open_kvstore(location)


def list_keys(location: Location) -> list[str]:
    """Every object key under `location` (a "folder"), relative to it, sorted.

    Local folders are walked; a missing local folder lists as empty.
    """
    if not location.is_remote:
        keys = []
        for root, _, files in os.walk(location.path):
            rel = os.path.relpath(root, location.path)
            keys += [name if rel == "." else f"{rel}/{name}" for name in files]
        return sorted(keys)
    store = _open_kvstore(location)
    try:
        return sorted(k.decode() for k in store.list().result())
    except ValueError as e:
        raise translate(e, location, action="listing") from e


def listdir(location: Location) -> list[str]:
    """Names directly under `location`: files and "folders" (key prefixes)."""
    if not location.is_remote:
        return os.listdir(location.path)
    return sorted({key.split("/", 1)[0] for key in list_keys(location)})


def isdir(location: Location) -> bool:
    """True for a local folder, or a bucket prefix holding at least one object."""
    if not location.is_remote:
        return os.path.isdir(location.path)
    return bool(list_keys(location))


def read_bytes(location: Location) -> bytes | None:
    """The bytes of one file or object, or None if it does not exist."""
    if not location.is_remote:
        try:
            with open(location.path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
    store = _open_kvstore(location.parent)
    try:
        result = store.read(location.name.encode()).result()
    except ValueError as e:
        raise translate(e, location, action="reading") from e
    return None if result.state == "missing" else bytes(result.value)


def exists(location: Location) -> bool:
    """True if `location` is an existing file, folder, object or non-empty prefix."""
    if not location.is_remote:
        return os.path.exists(location.path)
    return read_bytes(location) is not None or isdir(location)


def write_bytes(location: Location, data: bytes) -> None:
    """Writes one file or object (an object write is atomic: all or nothing)."""
    if not location.is_remote:
        with open(location.path, "wb") as f:
            f.write(data)
        return
    store = _open_kvstore(location.parent)
    try:
        store.write(location.name.encode(), data).result()
    except ValueError as e:
        raise translate(e, location, action="writing") from e


def delete_tree(location: Location) -> None:
    """Deletes every object under a bucket prefix (local folders: `shutil.rmtree`)."""
    if not location.is_remote:
        import shutil

        shutil.rmtree(location.path, ignore_errors=True)
        return
    import tensorstore as ts

    store = _open_kvstore(location)
    try:
        store.delete_range(ts.KvStore.KeyRange()).result()
    except ValueError as e:
        raise translate(e, location, action="deleting") from e


def delete_object(location: Location) -> None:
    """Deletes one file or object; a missing one is no error."""
    if not location.is_remote:
        try:
            os.remove(location.path)
        except FileNotFoundError:
            pass
        return
    import tensorstore as ts

    store = _open_kvstore(location.parent)
    key = location.name.encode()
    try:
        # The range of exactly this key (KvStore has no single-key delete).
        store.delete_range(ts.KvStore.KeyRange(key, key + b"\0")).result()
    except ValueError as e:
        raise translate(e, location, action="deleting") from e


_SIZE_WINDOW = 64 * 1024
"""Objects up to this size are read whole to size them; larger ones are probed (see `du`)."""


def du(location: Location) -> int:
    """Total bytes of every file or object under `location` (a folder or prefix).

    Local folders: the files' sizes. Buckets: TensorStore lists keys without
    sizes and reports no object size on reads, so each object is sized by
    1-byte range reads (a read past the end is refused with OUT_OF_RANGE):
    doubling from 64 KiB until past the end, then bisecting down to a 64 KiB
    window whose tail is read. An object costs about 2*log2(size/64 KiB)
    one-byte requests and at most 64 KiB of download; every object's probes
    run concurrently, round by round.
    """
    if not location.is_remote:
        total = 0
        for root, _, files in os.walk(location.path):
            total += sum(os.path.getsize(os.path.join(root, name)) for name in files)
        return total
    store = _open_kvstore(location)
    keys = [key.encode() for key in list_keys(location)]

    def probe(key: bytes, offset: int) -> Any:
        return store.read(key, byte_range=slice(offset, offset + 1))

    def answer(future: Any) -> bool:
        """True if the probed byte exists."""
        try:
            future.result()
        except ValueError as e:
            if str(e).startswith("OUT_OF_RANGE"):
                return False
            raise translate(e, location, action="reading") from e
        return True

    # [known, beyond]: the size is at least `known` and at most `beyond`
    # (None: no byte past the end found yet).
    bounds: dict[bytes, list[Any]] = {key: [0, None] for key in keys}

    def next_probe(known: int, beyond: int | None) -> int | None:
        if beyond is None:
            return max(_SIZE_WINDOW, 2 * known)
        return (known + beyond) // 2 if beyond - known > _SIZE_WINDOW else None

    while True:
        probes = {key: offset for key in keys if (offset := next_probe(*bounds[key])) is not None}
        if not probes:
            break
        futures = {key: probe(key, offset) for key, offset in probes.items()}
        for key, future in futures.items():
            if answer(future):
                bounds[key][0] = probes[key] + 1
            else:
                bounds[key][1] = probes[key]
    # The tail from `known` on: at most one window of bytes per object.
    tails = {key: store.read(key, byte_range=slice(known, None)) for key, (known, _) in bounds.items()}
    total = 0
    for key, future in tails.items():
        try:
            result = future.result()
        except ValueError as e:
            if not str(e).startswith("OUT_OF_RANGE"):
                raise translate(e, location, action="reading") from e
            total += bounds[key][0]  # nothing from `known` on: that is the size
            continue
        total += bounds[key][0] + len(result.value)
    return total
