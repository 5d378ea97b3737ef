"""User layout rules as data: regex on a variable path -> mesh axes per dimension.

The same data a `keras.distribution.LayoutMap` holds, with the same
matching (`re.fullmatch` on `variable.path`). Rules override the automatic
plan; a variable no rule matches keeps its automatic placement.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, TypeAlias

from keras import distribution as kd

from shardckpt.errors import LayoutError

Axes = tuple[str | None, ...]
# Explicit alias: `kd.LayoutMap` comes from untyped Keras, so mypy would not infer one.
RulesLike: TypeAlias = Mapping[str, Any] | Iterable[tuple[str, Any]] | kd.LayoutMap | None


def normalize_rules(rules: RulesLike) -> list[tuple[re.Pattern, Axes]]:
    """Compiles `rules` into an ordered list of `(pattern, axes)`.

    Example:

    ```python
    normalize_rules({r".*embeddings": ("model", None), r".*bias": (None,)})
    ```

    Args:
        rules: A mapping or pairs of `regex -> axes` (a tuple of mesh axis
            names or None per dimension, as `LayoutMap` takes), or a
            `keras.distribution.LayoutMap`. None: no rules.

    Returns:
        The compiled rules in their given order (the first match wins).

    Raises:
        LayoutError: A pattern does not compile, or its axes are not a tuple
            of strings and None.
    """
    if rules is None:
        return []
    if isinstance(rules, kd.LayoutMap):
        items = [(key, rules[key].axes) for key in rules]
    elif isinstance(rules, Mapping):
        items = list(rules.items())
    else:
        items = list(rules)
    compiled = []
    for pattern, axes in items:
        try:
            regex = re.compile(pattern)
        except re.error as err:
            raise LayoutError(
                f"Layout rule {pattern!r} is not a valid regular expression ({err}). "
                f"Fix: escape literal dots and brackets, e.g. re.escape(path). Received: rule={pattern!r}"
            ) from err
        if isinstance(axes, kd.TensorLayout):
            axes = axes.axes
        if not isinstance(axes, (tuple, list)) or not all(a is None or isinstance(a, str) for a in axes):
            raise LayoutError(
                f"Layout rule {pattern!r} must map to a tuple of mesh axis names or None, "
                f"one per variable dimension, e.g. (None, 'model'). Received: axes={axes!r}"
            )
        compiled.append((regex, tuple(axes)))
    return compiled


def match_rule(rules: list[tuple[re.Pattern, Axes]], path: str) -> tuple[str, Axes] | None:
    """The first rule whose pattern fully matches `path`, as `(pattern, axes)`."""
    for regex, axes in rules:
        if regex.fullmatch(path):
            return regex.pattern, axes
    return None
