"""Conversions that combine the layers below: `convert(src, dst, to=...)` (the CLI's `--to`)."""

from shardckpt.pipeline.route import TARGETS, convert

__all__ = ["TARGETS", "convert"]
