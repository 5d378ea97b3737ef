"""The Hugging Face `config.json` of a keras-hub backbone.

Two sources, both keras-hub's:

1. keras-hub's own exporter config (`export/hf_exporter.MODEL_CONFIGS`)
   where it has one for the backbone's class;
2. otherwise the inverse of keras-hub's converter config
   (`convert_<arch>.convert_backbone_config`): the converter is run on a
   probe whose values are marks (`_Mark`), so each Keras argument it returns
   names the Hugging Face key it came from (and a factor, for `* 2` or
   `// 2`); a truth test or an equality of two marks branches (both ways
   are tried). A candidate is kept only if the converter, run on it for
   real, gives back the backbone's own arguments: the inverse is checked,
   not assumed.

Either source is checked that way, so a keras-hub exporter config that
would not read back as this backbone (keras-hub 0.32 writes `model_type:
gemma` for a Gemma 2 backbone) is not used.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardckpt import userwarn
from shardckpt.errors import UnsupportedModelError
from shardckpt.formats import hf_carried


class _Branch(Exception):  # noqa: N818 (control flow, never escapes this module)
    def __init__(self, key: str, options: list[Any]) -> None:
        super().__init__(key)
        self.key, self.options = key, options


class _Mark:
    """A Hugging Face config value, known only by its key (and a factor)."""

    def __init__(self, key: str, scale: float = 1.0) -> None:
        self.key, self.scale = key, scale

    def __mul__(self, k: Any) -> _Mark:
        if isinstance(k, (int, float)) and not isinstance(k, bool):
            return _Mark(self.key, self.scale * k)
        raise _Branch(self.key, [])

    __rmul__ = __mul__

    def __floordiv__(self, k: Any) -> _Mark:
        if isinstance(k, int) and not isinstance(k, bool):
            return _Mark(self.key, self.scale / k)
        raise _Branch(self.key, [])

    def __bool__(self) -> bool:
        raise _Branch(self.key, [True, False])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _Mark) and (other.key, other.scale) == (self.key, self.scale):
            return True
        raise _Branch(self.key, [("alias", other.key)] if isinstance(other, _Mark) else [])

    __hash__ = object.__hash__

    def __getitem__(self, item: Any) -> Any:
        raise _Branch(self.key, [None])


class _Probe(dict):
    """A config dict whose unknown keys read as marks."""

    def __init__(self, fixed: Mapping[str, Any]) -> None:
        super().__init__()
        self.fixed = dict(fixed)

    def __getitem__(self, key: str) -> Any:
        if key in self.fixed:
            value = self.fixed[key]
            if isinstance(value, tuple) and value[:1] == ("alias",):
                return _Mark(value[1])
            if value is _ABSENT:
                raise KeyError(key)
            return value
        return _Mark(key)

    def get(self, key: str, default: Any = None) -> Any:
        if key in self.fixed:
            return default if self.fixed[key] is _ABSENT else self[key]
        if isinstance(default, (dict, list)):
            return default  # a nested structure (rope_parameters): its absence is the common case
        return _Mark(key)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str) and key in self.fixed:
            return self.fixed[key] is not _ABSENT
        raise _Branch(str(key), [_ABSENT])


_ABSENT = object()

_REJECTED = (LookupError, TypeError, ValueError, AttributeError, ArithmeticError)
"""What a converter raises on a config it cannot read: a missing key, a guessed
value of the wrong type (a bool where it calls `.get`), a value out of range.
Anything else (a NameError, an ImportError, a RuntimeError) is a bug in the
converter or here, and propagates."""


def _invert(output: Mapping[str, Any], fixed: Mapping[str, Any], keras: Mapping[str, Any]) -> dict[str, Any] | None:
    hf: dict[str, Any] = {k: v for k, v in fixed.items() if v is not _ABSENT and not isinstance(v, tuple)}
    for name, value in output.items():
        if isinstance(value, _Mark):
            if name not in keras:
                # An argument the backbone does not take (keras-hub's Qwen
                # converter passes `use_sliding_window`; QwenBackbone drops
                # it): its value changes nothing here. A `use_*` switch the
                # backbone lacks is off; anything else unknown is null.
                hf.setdefault(value.key, False if value.key.startswith("use_") else None)
                continue
            v = keras[name]
            if value.scale != 1.0:
                if not isinstance(v, (int, float)):
                    return None
                v = v / value.scale
                v = int(v) if float(v).is_integer() else v
            hf[value.key] = v
    for k, v in fixed.items():
        if isinstance(v, tuple) and v[:1] == ("alias",):
            if v[1] not in hf:
                return None
            hf[k] = hf[v[1]]
    return hf


def _read(converter: Any, hf: Mapping[str, Any], own: bool) -> dict[str, Any] | None:
    """The backbone arguments `hf` is read as: keras-hub's converter's
    reading, plus (unless `own`) the keys it leaves unread (`hf_carried`),
    as `shardckpt.from_preset` reads a folder. None: the converter rejects it."""
    try:
        got = dict(converter.convert_backbone_config(dict(hf)))
    except _REJECTED:  # a candidate the converter rejects is simply not it
        return None
    if not own:
        got.update(hf_carried.read(hf))
    return got


def _differences(converter: Any, hf: Mapping[str, Any], keras: Mapping[str, Any], *, own: bool = False
                 ) -> dict[str, tuple[Any, Any]] | None:
    """`{argument: (backbone's value, value read back)}` where `hf` reads back as
    another model (None: the converter rejects `hf`).

    An argument the reading does not set must be the backbone's default
    (keras-hub builds with the default), so a config that reads back as a
    different model (Gemma for a Gemma 2 backbone) differs.
    """
    got = _read(converter, hf, own)
    if got is None:
        return None
    out = {k: (keras[k], v) for k, v in got.items() if k in keras and not _same(keras[k], v)}
    defaults = getattr(keras, "defaults", {})
    # A default of None the backbone stores as [] (Qwen3-MoE's mlp_only_layers) is no change.
    out.update({k: (keras[k], d) for k, d in defaults.items() if k not in got and k in keras and not _same(keras[k], d)})
    return out


def _reads_back(converter: Any, hf: Mapping[str, Any], keras: Mapping[str, Any]) -> bool:
    """True if `hf` reads back as the backbone's arguments, all of them."""
    return _differences(converter, hf, keras) == {}


