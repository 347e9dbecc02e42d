"""Ctrl-C twice under torchrun (gloo, 2 CPU ranks, under a wall-clock limit): a terminal sends SIGINT to
the whole foreground group, torchrun's agent then stops its workers with SIGTERM while they save; the
save must survive both (before, only a `.tmp` directory was left)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from megacpp.runtime.checkpoint import list_checkpoints, verify_checkpoint
from tests.helpers import tiny_train_args, write_corpus
from tests.torchrun import ROOT, free_port, torchrun_args, worker_env

pytestmark = pytest.mark.slow


def test_ctrl_c_twice_under_torchrun_still_saves_one_checkpoint_on_every_rank(tmp_path):
    write_corpus(tmp_path / "corpus")
    args = tiny_train_args(tmp_path, tmp_path / "corpus", **{"train.batch_size": "2", "train.steps": "1000",
                                                               "train.ckpt_every": "1000"})
    metrics = tmp_path / "run" / "metrics.jsonl"
    proc = subprocess.Popen([*torchrun_args(2, free_port()), "-m", "megacpp.cli", *args], cwd=ROOT, env=worker_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (metrics.is_file() and '"train"' in metrics.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, "no step was logged"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.3)  # the second Ctrl-C while the ranks finish their step and save
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode != 0
    (ckpt,) = list_checkpoints(tmp_path / "run")
    step = verify_checkpoint(ckpt)["step"]
    assert not list((tmp_path / "run" / "checkpoints").glob("*.tmp")), "no half-written checkpoint left"
    for rank in (0, 1):  # Ctrl-C may land in a step or in an evaluation (every 3 steps), which it cuts short
        assert re.search(rf"\[default{rank}\]:megacpp: interrupted (during the evaluation )?at step {step}; saved "
                         rf"checkpoint {re.escape(str(ckpt))}", out), out[-3000:]
