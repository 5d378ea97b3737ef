"""README.md runs as written: every ```python block and every ```bash command line.

How it works
------------
`pieces()` cuts README.md into runnable pieces: each ```python block is one
piece, each command line of a ```bash block is another (a trailing `# comment`
dropped). Fences with no language or another one (the code layout) are prose.
Each piece runs in README order, in one module-scoped `Workspace`: a
temporary folder (the working directory while pieces run) whose tiny real
inputs (a `.weights.h5`, a `.keras`, a keras-hub preset, a Hugging Face
folder, fake GCS / S3 buckets, ...) are made on first use by a `Workspace`
method, so a piece costs only what it reads.

A piece runs only through the *filler* registered for its key:
- a python block's key is its first line that is not blank, an import or a
  comment, without a trailing comment and surrounding blanks;
- a bash line's key is the command without its comment.
The filler gives a python block the names it uses but does not define
(`build_model`, `my_iterator`, ...) and makes the files it reads; a bash line
runs in-process through `shardckpt.cli.main` (or, for another program, in a
subprocess), and must exit with the filler's `exit_code`.

To register a filler for a new README block or line, add to `FILLERS`:

    FILLERS["<key>"] = Filler(
        names=lambda ws: {"model": ws.compiled_model()},   # python: names it needs
        setup=lambda ws: ws.orbax("model_orbax"),           # files it reads
        shrink={"epochs=10": "epochs=2"},                   # sizes made tiny (each must occur)
        fixtures=("gcs_server",),                           # pytest fixtures it needs
        reason="...",                                       # why anything is shrunk
    )

and, when it reads an input no `Workspace` method makes yet, add one (tiny:
the whole module runs in well under a minute). A piece without a filler FAILS
`test_readme_piece` with its key and this recipe; a filler whose key no
longer occurs in README.md FAILS `test_every_filler_is_used`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
import pytest

import shardckpt
from shardckpt.cli.main import main as cli_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")

# The architecture the README calls build_model() and `--model mypkg.models:build`.
_MODELS_PY = '''
import keras


def build():
    inputs = keras.Input((8,), name="x")
    hidden = keras.layers.Dense(16, name="up")(inputs)
    outputs = keras.layers.Dense(8, name="down")(hidden)
    return keras.Model(inputs, outputs, name="tiny")
'''
LLAMA = dict(
    vocabulary_size=64, num_layers=1, num_query_heads=8, num_key_value_heads=2, hidden_dim=32, intermediate_dim=64
)


@dataclasses.dataclass(frozen=True)
class Piece:
    """One runnable piece of README.md."""

    kind: str  # "python" or "bash"
    line: int  # 1-based line of README.md where it starts
    section: str
    code: str

    @property
    def key(self) -> str:
        if self.kind == "bash":
            return _strip_comment(self.code)
        for line in self.code.splitlines():
            text = _strip_comment(line)
            if text and not text.startswith(("import ", "from ")):
                return text
        return ""

    def __str__(self) -> str:
        return f"README.md:{self.line} ({self.section!r}) {self.key!r}"


def _strip_comment(line: str) -> str:
    # README commands and keys hold no '#' inside strings.
    return line.split("#", 1)[0].strip()


def pieces(text: str | None = None) -> list[Piece]:
    """Every ```python block and ```bash command line of README.md, in order."""
    if text is None:
        with open(README) as f:
            text = f.read()
    out: list[Piece] = []
    section, fence, start, body = "", None, 0, []
    for number, line in enumerate(text.splitlines(), 1):
        if fence is None:
            if line.startswith("#"):
                section = line.lstrip("#").strip()
            elif line.startswith("```"):
                fence, start, body = line[3:].strip(), number, []
            continue
        if line.startswith("```"):
            if fence == "python":
                out.append(Piece("python", start, section, "\n".join(body)))
            elif fence == "bash":
                for offset, command in enumerate(body, 1):
                    if _strip_comment(command):
                        out.append(Piece("bash", start + offset, section, command))
            fence = None
            continue
        body.append(line)
    return out


class Workspace:
    """The folder README pieces run in; each input is made on first use."""

    def __init__(self, root: str, request: pytest.FixtureRequest) -> None:
        self.root = root
        self.request = request
        self._made: dict[str, Any] = {}
        os.makedirs(os.path.join(root, "mypkg"))
        for name, text in (("__init__.py", ""), ("models.py", _MODELS_PY)):
            with open(os.path.join(root, "mypkg", name), "w") as f:
                f.write(text)

    def _once(self, name: str, make: Callable[[], Any]) -> Any:
        if name not in self._made:
            self._made[name] = make()
        return self._made[name]

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def build_model(self) -> keras.Model:
        from mypkg.models import build  # the workspace is on sys.path

        return build()

    def compiled_model(self) -> keras.Model:
        model = self.build_model()
        model.compile(optimizer="adam", loss="mse")
        return model

    def xy(self) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(0)
        return rng.standard_normal((16, 8)).astype("float32"), rng.standard_normal((16, 8)).astype("float32")

    def weights_files(self) -> None:
        """model.weights.h5, model.keras, m.weights.json and a safetensors index set."""

        def make() -> None:
            import safetensors.numpy as stnp

            keras.backend.clear_session()
            model = self.build_model()
            rng = np.random.default_rng(1)
            for v in model.weights:
                v.assign(rng.standard_normal(v.shape).astype("float32"))
            model.save_weights(self.path("model.weights.h5"))
            model.save(self.path("model.keras"))
            model.save_weights(self.path("m.weights.json"), max_shard_size=1e-6)
            shard = "model-00001-of-00001.safetensors"
            values = {v.path: np.asarray(v.value) for v in model.weights}
            stnp.save_file(values, self.path(shard))
            with open(self.path("model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {}, "weight_map": dict.fromkeys(values, shard)}, f)
            keras.backend.clear_session()

        self._once("weights", make)

    def _preset(self, name: str, build: Callable[[Any], keras.Model]) -> str:
        """`build(keras_hub)` saved by keras-hub as the preset folder `name` (once)."""

        def make() -> str:
            import keras_hub

            keras.backend.clear_session()
            build(keras_hub).save_to_preset(self.path(name))
            keras.backend.clear_session()
            return self.path(name)

        return self._once(name, make)

    def llama_preset(self) -> str:
        return self._preset("llama_preset", lambda keras_hub: keras_hub.models.LlamaBackbone(**LLAMA))

    def hf_folder(self) -> str:
        def make() -> str:
            from tests.hf_fixtures import make_folder

            make_folder("llama", self.path("hf_llama_folder"))
            keras.backend.clear_session()
            return self.path("hf_llama_folder")

        return self._once("hf", make)

    def classifier_preset(self) -> str:
        def build(keras_hub: Any) -> keras.Model:
            backbone = keras_hub.models.BertBackbone(
                vocabulary_size=64, num_layers=1, num_heads=8, hidden_dim=32, intermediate_dim=64,
                max_sequence_length=16,
            )
            return keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=4, preprocessor=None)

        return self._preset("bert_clf", build)

    def buckets(self) -> None:
        """gs://my-bucket and s3://my-bucket on the fake servers, with a preset and a checkpoint."""

        def make() -> None:
            from shardckpt import storage

            for server in ("gcs_server", "s3_server"):
                self.request.getfixturevalue(server).create_bucket("my-bucket")
            preset = self.llama_preset()
            for folder, _, files in os.walk(preset):
                for name in files:
                    rel = os.path.relpath(os.path.join(folder, name), preset)
                    with open(os.path.join(folder, name), "rb") as f:
                        storage.write_bytes(storage.parse(f"gs://my-bucket/presets/llama/{rel}"), f.read())
            self.weights_files()
            shardckpt.convert(self.path("model.keras"), "s3://my-bucket/ckpts/0", progress=False)

        self._once("buckets", make)

    def quantized_files(self) -> None:
        """quantized.weights.h5 and quantized.keras (int8, Keras' quantize()) and an int8 keras-hub preset."""

        def make() -> None:
            import keras_hub

            keras.backend.clear_session()
            model = self.build_model()
            model.quantize("int8")
            model.save_weights(self.path("quantized.weights.h5"))
            model.save(self.path("quantized.keras"))
            keras.backend.clear_session()
            backbone = keras_hub.models.LlamaBackbone(**LLAMA)
            backbone.quantize("int8")
            backbone.save_to_preset(self.path("quantized_llama_preset"))
            keras.backend.clear_session()

        self._once("quantized", make)

    def fresh(self, url: str) -> None:
        """Removes what an earlier piece wrote at `url` (a piece that writes it again)."""
        from shardckpt import storage

        location = storage.parse(url)
        if location.is_remote:
            storage.delete_tree(location)
        elif os.path.exists(location.path):
            import shutil

            shutil.rmtree(location.path)