def _same(value: Any, default: Any) -> bool:
    return bool(value == default) or (default is None and isinstance(value, (list, tuple, dict)) and not value)


def _with_carried(hf: Mapping[str, Any], keras: Mapping[str, Any]) -> dict[str, Any]:
    """`hf` with the keys keras-hub's converter leaves unread set from the backbone
    (where the config has the key, or the argument is not its default)."""
    out = {**hf, **hf_carried.FIXED.get(str(hf.get("model_type")), {})}
    defaults = getattr(keras, "defaults", {})
    for argument, key in hf_carried.carried(out.get("model_type")).items():
        if argument in keras and (key in out or not _same(keras[argument], defaults.get(argument))):
            out[key] = keras[argument]
    return out


def inverse(converter: Any, model_type: str, keras: Mapping[str, Any],
            tried: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """A Hugging Face config the converter turns into `keras` (the backbone's arguments).

    Args:
        converter: keras-hub's converter module.
        model_type: The config's `model_type`.
        keras: The backbone's arguments.
        tried: If given, every candidate the converter accepted is appended
            (for the error when none reads back).
    """
    carried = set(hf_carried.carried(model_type))
    pending: list[dict[str, Any]] = [{"model_type": model_type}]
    for _ in range(64):  # each branch fixes one key; configs read a few dozen at most
        if not pending:
            return None
        fixed = pending.pop(0)
        try:
            output = converter.convert_backbone_config(_Probe(fixed))
        except _Branch as b:
            pending.extend({**fixed, b.key: option} for option in b.options)
            continue
        except _REJECTED:  # this branch's guess made the converter fail
            continue
        # An argument a carried key holds is not inverted through the
        # converter's reading (GPT-2's intermediate_dim is not 4 x n_embd).
        hf = _invert({k: v for k, v in output.items() if k not in carried}, fixed, keras)
        if hf is None:
            continue
        hf = _with_carried(hf, keras)
        if _reads_back(converter, hf, keras):
            return hf
        if tried is not None:
            tried.append(hf)
    return None


def hf_config(backbone: Any, converter: Any, model_types: list[str]) -> dict[str, Any]:
    """The `config.json` for `backbone` (keras-hub's exporter's, else the converter's inverse).

    Both are completed with the keys keras-hub's converter leaves unread
    (`hf_carried`). A config that keras-hub's own importer would read as
    another model (a GPT-2 `n_inner` other than 4 x `n_embd`) is written,
    with a warning naming what keras-hub's `from_preset` would get wrong.

    Raises:
        UnsupportedModelError: no config reads back as this backbone; names
            the arguments no Hugging Face config of the architecture holds.
    """
    keras = _arguments(backbone)
    from shardckpt import _keras_hub

    name = type(backbone).__name__
    tried: list[dict[str, Any]] = []
    exporter = _keras_hub.exporter_config(backbone)
    found = None
    if exporter is not None:
        exporter = _with_carried(exporter, keras)
        if _reads_back(converter, exporter, keras):
            found = exporter
        else:
            tried.append(exporter)
    for model_type in model_types if found is None else ():
        found = inverse(converter, model_type, keras, tried)
        if found is not None:
            break
    if found is not None:
        own = _differences(converter, found, keras, own=True)
        if own:
            keys = hf_carried.carried(found.get("model_type"))
            userwarn.warn(
                f"{name}: config.json holds {_listed(own, keys)}, as transformers and "
                "shardckpt.from_preset read it; keras-hub's own from_preset (0.32) leaves "
                f"{', '.join(sorted({keys.get(k, k) for k in own}))} unread and would build "
                + ", ".join(f"{k}={got!r}" for k, (_, got) in sorted(own.items()))
                + " from this folder."
            )
        return found
    differences = [d for d in (_differences(converter, hf, keras) for hf in tried) if d]
    why = ""
    if differences:
        closest = min(differences, key=len)
        why = (" No Hugging Face config of this architecture holds "
               + ", ".join(f"{k}={want!r} (it reads back as {got!r})" for k, (want, got) in sorted(closest.items()))
               + ".")
    raise UnsupportedModelError(
        f"{name}: no Hugging Face config reads back as this backbone through keras-hub's converter "
        f"(model_type {', '.join(model_types)}).{why} Fix: export with format='keras-hub' or "
        "format='safetensors'."
    )


def _listed(differences: Mapping[str, tuple[Any, Any]], keys: Mapping[str, str]) -> str:
    return ", ".join(f"{keys.get(k, k)}={want!r} ({k})" for k, (want, _) in sorted(differences.items()))


class _Arguments(dict):
    """The backbone's config, and for arguments it leaves out (keras-hub's
    Llama3 `tie_word_embeddings`), the backbone's attribute of that name."""

    def __init__(self, backbone: Any) -> None:
        import inspect

        super().__init__(backbone.get_config())
        self._backbone = backbone
        params = inspect.signature(type(backbone).__init__).parameters.values()
        self.defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty
                         and p.name not in ("dtype", "name", "trainable")}

    def __contains__(self, key: object) -> bool:
        return super().__contains__(key) or (isinstance(key, str) and (hasattr(self._backbone, key) or key in self.defaults))

    def __getitem__(self, key: str) -> Any:
        if super().__contains__(key):
            return super().__getitem__(key)
        if hasattr(self._backbone, key):
            return getattr(self._backbone, key)
        return self.defaults[key]  # an argument get_config leaves out: the default it was built with


def _arguments(backbone: Any) -> Mapping[str, Any]:
    return _Arguments(backbone)


# transformers' class of a causal LM per model_type: keras-hub's task loader
# reads `architectures[0]`, which keras-hub's exporter configs and converter
# inverses do not always carry. Written for tasks only, when missing.
CAUSAL_LM_ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
    "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "phi3": "Phi3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}


def task_architectures(config: Mapping[str, Any], task: Any) -> list[str] | None:
    """`architectures` for a task's config.json when the config lacks it (None: keep as is)."""
    if "architectures" in config:
        return None
    from keras_hub.models import CausalLM

    if isinstance(task, CausalLM) and config.get("model_type") in CAUSAL_LM_ARCHITECTURES:
        return [CAUSAL_LM_ARCHITECTURES[str(config["model_type"])]]
    return None
