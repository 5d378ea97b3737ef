"""Natural order of names: `dense_2` before `dense_10`, as people count.

Every table and list shardckpt prints sorts keys with `natural_key`, so a
model's layers appear in the order they were numbered, not as strings sort.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_DIGITS = re.compile(r"(\d+)")


def natural_key(text: str) -> list[str | int]:
    """A sort key that compares runs of digits as numbers.

    `re.split` with a capturing group alternates text and digits, starting
    with text (maybe empty), so the key compares str with str and int with
    int at every position.
    """
    return [int(part) if i % 2 else part for i, part in enumerate(_DIGITS.split(text))]


def natural_sorted(items: Iterable[str]) -> list[str]:
    """`sorted(items)` in natural order."""
    return sorted(items, key=natural_key)