@dataclasses.dataclass(frozen=True)
class Filler:
    """What one README piece needs (see the module docstring)."""

    names: Callable[[Workspace], dict[str, Any]] = lambda ws: {}
    setup: Callable[[Workspace], Any] = lambda ws: None
    shrink: dict[str, str] = dataclasses.field(default_factory=dict)
    fixtures: tuple[str, ...] = ()
    exit_code: int = 0
    reason: str = ""


def _cli(setup: Callable[[Workspace], Any] = lambda ws: None, **kw: Any) -> Filler:
    return Filler(setup=setup, **kw)


def _fresh_then(url: str, then: Callable[[Workspace], Any] = lambda ws: None) -> Callable[[Workspace], Any]:
    def setup(ws: Workspace) -> None:
        ws.fresh(url)
        then(ws)

    return setup


def _data(ws: Workspace) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    x, y = ws.xy()
    while True:
        for i in range(0, 16, 8):
            yield x[i : i + 8], y[i : i + 8]


def _orbax(ws: Workspace) -> None:
    ws.weights_files()
    if not os.path.isdir(ws.path("model_orbax")):
        shardckpt.convert(ws.path("model.keras"), ws.path("model_orbax"), progress=False)


def _iterator_model(ws: Workspace) -> dict[str, Any]:
    from tests.zoo import CountingIterator

    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(2)
    x_val, y_val = rng.standard_normal((4, 6)).astype("float32"), rng.standard_normal((4, 1)).astype("float32")
    return {"model": model, "my_iterator": CountingIterator(), "x_val": x_val, "y_val": y_val}


