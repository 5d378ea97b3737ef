"""Test set-up: 8 simulated CPU devices, JAX backend, set before jax is imported."""

import os

from tests.mp import FAST_COMPILE  # noqa: E402  (imports no jax)

# Must happen before the first `import jax` anywhere in the test session.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count=8 {FAST_COMPILE}"
).strip()
os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import keras  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _clean_keras_state():
    """Each test starts with no distribution and fresh Keras names."""
    keras.distribution.set_distribution(None)
    keras.backend.clear_session()
    yield
    keras.distribution.set_distribution(None)
    keras.backend.clear_session()


# The longest files (`--durations`, 2 workers), started first: `--dist loadfile` hands files out
# in collection order, and a long file handed out last leaves the other worker idle at the end.
LONG_FILES = (
    "test_layout_hub.py", "test_restore.py", "test_bucket_multiprocess.py", "test_preemption_inputs.py",
    "test_resume_kill.py", "test_storage_pinning.py", "test_export.py", "test_bench_smoke.py",
    "test_fault_injection.py", "test_export_configs.py", "test_export_transformers.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def pytest_configure(config):
    assert jax.device_count() == 8, "conftest must set 8 CPU devices before jax import"


@pytest.fixture(scope="session")
def llama_folder(tmp_path_factory):
    """A tiny Hugging Face Llama folder (tests/hf_fixtures.py), built once; tests only read it."""
    from tests.hf_fixtures import make_folder

    folder = str(tmp_path_factory.mktemp("llama") / "src")
    make_folder("llama", folder)
    return folder


# Session fixtures of fake object stores (gcs_server, s3_server, bucket).
pytest_plugins = ["tests.buckets"]
