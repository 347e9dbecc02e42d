"""The model's block kinds compiled by helper processes (megacpp.train.model_prewarm, compile.model_helper)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megacpp.presets import preset
from megacpp.train.model_prewarm import FORWARD_READY, ModelPrewarm, model_jobs

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
    found = re.search(r"model compiled beside the trainer by helper processes: (.*); the trainer waited [\d.]+ s "
                      r"for their forwards; the model's graphs from the cache: (\d+) of (\d+)", log)
    assert found, log
    assert re.fullmatch(r"A [\d.]+ s, E [\d.]+ s, M [\d.]+ s, F [\d.]+ s, R [\d.]+ s, loss [\d.]+ s", found[1]), log
    # Each block kind's helper said when its forward graph was in the cache (what the trainer's first forward
    # waits for); the loss helper compiles no block.
    helper_logs = {path.name.split(".")[1]: path.read_text() for path in tmp_path.rglob("model_helper.*.log")}
    assert sorted(helper_logs) == sorted(["A", "E", "M", "F", "R", "loss"]), helper_logs.keys()
    assert all((FORWARD_READY in text) == (kind != "loss") for kind, text in helper_logs.items()), helper_logs
    hits, total = int(found[2]), int(found[3])
    assert hits == total and total >= 12, log  # segments, five kinds, Engram's variant, loss; their backwards


def _prewarm_of(tmp_path: Path, scripts: dict[str, str], first_blocks: dict[str, int]) -> ModelPrewarm:
    """A ModelPrewarm over stand-in helper processes (each runs `scripts[name]`, output to its log)."""
    import tempfile

    processes, logs = {}, {}
    for name, script in scripts.items():
        logs[name] = tmp_path / f"model_helper.{name}.log"
        with open(logs[name], "w") as log:
            processes[name] = subprocess.Popen([sys.executable, "-c", script], stdout=log, stderr=subprocess.STDOUT)
    return ModelPrewarm(processes, logs, tempfile.TemporaryDirectory(), first_blocks)


def test_tier1_the_trainer_waits_for_a_helpers_forward_line_its_exit_or_the_timeout(tmp_path):
    ready_late = (f"import time; print('compiling', flush=True); time.sleep(1.0); "
                  f"print({FORWARD_READY!r}, flush=True); time.sleep(60)")
    prewarm = _prewarm_of(tmp_path, {"A": ready_late, "E": "import time; time.sleep(0.5)",
                                     "M": "import time; time.sleep(60)"}, {"A": 0, "E": 1, "M": 2})
    try:
        waited = prewarm.wait_for_forward("A", timeout_s=60)
        assert 0.8 <= waited < 30 and prewarm.processes["A"].poll() is None  # the line, not the exit, ended it
        # ended without the line
        assert prewarm.wait_for_forward("E", timeout_s=60) < 30 and prewarm.processes["E"].poll() == 0
        assert 0.3 <= prewarm.wait_for_forward("M", timeout_s=0.3) < 10  # neither: the timeout
    finally:
        prewarm.stop()
    assert all(process.poll() is not None for process in prewarm.processes.values())


def test_tier1_each_jobs_first_block_waits_once_before_its_forward_and_no_longer_after_stop(tmp_path):
    import torch
    from torch import nn

    calls: list[str] = []

    class Recording(nn.Module):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

        def forward(self, x):
            calls.append(f"forward {self.name}")
            return x

    blocks = nn.ModuleList([Recording(f"block{i}") for i in range(4)])
    prewarm = _prewarm_of(tmp_path, {"A": "pass", "E": "pass"}, {"A": 0, "E": 2})
    prewarm.wait_for_forward = lambda name, timeout_s=0.0: calls.append(f"wait {name}") or 1.5
    prewarm.attach(blocks)
    x = torch.zeros(2)
    for _ in range(2):
        for block in blocks:
            block(x)
    assert calls == ["wait A", "forward block0", "forward block1", "wait E", "forward block2", "forward block3",
                     "forward block0", "forward block1", "forward block2", "forward block3"]
    assert prewarm.waited_s == {"A": 1.5, "E": 1.5}
    assert "the trainer waited 3.0 s for their forwards" in prewarm.outcome()
    assert all(not block._forward_pre_hooks for block in blocks)  # the hooks left with the helpers