def _build_with_policy(dtype: str) -> keras.Model:
    """The README's build_model, built with a (quantized) dtype policy."""
    inputs = keras.Input((8,), name="x")
    hidden = keras.layers.Dense(16, name="up", dtype=dtype)(inputs)
    outputs = keras.layers.Dense(8, name="down", dtype=dtype)(hidden)
    return keras.Model(inputs, outputs, name="tiny")


def _gpt2_like() -> keras.Model:
    """GPT-2's published head count (12, indivisible by 8) and an odd vocabulary, tiny otherwise."""
    import keras_hub

    return keras_hub.models.GPT2Backbone(
        vocabulary_size=101, num_layers=1, num_heads=12, hidden_dim=48, intermediate_dim=96, max_sequence_length=16
    )


def _llama_causal_lm(ws: Workspace) -> keras.Model:
    import keras_hub

    backbone = shardckpt.from_preset(ws.hf_folder())
    keras.distribution.set_distribution(None)
    return keras_hub.models.Llama3CausalLM(backbone=backbone, preprocessor=None)


def _export_inputs(ws: Workspace) -> None:
    folder = ws.hf_folder()  # a tiny Hugging Face Llama folder: keras-hub builds a Llama3Backbone
    if not os.path.exists(ws.path("Llama-3.2-1B")):
        os.symlink(folder, ws.path("Llama-3.2-1B"))
    ws.buckets()
    for url in ("out_hf", "out_hf_bf16", "out_preset", "gs://my-bucket/out"):
        ws.fresh(url)


