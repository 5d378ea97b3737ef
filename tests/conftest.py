"""Test set-up: 8 simulated CPU devices, JAX backend, set before jax is imported."""

import gc
import json
import os
import sys

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
    # No garbage collection here: the previous test's tear-down (or the end of collection) ran it.
    keras.backend.clear_session(free_memory=False)
    yield
    keras.distribution.set_distribution(None)
    keras.backend.clear_session()


def pytest_collection_finish(session):
    """What is alive once the tests are collected (JAX, Keras, keras-hub, the test modules) lives
    until the session ends: frozen, the garbage collector stops walking it at every collection
    (`clear_session` runs one, several times a test; walking it costs about 0.1-0.2 s of CPU each).
    Cyclic garbage the tests make is collected as before."""
    gc.collect()
    gc.freeze()


# The longest files (`--durations`, 2 workers), started first: `--dist loadfile` hands files out
# in collection order, and a long file handed out last leaves the other worker idle at the end.
LONG_FILES = (
    "test_layout_hub.py", "test_restore.py", "test_bucket_multiprocess.py", "test_preemption_inputs.py",
    "test_resume_kill.py", "test_storage_pinning.py", "test_export.py", "test_bench_smoke.py",
    "test_fault_injection.py", "test_export_configs.py", "test_export_transformers.py",
)


# The tiers `--fast` leaves out, each found by a rule over what a test's code reaches (its
# function and, transitively, the functions, classes and non-session fixtures of this folder it
# names), so a new test is classified by what it does, not by hand. `slow` stays for a test no
# rule catches; `-m <tier>` runs one tier.
TIERS = {
    "multiprocess": "starts real jax.distributed processes on 127.0.0.1 (reaches tests.mp's run_pair/start_pair)",
    "kill": "kills processes with SIGKILL or SIGTERM and reruns them (fault injection, preemption)",
    "bench": "runs a benchmark of tools/ at its --smoke size",
    "hub_matrix": "one case of a keras-hub architecture grid (parametrized by an architecture's name)",
    "subprocess": "starts a fresh Python (reaches subprocess or sys.executable): seconds of imports each",
    "keras_hub": "builds keras-hub models or presets (reaches keras_hub or from_preset, by name or in a string)",
    "buckets": "reads or writes the fake GCS / S3 servers (the gcs_server, s3_server or bucket fixture)",
    "training": "trains a model with Keras' fit (reaches fit): a train step compiled per model",
    "slow": "takes more than a few seconds (marked by hand where no rule above applies)",
}
_TWO_PROCESS_NAMES = {"run_pair", "start_pair"}
_KILL_NAMES = {"SIGKILL", "SIGTERM"}
_SUBPROCESS_NAMES = {"subprocess", "executable"}
_KERAS_HUB_NAMES = {"keras_hub", "from_preset"}
_BUCKET_FIXTURES = {"gcs_server", "s3_server", "bucket"}
_TESTS = os.path.dirname(os.path.abspath(__file__))


def pytest_addoption(parser):
    parser.addoption(
        "--fast", action="store_true",
        help="the unit tier: leave out the tests marked " + ", ".join(TIERS) + " (tests/conftest.py TIERS)",
    )


def _is_test_code(module_name: str | None) -> bool:
    """Whether a module is one of this folder's (a test module or a helper such as tests/mp.py)."""
    path = getattr(sys.modules.get(module_name or ""), "__file__", None) or ""
    return os.path.dirname(os.path.abspath(path)) == _TESTS


