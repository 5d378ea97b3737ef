"""`python -m shardckpt.cli`, the same as the `shardckpt` command."""

import sys

from shardckpt.cli.main import main

sys.exit(main())
