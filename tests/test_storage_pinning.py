"""Bucket reads are pinned to one version of what they read: an object replaced
between two reads of a load raises `ObjectChangedError`, never a mix of old and
new bytes. The replacement happens at an exact point, from a counting proxy in
front of the real fake GCS / moto server (tests/proxy.py) that sees the load's
requests: after the load's first ranged reads, a second version is uploaded.
"""

from __future__ import annotations

import urllib.parse

import keras
import numpy as np
import pytest
import safetensors.numpy

from shardckpt import convert, load_sharded, storage
from shardckpt.errors import ObjectChangedError
from tests.proxy import CountingProxy

_ONE_KERNEL = 20_000
"""In-flight budget of a load: about one 64x64 float32 kernel, so arrays are read one after another."""


def _six_dense_seeded(seed: int) -> keras.Model:
    keras.backend.clear_session()
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [keras.Input((64,))] + [keras.layers.Dense(64, name=f"d{i}") for i in range(6)], name="pinned"
    )
    return model


def _values(model) -> dict[str, np.ndarray]:
    return {v.path: np.asarray(v.value) for v in model.weights}


def _upload(local, location) -> None:
    storage.write_bytes(location, local.read_bytes())


@pytest.fixture(params=["gs", "s3"])
def proxied(request, monkeypatch):
    """(server, proxy): the fake store of the parameter, TensorStore pointed at a proxy in front of it."""
    server = request.getfixturevalue("gcs_server" if request.param == "gs" else "s3_server")
    proxy = CountingProxy(server.endpoint)
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL" if request.param == "gs" else "AWS_ENDPOINT_URL", proxy.url())
    yield server, proxy
    proxy.stop()


def _replace_after(proxy, reads: int, marker: str, replace) -> list[str]:
    """Calls `replace()` once, before forwarding the `reads`+1-th ranged GET whose path holds `marker`."""
    seen: list[str] = []

    def hook(label, method, path, ranged):
        if method == "GET" and ranged is not None and marker in urllib.parse.unquote(path):
            seen.append(path)
            if len(seen) == reads + 1:
                replace()

    proxy.hook = hook
    return seen


