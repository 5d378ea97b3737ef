"""`export`: a sharded model written as a Hugging Face folder, a keras-hub preset or safetensors."""

from shardckpt.exporting.api import ExportReport, export

__all__ = ["ExportReport", "export"]