def _reached(item) -> tuple[set[str], set[object]]:
    """Global names and constants of the test's code and of the functions and fixtures of this
    folder's modules (its own, tests/mp.py, tests/_train_worker.py, ...) it reaches."""
    module = item.module
    functions = [getattr(item.function, "__wrapped__", item.function)]
    for name in item.fixturenames:
        for definition in item._fixtureinfo.name2fixturedefs.get(name, ()):
            # Session fixtures (the bucket servers) are started once for every tier.
            if definition.scope != "session" and _is_test_code(getattr(definition.func, "__module__", None)):
                functions.append(definition.func)
    names: set[str] = set()
    constants: set[object] = set()
    seen: set[int] = set()
    codes = [f.__code__ for f in functions if hasattr(f, "__code__")]
    while codes:
        code = codes.pop()
        if id(code) in seen:
            continue
        seen.add(id(code))
        names.update(code.co_names)
        pending = list(code.co_consts)
        while pending:
            const = pending.pop()
            if isinstance(const, type(code)):
                codes.append(const)
            elif isinstance(const, (tuple, frozenset)):
                pending.extend(const)
            elif isinstance(const, str):
                constants.add(const)
        for name in code.co_names:
            target = getattr(module, name, None)
            target = getattr(target, "__wrapped__", target)
            if not _is_test_code(getattr(target, "__module__", None)):
                continue
            if isinstance(target, type):  # a helper class: its methods
                codes.extend(f.__code__ for f in vars(target).values() if hasattr(f, "__code__"))
            elif hasattr(target, "__code__"):
                codes.append(target.__code__)
    return names, constants


def _architectures() -> set[str]:
    """Names of the keras-hub architectures the grids draw from, as far as collection imported
    the registries (tests/hf_fixtures.py, tests/export_grid.py, tools/bench_layout.py) or
    tests/published_configs.json."""
    names: set[str] = set()
    for module in ("hf_fixtures", "tests.hf_fixtures"):
        names.update(getattr(sys.modules.get(module), "ARCHITECTURES", ()))
    for module in ("export_grid", "tests.export_grid"):
        for row in (*getattr(sys.modules.get(module), "GRID", ()), *getattr(sys.modules.get(module), "REFUSED", ())):
            names.add(row[0])
    names.update(getattr(sys.modules.get("bench_layout"), "HUB_BACKBONES", {}))
    with open(os.path.join(os.path.dirname(__file__), "published_configs.json")) as f:
        names.update(name for name in json.load(f) if not name.startswith("_"))
    return names


def _classify(items) -> None:
    """Adds the TIERS markers their rules find (a marker given by hand stays)."""
    architectures = _architectures()
    for item in items:
        if not hasattr(item, "function"):
            continue
        names, constants = _reached(item)
        if names & _TWO_PROCESS_NAMES:
            item.add_marker("multiprocess")
        if names & _KILL_NAMES:
            item.add_marker("kill")
        if "fit" in names:
            item.add_marker("training")
        if names & _SUBPROCESS_NAMES:
            item.add_marker("subprocess")
        if (names | constants) & _KERAS_HUB_NAMES:  # constants: pytest.importorskip("keras_hub")
            item.add_marker("keras_hub")
        if _BUCKET_FIXTURES & (set(item.fixturenames) | constants):  # or request.getfixturevalue(name)
            item.add_marker("buckets")
        if "--smoke" in constants:
            item.add_marker("bench")
        callspec = getattr(item, "callspec", None)
        if callspec is not None and any(
            isinstance(value, str) and value in architectures for value in callspec.params.values()
        ):
            item.add_marker("hub_matrix")


def pytest_collection_modifyitems(config, items):
    _classify(items)
    if config.getoption("--fast"):
        slow = [item for item in items if any(item.get_closest_marker(tier) for tier in TIERS)]
        if slow:
            config.hook.pytest_deselected(items=slow)
            left_out = set(map(id, slow))
            items[:] = [item for item in items if id(item) not in left_out]
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def pytest_configure(config):
    assert jax.device_count() == 8, "conftest must set 8 CPU devices before jax import"
    declared = {line.split(":")[0] for line in config.getini("markers")}  # pyproject.toml's
    for tier, meaning in TIERS.items():
        if tier not in declared:
            config.addinivalue_line("markers", f"{tier}: {meaning}")


@pytest.fixture(scope="session")
def llama_folder(tmp_path_factory):
    """A tiny Hugging Face Llama folder (tests/hf_fixtures.py), built once; tests only read it."""
    from tests.hf_fixtures import make_folder

    folder = str(tmp_path_factory.mktemp("llama") / "src")
    make_folder("llama", folder)
    return folder


# Session fixtures of fake object stores (gcs_server, s3_server, bucket).
pytest_plugins = ["tests.buckets"]
