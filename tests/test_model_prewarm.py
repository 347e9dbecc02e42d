"""The model's block kinds compiled by helper processes (megacpp.train.model_prewarm, compile.model_helper)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megacpp.presets import preset
from megacpp.train.model_prewarm import model_jobs

REPO = Path(__file__).resolve().parents[1]


def test_one_job_per_block_kind_with_all_its_blocks_and_one_for_the_loss():
    import torch

    from megacpp.model.hybrid import HybridLM

    cfg = preset("small")
    with torch.device("meta"):
        model = HybridLM(cfg.model)
    jobs = model_jobs(model, cfg.compile, False, "none", torch.device("cpu"), batch=8, seq_len=2048)
    layout = [block.kind for block in model.blocks]
    assert list(jobs) == [*dict.fromkeys(layout), "loss"]
    for kind in dict.fromkeys(layout):
        assert jobs[kind].blocks == tuple(i for i, k in enumerate(layout) if k == kind) and not jobs[kind].loss
    assert jobs["loss"].blocks == () and jobs["loss"].loss
    assert (jobs["loss"].batch, jobs["loss"].seq_len) == (8, 2048)


@pytest.mark.parametrize(("mode", "strategy", "ep", "retry", "local_rank", "reason"), [
    ("blocks", "single process", 1, False, 0, None),
    ("blocks", "replicate", 1, False, 0, None),
    ("blocks", "replicate", 1, False, 1, "local rank 0's helpers fill this host's compile cache"),
    ("model", "single process", 1, False, 0, "compile.mode is model, not blocks"),
    ("none", "single process", 1, False, 0, "compile.mode is none, not blocks"),
    ("blocks", "fsdp", 1, False, 0, "fsdp wraps the blocks in other graphs"),
    ("blocks", "replicate", 2, False, 0, "expert parallelism wraps the blocks in other graphs"),
    ("blocks", "single process", 1, True, 0, "an auto-fit retry (memory is tight there)"),
])
def test_the_helpers_start_only_where_the_trainer_compiles_plain_blocks(mode, strategy, ep, retry, local_rank,
                                                                         reason):
    from megacpp.compile.config import CompileConfig
    from megacpp.train.model_prewarm import skip_reason

    assert skip_reason(CompileConfig(mode=mode), strategy, ep, retry, local_rank) == reason


@pytest.mark.slow
def test_tier1_the_helpers_graphs_are_the_ones_the_first_step_compiles(tmp_path):
    """With the helpers done before the trainer's first compile, every graph of its first forward and
    backward (the segments, each block kind, the loss, their backward graphs) comes from the cache they
    filled: a graph of theirs that differed from the trainer's in any input's layout would be a miss."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), MEGACPP_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    done = subprocess.run([sys.executable, str(REPO / "tests" / "model_prewarm_hits.py"), str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=1500, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = done.stdout
    assert "model helper: compiling A, E, M, F, R, loss beside the trainer" in log, log
    found = re.search(r"model compiled beside the trainer by helper processes: (.*); the model's graphs from the "
                      r"cache: (\d+) of (\d+)", log)
    assert found, log
    assert re.fullmatch(r"A [\d.]+ s, E [\d.]+ s, M [\d.]+ s, F [\d.]+ s, R [\d.]+ s, loss [\d.]+ s", found[1]), log
    hits, total = int(found[2]), int(found[3])
    assert hits == total and total >= 12, log  # segments, five kinds, Engram's variant, loss; their backwards
