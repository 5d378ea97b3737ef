"""Files: `convert` to Orbax, `verify` checksums (`integrity`), `inspect` a checkpoint (`info`).

`boxes` cuts arrays into the C-order pieces convert and verify stream;
`architecture` builds a model from `--model package.module:fn` or a `.keras`
file for the formats that do not name their variables' roles.
"""

from shardckpt.conversion.converter import ConvertReport, convert
from shardckpt.conversion.info import CheckpointInfo, inspect
from shardckpt.conversion.integrity import VerifyReport, verify

__all__ = ["CheckpointInfo", "ConvertReport", "VerifyReport", "convert", "inspect", "verify"]
