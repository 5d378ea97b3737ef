"""Every use of Orbax internals, in one place: the upgrade surface behind the Orbax pin.

shardckpt uses Orbax's public API (`orbax.checkpoint.experimental.v1`,
`type_handlers`) wherever one exists. What is here has none:

- `sharding` metadata (formats.orbax.writer): the `_sharding` file Orbax
  writes beside an array tree, in Orbax's own serialized form, so that
  Orbax and Keras restore our steps with the shardings they were saved with.
- `preservation_policy.PreservationContext` (training.bucket_save): the
  argument of a `PreservationPolicy.should_preserve` call; the bucket
  checkpointer applies Keras' / Orbax's retention policies itself, as
  Orbax's `Checkpointer` does for local folders.
"""

from __future__ import annotations

from orbax.checkpoint._src.checkpoint_managers import preservation_policy
from orbax.checkpoint._src.metadata import sharding as sharding_metadata

__all__ = ["preservation_policy", "sharding_metadata"]
