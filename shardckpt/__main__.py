"""`python -m shardckpt`: the `shardckpt` command."""

import sys

from shardckpt.cli.main import main

sys.exit(main())