FILLERS: dict[str, Filler] = {
    # Quick start
    "python3 tools/run.py demo": Filler(
        shrink={"demo": "demo --help"},
        reason="the demo itself runs in tests/test_demo.py; here tools/run.py reaches it",
    ),
    "python3 tools/run.py test": Filler(
        shrink={"test": "test -q --co tests/test_public_api.py"},
        reason="the suite cannot run inside itself: this collects one file through tools/run.py",
    ),
    # from_preset
    'model = shardckpt.from_preset("llama_preset/")': Filler(
        setup=lambda ws: (ws.llama_preset(), ws.hf_folder(), ws.classifier_preset()),
    ),
    # Restore
    'mesh = keras.distribution.DeviceMesh((1, 8), ["data", "model"])': Filler(
        names=lambda ws: {"build_model": ws.build_model}, setup=lambda ws: ws.weights_files()
    ),
    # Layouts
    "plan = shardckpt.auto_layout(model, mesh)": Filler(
        names=lambda ws: {
            "keras": keras,
            "shardckpt": shardckpt,
            "model": ws.build_model(),
            "mesh": keras.distribution.DeviceMesh((2, 4), ["data", "model"]),
        }
    ),
    "model = build_model()": Filler(
        names=lambda ws: {"shardckpt": shardckpt, "build_model": ws.build_model, "x": ws.xy()[0], "y": ws.xy()[1]}
    ),
    "shardckpt plan package.module:build_fn --mesh 1x8 --optimizer adam": Filler(
        shrink={"package.module:build_fn": "mypkg.models:build"},
        reason="package.module:build_fn is the placeholder for your own function",
    ),
    # OrbaxCheckpoint
    "ckpt = shardckpt.OrbaxCheckpoint(": Filler(
        names=lambda ws: {"os": os, "shardckpt": shardckpt, **_iterator_model(ws)},
        setup=_fresh_then("ckpts"),
        shrink={"steps_per_epoch=500, epochs=10": "steps_per_epoch=2, epochs=2"},
        reason="2 epochs of 2 steps",
    ),
    # Sizes that do not divide
    "plan = shardckpt.auto_layout(model, (1, 8))": Filler(
        names=lambda ws: {"shardckpt": shardckpt, "model": _gpt2_like(), "p": ws.llama_preset()},
        reason="a 1-layer GPT-2 with the published 12 heads, at width 48 and vocabulary 101",
    ),
    # Export
    'model = shardckpt.from_preset("Llama-3.2-1B/", mesh=(2, 4))': Filler(
        names=lambda ws: {"shardckpt": shardckpt},
        setup=_export_inputs,
        fixtures=("gcs_server", "s3_server"),
        reason="Llama-3.2-1B/ is a tiny Hugging Face Llama folder under that name",
    ),
    "task.backbone.enable_lora(rank=8)": Filler(
        names=lambda ws: {"shardckpt": shardckpt, "task": _llama_causal_lm(ws)},
        setup=_fresh_then("adapter"),
        reason="task is a Llama 3 causal LM on the tiny Hugging Face Llama folder",
    ),
    # Quantized models
    "with shardckpt.lazy_init():": Filler(
        names=lambda ws: {"keras": keras, "shardckpt": shardckpt, "build_model": _build_with_policy},
        setup=lambda ws: (ws.quantized_files(), ws.fresh("q_orbax")),
    ),
    # Convert, inspect, verify
    "shardckpt convert model.keras model_orbax/": _cli(_fresh_then("model_orbax", lambda ws: ws.weights_files())),
    "shardckpt convert model.weights.h5 model_orbax_1x8/ --model mypkg.models:build --mesh 1x8": _cli(
        lambda ws: ws.weights_files()
    ),
    "shardckpt convert model.safetensors.index.json out/ --model model.keras --dtype bfloat16": _cli(
        _fresh_then("out", lambda ws: ws.weights_files())
    ),
    "shardckpt convert m.weights.json out/ --model mypkg.models:build --force": _cli(lambda ws: ws.weights_files()),
    "shardckpt convert hf_llama_folder/ hf_orbax/": _cli(lambda ws: ws.hf_folder()),
    "shardckpt convert llama_preset/ llama_orbax/": _cli(lambda ws: ws.llama_preset()),
    "shardckpt convert llama_preset/ llama_st/ --to safetensors --mesh 2x4": _cli(lambda ws: ws.llama_preset()),
    "shardckpt convert model.keras gs://my-bucket/ckpts/0": _cli(
        lambda ws: (ws.buckets(), ws.fresh("gs://my-bucket/ckpts")), fixtures=("gcs_server", "s3_server")
    ),
    "shardckpt inspect model_orbax/": _cli(_orbax),
    "shardckpt inspect model_orbax/ --json": _cli(_orbax),
    "shardckpt verify model_orbax/": _cli(_orbax),
    "shardckpt plan mypkg.models:build --mesh 2x4 --json": _cli(),
    "python -m shardckpt --version": _cli(),
    # Buckets
    'shardckpt.convert("model.keras", "gs://my-bucket/ckpts/0")': Filler(
        names=lambda ws: {"shardckpt": shardckpt, "model": ws.compiled_model(), "data": _data(ws)},
        setup=lambda ws: (ws.buckets(), ws.fresh("gs://my-bucket/ckpts"), ws.fresh("gs://my-bucket/run")),
        fixtures=("gcs_server", "s3_server"),
        shrink={"save_freq=500)])": "save_freq=2)], steps_per_epoch=2)"},
        reason="2 steps from an endless generator, one save",
    ),
    # Adding a format: the toy format is registered for this module only.
    "class NpzReader:": Filler(
        names=lambda ws: {"model": ws.build_model()},
        setup=lambda ws: ws.request.addfinalizer(lambda: shardckpt.formats.FORMATS.pop("npz", None)),
    ),
}


