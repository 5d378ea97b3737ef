"""Export into a bucket (`gs://`, `s3://`): staged locally, uploaded file by file, committed by its config.

One process writes a bucket folder: the export runs into a local staging
folder exactly as a local export (pieces at their offsets, no gather), then
each file is uploaded as one object and its staged copy deleted. Objects
are written whole (the storage layer's writes are single, atomic object
writes), so uploading a file holds it in host memory once: a bucket
export's files are therefore at most `max_shard_size`, which defaults to
the host's `max_inflight_bytes` budget (one larger tensor gets a file of its
own; a PEFT adapter is one file whatever its size). The upload goes through the commit protocol (`storage.commit`) with
the file that makes the folder loadable as its marker, written last:
`config.json` (what `from_preset` and transformers look for), else the
adapter config or the index, else the one data file; a crash before it
leaves a folder no loader takes for a model, and an overwrite deletes that
file first. Several processes writing one bucket folder is not built and is
refused before anything is written.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from typing import Any

from shardckpt import storage
from shardckpt.errors import DestinationExistsError, UnsupportedURLError
from shardckpt.storage import commit

LAST = "config.json"


def export_to_bucket(location: storage.Location, export: Any, model: Any, *, shard: int | None, overwrite: bool,
                     **kwargs: Any) -> Any:
    """Runs `export(model, staging, max_shard_size=..., **kwargs)` locally, then uploads it to `location`."""
    import jax

    start = time.perf_counter()
    if jax.process_count() > 1:
        raise UnsupportedURLError(
            f"dst={location.url!r}: {jax.process_count()} processes exporting into one bucket folder is "
            "not built (each would stage and upload the whole folder). Fix: export to a folder on a disk "
            "every process shares and copy it to the bucket, or export from a single process."
        )
    if storage.exists(location) and not overwrite:
        raise DestinationExistsError(
            f"{location.url!r} already holds objects. Fix: choose another destination, delete it, or "
            "pass overwrite=True."
        )
    with tempfile.TemporaryDirectory(prefix="shardckpt-export-") as staging:
        local = os.path.join(staging, "out")
        report = export(model, local, max_shard_size=f"{shard}B" if shard else None, **kwargs)
        names = storage.list_keys(storage.parse(local))
        # Weights first, small files next, config.json (what makes it a preset) last.
        order = sorted(names, key=lambda n: (n == LAST, n.endswith("config.json"),
                                             not n.endswith((".safetensors", ".h5")), n))
        stage = commit.begin(location, overwrite=overwrite, marker=order[-1], who="export")
        try:
            for name in order[:-1]:
                storage.write_bytes(location.join(*name.split("/")), _take(local, name))
            stage.commit(_take(local, order[-1]))
        except BaseException:
            stage.discard()
            raise
    return dataclasses.replace(report, path=location.url, seconds=time.perf_counter() - start)


def _take(folder: str, name: str) -> bytes:
    """A staged file's bytes (one object write: at most `max_shard_size`); the staged copy is deleted."""
    path = os.path.join(folder, *name.split("/"))
    with open(path, "rb") as f:
        data = f.read()
    os.remove(path)
    return data
