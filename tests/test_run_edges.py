"""The single-process edges of a run (issue 39): each ends in one line and a non-zero exit, never a
traceback, and loses nothing on disk. A diverged run leaves its last healthy checkpoint as the one to
resume from; a run with nothing to resume starts over keeping the old run's files aside."""
from __future__ import annotations

from pathlib import Path

import torch

from megacpp.cli import main
from megacpp.runtime.checkpoint import list_checkpoints, verify_checkpoint
from megacpp.train.loop import Trainer
from tests.helpers import tiny_train_args


def _train(tmp_path: Path, corpus: Path, *extra: str, **overrides: str) -> int:
    return main([*tiny_train_args(tmp_path, corpus, **overrides), *extra])


def _one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_divergence_sets_its_ruined_checkpoints_aside_and_resume_continues_from_the_last_healthy_one(
        tmp_path, small_corpus, monkeypatch, capsys):
    """Step 3 ruins the weights (head weights of +-1e4): steps 4-6 lose far above chance and the run stops
    at step 6. Checkpoints 3-5 hold those weights; with keep_last 2, 2 is the healthy one that must
    survive pruning and become the resume point."""
    original = Trainer.train_step

    def ruin_after_step_three(self: Trainer) -> float:
        loss = original(self)
        if self.step == 2:  # the step just run is step 3
            with torch.no_grad():
                head = self.model.lm_head.weight
                head.copy_(torch.randn(head.shape, generator=torch.Generator().manual_seed(0)).sign() * 1e4)
        return loss

    monkeypatch.setattr(Trainer, "train_step", ruin_after_step_three)
    run = tmp_path / "run"
    settings = {"train.steps": "8", "train.ckpt_every": "1", "train.keep_last": "2", "train.eval_every": "8"}
    assert _train(tmp_path, small_corpus, **settings) == 1
    line = _one_line_error(capsys.readouterr().err)
    assert "step 6: loss" in line and "training diverged" in line, line
    assert ("set aside as step_00000003.diverged, step_00000004.diverged, step_00000005.diverged" in line), line
    assert f"--resume continues from {run / 'checkpoints' / 'step_00000002'}, the last healthy checkpoint" in line
    assert [p.name for p in list_checkpoints(run)] == ["step_00000002"]
    for step in (3, 4, 5):  # set aside, not deleted: each still verifies
        verify_checkpoint(run / "checkpoints" / f"step_{step:08d}.diverged")

    monkeypatch.setattr(Trainer, "train_step", original)
    assert _train(tmp_path, small_corpus, "--resume", **settings) == 0
    out = capsys.readouterr().out
    assert f"resumed from {run / 'checkpoints' / 'step_00000002'} at step 2" in out
    assert [p.name for p in list_checkpoints(run)][0] == "step_00000008"
