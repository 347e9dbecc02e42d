"""Run by tests/test_model_prewarm.py in a process of its own (its compiles and caches stay out of the test
process): a toy-width model with every block kind, compiled by blocks with Inductor on CPU. The trainer
starts its model helpers, waits for them here (so the cache is full before its own first compile), then
trains one step and prints its log: how many of the first forward and backward's graphs came from the cache
the helpers filled.

Usage: MEGACPP_CACHE_DIR=DIR python tests/model_prewarm_hits.py ROOT
"""
from __future__ import annotations

import sys
from pathlib import Path

from megacpp.train import loop
from tests.helpers import tiny_train_config, write_corpus


def main() -> None:
    root = Path(sys.argv[1])
    write_corpus(root / "corpus")
    cfg = tiny_train_config(root, root / "corpus", **{
        "compile.mode": "blocks", "compile.backend": "inductor", "compile.model_helper": "on",
        "compile.optimizer_helper": "off", "train.steps": "1", "train.eval_batches": "1",
        "train.sample_tokens": "0"})
    lines: list[str] = []
    trainer = loop.Trainer(cfg, log=lines.append, progress=False)
    for process in trainer.model_prewarm.processes.values():
        process.wait(timeout=900)
    trainer.run()
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
