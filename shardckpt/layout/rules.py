"""User layout rules as data: regex on a variable path -> mesh axes per dimension.

The same data a `keras.distribution.LayoutMap` holds, with the same
matching (`re.fullmatch` on `variable.path`). Rules override the automatic
plan; a variable no rule matches keeps its automatic placement.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
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


def rule_problems(rules: list[tuple[re.Pattern, Axes]], paths: Sequence[str]) -> list[str]:
    """Rules that place no variable of `paths`, one line each (empty: every rule places one).

    A rule that matches no path, and one whose every match an earlier rule
    takes (first match wins), change nothing: most likely a typo or rules in
    the wrong order, which would otherwise leave the automatic placement in
    force without a word.
    """
    matched: list[list[str]] = [[] for _ in rules]
    won = [False] * len(rules)
    taken_by: list[str | None] = [None] * len(rules)
    for path in paths:
        first = None
        for i, (regex, _) in enumerate(rules):
            if regex.fullmatch(path):
                matched[i].append(path)
                if first is None:
                    first = i
                    won[i] = True
                elif taken_by[i] is None:
                    taken_by[i] = rules[first][0].pattern
    problems = []
    for i, (regex, _) in enumerate(rules):
        if not matched[i]:
            example = f" (e.g. {paths[0]!r})" if paths else ""
            problems.append(
                f"layout rule {regex.pattern!r} matches no variable path{example}: it places nothing "
                "(rules match the whole path, re.fullmatch). Fix: correct the pattern or drop it."
            )
        elif not won[i]:
            problems.append(
                f"layout rule {regex.pattern!r} never applies: every variable it matches ({len(matched[i])}, "
                f"e.g. {matched[i][0]!r}) is placed by an earlier rule ({taken_by[i]!r}; the first match wins). "
                "Fix: put it before that rule or narrow the earlier one."
            )
    return problems
