"""One torchrun "node" of a two-host test: `megacpp <args>` with ``--data.cache_dir @node`` replaced by
a cache private to this node (``<run dir's parent>/node<N>-cache``, N from $TEST_NODE_INDEX)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from megacpp.cli import main

if __name__ == "__main__":
    args = sys.argv[1:]
    out_dir = Path(args[args.index("--train.out_dir") + 1])
    node_cache = str(out_dir.parent / f"node{os.environ['TEST_NODE_INDEX']}-cache")
    sys.exit(main([node_cache if a == "@node" else a for a in args]))
