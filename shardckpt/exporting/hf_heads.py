"""A keras-hub task's head as the tensors of the matching Hugging Face head class.

A causal LM's head is its backbone's (`lm_head.weight` when the embeddings
are untied: keras-hub's converters map it with the backbone), so its
export only names the class (`architectures`). A task with variables
outside its backbone (a classifier's `logits` layer) needs a head map: the
Hugging Face class, the prefix that class puts before the base model's
tensors (`bert.`), the config keys of the head (`id2label`, ...) and a
`convert_head(task, loader, config)` in keras-hub's converter interface
(as keras-hub's own image-classifier converters have), run against
`formats.hf_record.RecordingLoader` like every converter export inverts.
A task variable no head map places is an error naming it: never dropped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from shardckpt.errors import UnsupportedModelError


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadMap:
    """How a task's head is stored by its Hugging Face class.

    Attributes:
        architecture: The Hugging Face class (`architectures[0]`).
        prefix: Put before the backbone's tensor names (the class's
            `base_model_prefix` and a dot), "" when the names already carry it.
        shapes: `{Hugging Face key: shape}` of the head's tensors.
        convert_head: `(task, loader, config)`, keras-hub's converter
            interface: ports each head variable from its tensor.
        config: Keys added to `config.json`.
    """

    architecture: str
    prefix: str
    shapes: dict[str, tuple[int, ...]]
    convert_head: Callable[[Any, Any, dict[str, Any]], None]
    config: dict[str, Any]


def _labels(num: int) -> dict[str, Any]:
    # transformers' own defaults for a config with num_labels=n (PretrainedConfig).
    id2label = {str(i): f"LABEL_{i}" for i in range(num)}
    return {"id2label": id2label, "label2id": {v: int(k) for k, v in id2label.items()}}


def _bert_classifier(task: Any) -> HeadMap:
    """`BertTextClassifier` as `BertForSequenceClassification`: pooler -> dropout -> classifier."""
    import keras

    if keras.activations.serialize(task.activation) not in (None, "linear"):
        raise UnsupportedModelError(
            f"{type(task).__name__} has activation={keras.activations.serialize(task.activation)!r} on its "
            "logits; BertForSequenceClassification returns logits without one. Fix: build the classifier "
            "with activation=None (the default) to export it, or export model.backbone."
        )
    dense = task.output_dense
    units, hidden = int(dense.kernel.shape[1]), int(dense.kernel.shape[0])

    def convert_head(task: Any, loader: Any, config: dict[str, Any]) -> None:
        loader.port_weight(task.output_dense.kernel, "classifier.weight",
                           hook_fn=lambda t, _: np.transpose(t, axes=(1, 0)))
        loader.port_weight(task.output_dense.bias, "classifier.bias")

    return HeadMap(
        architecture="BertForSequenceClassification", prefix="bert.",
        shapes={"classifier.weight": (units, hidden), "classifier.bias": (units,)},
        convert_head=convert_head,
        config={**_labels(units), "classifier_dropout": float(task.dropout)},
    )


# Task class name (keras-hub's) -> its head map. Looked up along the task's MRO.
HEADS: dict[str, Callable[[Any], HeadMap]] = {
    "BertTextClassifier": _bert_classifier,
}


def head_variables(task: Any) -> list[Any]:
    """The task's weights outside its backbone."""
    inside = {id(v) for v in task.backbone.weights}
    return [v for v in task.weights if id(v) not in inside]


def head_map(task: Any) -> HeadMap | None:
    """The head map of `task`; None when it has no variables outside its backbone.

    Raises:
        UnsupportedModelError: head variables and no map for the class,
            naming the variables.
    """
    extra = head_variables(task)
    if not extra:
        return None
    for cls in type(task).__mro__:
        make = HEADS.get(cls.__name__)
        if make is not None:
            return make(task)
    raise UnsupportedModelError(
        f"{type(task).__name__}: no Hugging Face head class is mapped for this task, so its variables "
        f"{[v.path for v in extra][:6]} have no place in format='hf' (mapped: {', '.join(sorted(HEADS))}, "
        "and causal LMs). Fix: export model.backbone (the head is then left out), or format='keras-hub' / "
        "'safetensors', which keep every variable."
    )
