"""Object stores reached through TensorStore's kvstore drivers: the shared part of gcs and s3.

Buckets are read and written through TensorStore's own `gcs` and `s3`
key-value stores (the drivers that also read and write Orbax's arrays), so
one set of credentials, endpoints and deadlines serves objects and arrays.
A backend module (`gcs.py`, `s3.py`) subclasses `ObjectStore` with what
differs per cloud: the driver's spec settings, where credentials come from,
the hints of its error messages and the URL that tells a missing bucket.

Failures of bucket requests are turned into typed errors by `translate`.
"""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from typing import Any

import tensorstore as ts

from shardckpt.errors import (
    BucketNotFoundError,
    CheckpointNotFoundError,
    ObjectChangedError,
    StorageAccessDeniedError,
    StorageCredentialsError,
    StorageTimeoutError,
)
from shardckpt.storage import deadlines, sizing
from shardckpt.storage.bytesource import Sizer
from shardckpt.storage.location import Location
from shardckpt.storage.ranged import RemoteObject


class ObjectStore:
    """A bucket store behind a TensorStore kvstore driver (see `shardckpt.storage.Backend`).

    Attributes:
        scheme: The URL scheme ("gs").
        driver: TensorStore's kvstore driver ("gcs").
        cloud: The store's name in messages ("GCS").
        ls_command: The command that lists a URL, for hints.
    """

    scheme = ""
    driver = ""
    cloud = ""
    ls_command = ""
    credential_hint = ""
    """How to provide credentials, for messages."""
    read_permission = ""
    """What reading needs, for messages."""
    write_permission = ""
    """What writing and deleting need, for messages."""
    version_label = "version"
    """What the store calls an object's version, for messages ("generation", "ETag")."""
    mappable = False
    renames = False  # no atomic rename: a step is committed by its marker object, written last

    # ---- what each cloud says ------------------------------------------------

    def settings(self, location: Location) -> dict[str, Any]:
        """Driver settings of the kvstore spec beyond bucket and path (endpoint, region)."""
        return {}

    def context(self) -> dict[str, Any]:
        """Context resources beyond the deadline's retries (credentials)."""
        return {}

    def version_text(self, generation: bytes) -> str:
        """An object version as the store shows it, from TensorStore's storage generation."""
        return repr(generation)

    def endpoint(self) -> str:
        """The endpoint requests go to, for messages."""
        raise NotImplementedError

    def bucket_url(self, location: Location) -> str:
        """An anonymous GET of this URL answers 404 exactly when the bucket does not exist."""
        raise NotImplementedError

    def has_credentials(self) -> bool:
        """Whether the SDKs' usual places (environment, files) hold credentials."""
        raise NotImplementedError

    def permission(self, action: str) -> str:
        """The permission `action` ("reading", "writing", ...) needs."""
        return self.write_permission if action.startswith(("writing", "deleting")) else self.read_permission

    # ---- the Backend protocol ------------------------------------------------

    def kvstore(self, location: Location, *, directory: bool = True) -> dict[str, Any]:
        """TensorStore's kvstore spec of `location` (a "directory" ends in "/"), deadlines included."""
        deadlines.configure_transport()
        path = location.path + ("/" if directory and location.path else "")
        spec: dict[str, Any] = {"driver": self.driver, "bucket": location.bucket, "path": path}
        spec.update(self.settings(location))
        spec["context"] = {**deadlines.current().context(self.driver), **self.context()}
        return spec

    def open(self, location: Location) -> ts.KvStore:
        """TensorStore's kvstore of the folder `location` (its keys are the names under it)."""
        return self.wait(ts.KvStore.open(self.kvstore(location)), location, "opening")

    def wait(self, future: Any, location: Location, action: str) -> Any:
        """The result of a kvstore `future` within the deadline; failures typed (see `translate`)."""
        try:
            return deadlines.wait(future)
        except (ValueError, TimeoutError) as e:
            typed = self.translate(e, location, action=action)
            if typed is e:
                raise
            raise typed from e

    def list_keys(self, location: Location) -> list[str]:
        """Every object key under `location`, relative to it, sorted."""
        store = self.open(location)
        return sorted(k.decode() for k in self.wait(store.list(), location, "listing"))

    def listdir(self, location: Location) -> list[str]:
        """Names directly under `location`: objects and "folders" (key prefixes)."""
        return sorted({key.split("/", 1)[0] for key in self.list_keys(location)})

    def isdir(self, location: Location) -> bool:
        """True for a prefix holding at least one object."""
        return bool(self.list_keys(location))

    def read(self, location: Location) -> bytes | None:
        """The bytes of one object, or None if it does not exist."""
        return self.read_version(location)[0]

    def read_version(self, location: Location) -> tuple[bytes | None, bytes]:
        """The bytes of one object (None if it does not exist) and the version they are of.

        The version is TensorStore's storage generation (GCS's object
        generation, S3's ETag), for `changed`.
        """
        store = self.open(location.parent)
        result = self.wait(store.read(location.name.encode()), location, "reading")
        return (None if result.state == "missing" else bytes(result.value)), result.stamp.generation

    def changed(self, location: Location, version: bytes) -> str | None:
        """None while `location` is still at `version`; else its version now, as the store shows it.

        A conditional read (no bytes come back when the version matches; a
        store that ignores the condition sends the object, and the versions
        are compared all the same).
        """
        store = self.open(location.parent)
        result = self.wait(store.read(location.name.encode(), if_not_equal=version), location, "reading")
        if result.state == "missing":
            return "none (deleted)"
        if result.state == "unspecified" or result.stamp.generation == version:
            return None
        return self.version_text(result.stamp.generation)

    def replaced(self, location: Location, expected: bytes, found: bytes) -> ObjectChangedError:
        """The error for a read of `location` served by version `found` in a load pinned to `expected`."""
        label, old, new = self.version_label, self.version_text(expected), self.version_text(found)
        return ObjectChangedError(
            f"{location.url!r} was replaced while it was being read: this load began with {label} {old} "
            f"and a later read got {label} {new}. Nothing of the new version was used (no mix of old "
            "and new bytes). Fix: load again once the upload is finished, and do not overwrite a "
            "checkpoint that is being read (write a new step or a new object name).",
            url=location.url, expected=old, found=new,
        )

    def exists(self, location: Location) -> bool:
        """True for an existing object or non-empty prefix."""
        return self.read(location) is not None or self.isdir(location)

    def write(self, location: Location, data: bytes) -> None:
        """Writes one object (atomic: all or nothing)."""
        store = self.open(location.parent)
        self.wait(store.write(location.name.encode(), data), location, "writing")

    def delete_tree(self, location: Location) -> None:
        """Deletes every object under the prefix `location`."""
        store = self.open(location)
        self.wait(store.delete_range(ts.KvStore.KeyRange()), location, "deleting")

    def delete_object(self, location: Location) -> None:
        """Deletes one object; a missing one is no error."""
        store = self.open(location.parent)
        key = location.name.encode()
        # The range of exactly this key (KvStore has no single-key delete).
        self.wait(store.delete_range(ts.KvStore.KeyRange(key, key + b"\0")), location, "deleting")

    def source(self, location: Location, sizer: Sizer | None = None) -> RemoteObject:
        """One object, read by byte ranges."""
        return RemoteObject(location, self, sizer)

    def size(self, location: Location) -> int:
        """Total bytes of every object under `location` (see `shardckpt.storage.sizing`)."""
        return sizing.du(self, location)

    # ---- errors ---------------------------------------------------------------

    def translate(self, error: BaseException, location: Location, *, action: str = "reading") -> BaseException:
        """Maps a failed request to a typed shardckpt error naming the URL and the fix.

        TensorStore reports HTTP failures as `ValueError` with an absl status
        text ("NOT_FOUND: ... HTTP response code: 404 ..."); the codes and
        statuses below are the ones its `gcs` and `s3` drivers report.

        Returns:
            The typed error (to `raise ... from error`), or `error` itself when
            it is no storage failure.
        """
        # Without the request's spec that tensorstore appends: its settings
        # ("aws_credentials", "bucket") would match the patterns below.
        text = re.sub(r"\s*\[tensorstore_spec='.*?'\]", "", str(error), flags=re.S)
        url = location.url
        cloud = self.cloud
        if isinstance(error, TimeoutError) or re.search(r"retry attempts failed|CURL error|curl_code", text):
            return self.timed_out(location, action, text or "nothing")
        if re.search(r"NoSuchBucket|[Bb]ucket.{0,40}(does not exist|not found)|The specified bucket", text):
            return self.bucket_not_found(location, f"{action}. {cloud} said: {_short(text)}")
        refused = re.search(
            r"InvalidAccessKeyId|SignatureDoesNotMatch|ExpiredToken|InvalidToken|TokenRefreshRequired|"
            r"response code: 401|UNAUTHENTICATED|[Ii]nvalid_grant",
            text,
        )
        if refused and self.has_credentials():
            # Credentials were found and sent but are not valid: S3 says so with a
            # 403 and one of these codes, GCS with a 401; a role would not help.
            return StorageCredentialsError(
                f"The {cloud} credentials in use were refused for {url!r} while {action} "
                f"({refused.group(0)}). Fix: check or renew them ({self.credential_hint}). "
                f"{cloud} said: {_short(text)}"
            )
        denied = re.search(r"response code: 403|PERMISSION_DENIED|AccessDenied|Forbidden", text)
        if denied and not self.has_credentials():
            # The request went out unsigned: the fix is credentials, not a role.
            return StorageCredentialsError(
                f"Access to {url!r} was denied (HTTP 403) while {action}, and no {cloud} credentials "
                f"were found in the environment or the SDK's files. Fix: {self.credential_hint}. "
                f"{cloud} said: {_short(text)}"
            )
        if denied:
            return StorageAccessDeniedError(
                f"Access to {url!r} was denied (HTTP 403) while {action}. Fix: grant the "
                f"credentials in use {self.permission(action)}, or use other credentials "
                f"({self.credential_hint}). {cloud} said: {_short(text)}"
            )
        if re.search(
            r"response code: 401|UNAUTHENTICATED|[Cc]redentials|No credentials|metadata server|"
            r"InvalidAccessKeyId|SignatureDoesNotMatch|ExpiredToken",
            text,
        ):
            return StorageCredentialsError(
                f"No valid credentials for {url!r} ({action}). Fix: {self.credential_hint}. "
                f"{cloud} said: {_short(text)}"
            )
        if action == "writing" and re.search(r"response code: 404|NOT_FOUND", text):
            # An object write never 404s on its key: the bucket itself is missing.
            return self.bucket_not_found(location, f"{action}. {cloud} said: {_short(text)}")
        if re.search(r"response code: 404|NOT_FOUND|NoSuchKey", text):
            return CheckpointNotFoundError(
                f"Nothing at {url!r} (HTTP 404, {action}). Fix: check the URL; list it with "
                f"{self.ls_command} {url}/. {cloud} said: {_short(text)}"
            )
        return error

    def timed_out(self, location: Location, action: str, said: str) -> StorageTimeoutError:
        """The error for a request that got no usable answer within its deadline."""
        limits = deadlines.current()
        if "retry attempts failed" in said or "CURL error" in said:
            how = f"in {limits.retries} attempt(s): the endpoint could not be reached"
        else:
            how = f"within the deadline of {limits.timeout:g} s"
        return StorageTimeoutError(
            f"{self.cloud} gave no answer for {location.url!r} while {action}, {how}. Endpoint tried: "
            f"{self.endpoint()}. Fix: check the network and the endpoint ({self.endpoint_hint()}), "
            f"then the credentials ({self.credential_hint}); a slow link may need a longer "
            f"deadline ({deadlines.ENV_TIMEOUT}=SECONDS, or shardckpt.storage.deadline(timeout=...)). "
            f"{self.cloud} said: {_short(said)}"
        )

    def endpoint_hint(self) -> str:
        """Where the endpoint is set."""
        return "the endpoint setting"

    def bucket_not_found(self, location: Location, context: str = "") -> BucketNotFoundError:
        """The one message for a bucket that does not exist."""
        return BucketNotFoundError(
            f"The bucket {location.bucket!r} of {location.url!r} does not exist"
            f"{f' ({context})' if context else ''}. Fix: create it or correct the bucket name."
        )

    def missing(self, location: Location, *, what: str) -> BaseException:
        """The error for "nothing at `location`": a missing bucket, or a missing object in it.

        Args:
            location: What was looked for.
            what: What was expected there, for the message ("a checkpoint: ...").
        """
        if self.bucket_missing(location):
            return self.bucket_not_found(location)
        return CheckpointNotFoundError(
            f"Nothing at {location.url!r} ({what}). Fix: check the URL; list the folder with "
            f"{self.ls_command} {location.parent.url}/."
        )

    def not_found(self, location: Location, *, what: str) -> BaseException:
        """The error for a listing that found nothing at `location`.

        TensorStore's `gcs` driver lists a missing bucket, and a bucket it may
        not list (HTTP 403), as empty. So one object read asks again (a
        refusal raises its typed error here), then the bucket is probed.
        """
        self.read(location if location.path else location.join(".shardckpt-probe"))
        return self.missing(location, what=what)

    def bucket_missing(self, location: Location) -> bool:
        """True only when the store answers that `location`'s bucket does not exist.

        An unauthenticated request is enough: both clouds answer 404 for a bucket
        that does not exist and 401/403 for one that exists but is private. Only
        used on error paths; any other outcome (no network, 401, 403) is False.
        """
        request = urllib.request.Request(self.bucket_url(location), method="GET")
        try:
            with urllib.request.urlopen(request, timeout=deadlines.current().connect_timeout):
                return False
        except urllib.error.HTTPError as e:
            return e.code == 404
        except (OSError, ValueError):
            return False


def _short(text: str) -> str:
    return " ".join(text.split())[:300]