_RECIPE = """No filler for {piece}.
Register one in tests/test_readme.py (see its docstring):
    FILLERS[{key!r}] = Filler(names=lambda ws: {{...}}, setup=..., shrink={{...}}, reason="...")
naming what the piece uses but does not define, the inputs it reads (a Workspace method)
and any size made tiny."""


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Workspace]:
    root = str(tmp_path_factory.mktemp("readme"))
    before = os.getcwd()
    sys.path.insert(0, root)
    os.chdir(root)
    try:
        yield Workspace(root, request)
    finally:
        os.chdir(before)
        sys.path.remove(root)
        sys.modules.pop("mypkg.models", None)
        sys.modules.pop("mypkg", None)


def _shrunk(piece: Piece, filler: Filler) -> str:
    code = piece.code
    for old, new in filler.shrink.items():
        if piece.kind == "bash":
            # Whole words of the command only.
            pattern = rf"(?<![\w/.-]){re.escape(old)}(?![\w/.-])"
        else:
            pattern = re.escape(old)
        assert re.search(pattern, code), f"{piece}: shrink {old!r} no longer occurs; update its filler"
        code = re.sub(pattern, lambda _m, new=new: new, code, count=1)
    return code


def _run_bash(piece: Piece, command: str, filler: Filler) -> None:
    argv = shlex.split(_strip_comment(command))
    if argv[0] == "shardckpt":
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli_main(argv[1:])
        assert code == filler.exit_code, f"{piece} exited {code}:\n{out.getvalue()}\n{err.getvalue()}"
        return
    if argv[:2] == ["python", "-m"]:
        done = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == filler.exit_code, f"{piece} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        return
    if argv[:2] == ["python3", "tools/run.py"]:
        # tools/run.py re-installs .venv when its stamp is stale (network, minutes):
        # refuse before that, as its own hash says.
        stamp = os.path.join(ROOT, ".venv", ".shardckpt-installed")
        with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f, open(os.path.join(ROOT, "tools", "run.py"), "rb") as g:
            want = hashlib.sha256(f.read() + g.read()).hexdigest()
        current = open(stamp).read() if os.path.exists(stamp) else None
        assert current == want, f"{piece}: .venv is missing or stale; run `python3 tools/run.py test` once first"
        done = subprocess.run(
            [sys.executable if argv[0] == "python3" else argv[0], *argv[1:]],
            cwd=ROOT, capture_output=True, text=True, timeout=300,
        )
        assert done.returncode == filler.exit_code, f"{piece} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        assert "installing" not in done.stdout, f"{piece}: tools/run.py re-installed .venv; run it once first"
        return
    raise AssertionError(f"{piece}: no runner for {argv[0]!r}; add one to _run_bash")


def filler_for(piece: Piece) -> Filler:
    """The piece's filler; FAILS the test with the recipe when there is none."""
    filler = FILLERS.get(piece.key)
    if filler is None:
        pytest.fail(_RECIPE.format(piece=piece, key=piece.key))
    return filler


@pytest.mark.parametrize("piece", pieces(), ids=lambda p: f"L{p.line}")
def test_readme_piece(piece: Piece, workspace: Workspace, request: pytest.FixtureRequest) -> None:
    filler = filler_for(piece)
    for name in filler.fixtures:
        request.getfixturevalue(name)
    filler.setup(workspace)
    code = _shrunk(piece, filler)
    if piece.kind == "bash":
        _run_bash(piece, code, filler)
        return
    namespace = {"__name__": "__readme__", **filler.names(workspace)}
    exec(compile(code, f"README.md:{piece.line}", "exec"), namespace)  # noqa: S102 (the README's own code)


def test_every_filler_is_used() -> None:
    keys = {p.key for p in pieces()}
    stale = sorted(set(FILLERS) - keys)
    assert not stale, f"Fillers for pieces no longer in README.md (remove or re-key them): {stale}"


def test_pieces_cuts_blocks_and_lines() -> None:
    text = "# A\n```python\nimport x\n# c\ny = 1  # one\n```\n## B\n```bash\nshardckpt a  # x\n\nshardckpt b\n```\n```\nnot run\n```\n"
    got = [(p.kind, p.line, p.section, p.key) for p in pieces(text)]
    assert got == [("python", 2, "A", "y = 1"), ("bash", 9, "B", "shardckpt a"), ("bash", 11, "B", "shardckpt b")]


def test_a_piece_without_filler_fails_with_the_recipe() -> None:
    piece = pieces("## New section\n```python\nimport shardckpt\nshardckpt.new_thing(model)\n```\n")[0]
    with pytest.raises(pytest.fail.Exception) as e:
        filler_for(piece)
    message = str(e.value)
    assert "No filler for README.md:2 ('New section') 'shardckpt.new_thing(model)'" in message
    assert "FILLERS['shardckpt.new_thing(model)'] = Filler(" in message
