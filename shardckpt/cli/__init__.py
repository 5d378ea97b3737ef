"""The `shardckpt` command: convert | inspect | verify | plan | demo."""

from shardckpt.cli.main import main

__all__ = ["main"]