@pytest.mark.parametrize("fmt", ["h5", "safetensors", "orbax"])
def test_object_replaced_in_the_middle_of_a_load_raises_never_mixes(proxied, fmt, tmp_path):
    server, proxy = proxied
    bucket = storage.parse(server.new_bucket())
    old_model, new_model = _six_dense_seeded(1), _six_dense_seeded(2)
    old, new = _values(old_model), _values(new_model)
    assert all(not np.array_equal(old[k], new[k]) for k in old if old[k].any())
    for name, model in (("old", old_model), ("new", new_model)):
        if fmt == "safetensors":
            safetensors.numpy.save_file(_values(model), str(tmp_path / f"{name}.safetensors"))
        else:
            model.save_weights(tmp_path / f"{name}.weights.h5")
    if fmt == "orbax":
        # Two steps; the replacement rewrites step "a" in place with "b"'s files
        # (OCDBT data files have unique names; the manifest is overwritten).
        with_model = _six_dense_seeded(1)
        for name in ("old", "new"):
            convert(str(tmp_path / f"{name}.weights.h5"), bucket.join(name, "0").url, model=with_model, progress=False)
        source, target = bucket.join("new", "0"), bucket.join("old", "0")

        def replace():
            for key in storage.backend(source).list_keys(source):
                if "/" in key and not key.startswith("_"):
                    data = storage.read_bytes(source.join(key))
                    assert data is not None
                    storage.write_bytes(target.join(key), data)

        path, marker = target.url, "/d/"
    else:
        suffix = ".safetensors" if fmt == "safetensors" else ".weights.h5"
        target = bucket.join("m" + suffix)
        _upload(tmp_path / f"old{suffix}", target)
        path, marker = target.url, target.name

        def replace():
            _upload(tmp_path / f"new{suffix}", target)

    # A whole load first, unchanged: its values, and how many ranged reads it makes.
    counted = _replace_after(proxy, -2, marker, lambda: None)
    model = _six_dense_seeded(3)
    load_sharded(model, path, max_inflight_bytes=_ONE_KERNEL, progress=False)
    assert all(np.array_equal(v, old[k]) for k, v in _values(model).items())
    total = len(counted)
    assert total >= 4, counted
    # Again, the object replaced half-way through the reads.
    seen = _replace_after(proxy, total // 2, marker, replace)
    model = _six_dense_seeded(3)
    before = _values(model)
    with pytest.raises(ObjectChangedError, match=r"replaced (while it was being read|during the load)") as info:
        # About one array in flight at a time: the replacement lands in the middle.
        load_sharded(model, path, max_inflight_bytes=_ONE_KERNEL, progress=False)
    assert len(seen) > total // 2, seen  # reads went on after the replacement
    assert info.value.expected and info.value.found and info.value.expected != info.value.found
    # Each variable holds the old version or is untouched: no new bytes anywhere.
    after = _values(model)
    loaded = [k for k in after if np.array_equal(after[k], old[k]) and not np.array_equal(before[k], old[k])]
    assert loaded, "nothing was loaded before the error"
    for key, value in after.items():
        assert np.array_equal(value, old[key]) or np.array_equal(value, before[key]), key
        assert not np.array_equal(value, new[key]) or np.array_equal(new[key], old[key]), key


def test_object_replaced_by_a_shorter_one_mid_load_raises_object_changed_not_truncated(proxied, tmp_path):
    """A later range past the new, shorter version's end is the replacement, not a truncated upload."""
    server, proxy = proxied
    target = storage.parse(server.new_bucket()).join("m.safetensors")
    safetensors.numpy.save_file(_values(_six_dense_seeded(1)), str(tmp_path / "old.safetensors"))
    safetensors.numpy.save_file({"x": np.zeros(4, np.float32)}, str(tmp_path / "new.safetensors"))
    _upload(tmp_path / "old.safetensors", target)
    _replace_after(proxy, 3, target.name, lambda: _upload(tmp_path / "new.safetensors", target))
    with pytest.raises(ObjectChangedError, match="replaced while it was being read") as info:
        load_sharded(_six_dense_seeded(3), target.url, max_inflight_bytes=_ONE_KERNEL, progress=False)
    assert info.value.expected and info.value.found and info.value.expected != info.value.found


def test_local_orbax_manifest_is_pinned_like_a_buckets(tmp_path):
    """The Orbax reader reads a local step through the same path as a bucket's: its
    manifest is pinned at open, so a step replaced in place during a load is named at
    `close`, never taken for the step that is there now."""
    import os

    from shardckpt.formats.orbax.reader import OrbaxReader

    model = _six_dense_seeded(0)
    model.save_weights(tmp_path / "m.weights.h5")
    convert(tmp_path / "m.weights.h5", tmp_path / "ck", model=model)
    untouched = OrbaxReader(tmp_path / "ck")
    key = untouched.keys()[0]
    expected = untouched.read(key, ())
    untouched.close()  # nothing changed: no error

    reader = OrbaxReader(tmp_path / "ck")
    np.testing.assert_array_equal(reader.read(key, ()), expected)
    manifest = tmp_path.joinpath(reader.tree_dir, "manifest.ocdbt")
    rewritten = manifest.with_name("manifest.new")
    rewritten.write_bytes(manifest.read_bytes())
    os.replace(rewritten, manifest)  # a save into the same step: another file under the same name
    np.testing.assert_array_equal(reader.read(key, ()), expected)  # still the pinned copy
    with pytest.raises(ObjectChangedError, match=rf"manifest '{manifest}' .* was replaced during the load.*file stamp"):
        reader.close()
