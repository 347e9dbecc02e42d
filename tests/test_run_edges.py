"""The single-process edges of a run (issue 39): each ends in one line and a non-zero exit, never a
traceback, and loses nothing on disk. A diverged run leaves its last healthy checkpoint as the one to
resume from; a run with nothing to resume starts over keeping the old run's files aside."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from megacpp.cli import main
from megacpp.errors import MegacppError
from megacpp.runtime.checkpoint import list_checkpoints, verify_checkpoint
from megacpp.train.autofit.supervisor import explained_error
from megacpp.train.loop import Trainer
from megacpp.train.metrics import read_metrics
from megacpp.train.rundir import LOCK_NAME
from tests.helpers import tiny_train_args
from tests.torchrun import python, worker_env


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


def _files(root: Path) -> dict[str, bytes]:
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}


def test_the_same_command_after_a_run_that_failed_before_its_first_checkpoint_starts_over(
        tmp_path, small_corpus, monkeypatch, capsys):
    """Before, the failed run's metrics.jsonl made the same command refuse ("already holds a run") although
    nothing could be resumed. Now it starts over and keeps the old run's files aside, byte for byte."""
    original = Trainer.train_step

    def fail_in_step_two(self: Trainer) -> float:
        if self.step == 1:
            raise MegacppError("injected failure in step 2")
        return original(self)

    monkeypatch.setattr(Trainer, "train_step", fail_in_step_two)
    settings = {"train.steps": "2", "train.ckpt_every": "2"}
    assert _train(tmp_path, small_corpus, **settings) == 1
    assert "injected failure in step 2" in _one_line_error(capsys.readouterr().err)
    run = tmp_path / "run"
    assert not list_checkpoints(run) and (run / "metrics.jsonl").stat().st_size > 0
    before = {name: data for name, data in _files(run).items() if name != LOCK_NAME}

    monkeypatch.setattr(Trainer, "train_step", original)
    assert _train(tmp_path, small_corpus, **settings) == 0
    out, err = capsys.readouterr()
    (previous,) = run.glob("previous-*")
    assert (f"train.out_dir {run} holds a run with no checkpoint to resume from (metrics.jsonl): starting over; "
            f"its files moved to {previous}") in out
    assert "Traceback" not in out + err
    assert _files(previous) == before
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"] == [1, 2]


def test_resume_with_no_usable_checkpoint_says_so_and_starts_metrics_over(tmp_path, small_corpus, capsys):
    """Before, it started from step 0 and appended to the old metrics (steps 1, 2 then 1, 2 again)."""
    settings = {"train.steps": "2", "train.ckpt_every": "1", "train.eval_every": "2"}
    assert _train(tmp_path, small_corpus, **settings) == 0
    run = tmp_path / "run"
    for checkpoint in list_checkpoints(run):
        (checkpoint / "model.safetensors").write_bytes(b"broken")
    before = _files(run)
    capsys.readouterr()

    assert _train(tmp_path, small_corpus, "--resume", **settings) == 0
    out, err = capsys.readouterr()
    (previous,) = run.glob("previous-*")
    assert (f"--resume: none of the 2 checkpoints verifies under {run / 'checkpoints'}; starting from step 0; "
            f"the old metrics.jsonl and checkpoints moved to {previous}") in out
    assert "Traceback" not in out + err
    assert _files(previous) == {name: data for name, data in before.items()
                                if name == "metrics.jsonl" or name.startswith("checkpoints/")}
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"] == [1, 2]
    assert (run / "metrics.jsonl").read_text().count('"kind": "train"') == 2


def test_a_cuda_device_on_a_machine_without_cuda_is_said_once_through_the_autofit_supervisor(tmp_path, small_corpus):
    """`cuda:0` starts the auto-fit supervisor, whose child refuses the device; before, the supervisor
    printed the child's one line again below it."""
    launch = python(["-m", "megacpp.cli", *tiny_train_args(tmp_path, small_corpus, **{"train.device": "cuda:0"})],
                    timeout=120, env=worker_env({"CUDA_VISIBLE_DEVICES": ""}))
    assert launch.returncode == 2, launch.output
    assert "Traceback" not in launch.output
    said = [line for line in launch.output.splitlines() if "cuda:0" in line]
    assert len(said) == 1 and said[0].startswith("megacpp: config error: train.device = 'cuda:0' but torch"), said
    assert " sees no CUDA device" in said[0]
    assert not list_checkpoints(tmp_path / "run")


def test_the_supervisor_still_shows_a_crashed_childs_tail():
    explained = ["corpus ...", "megacpp: error: step 2: loss is nan; ..."]
    assert explained_error(1, explained)
    assert not explained_error(1, ["Traceback (most recent call last):", "megacpp: error: a line after it"])
    assert not explained_error(1, ["RuntimeError: injected crash in step 2"])
    assert not explained_error(137, explained)  # killed: the line was not its last word


def test_a_host_out_of_memory_error_is_one_line_and_keeps_the_checkpoints(tmp_path, small_corpus):
    """The host allocator's error is a plain RuntimeError, which printed a traceback before."""
    hooks = Path(__file__).resolve().parent / "hooks"
    env = worker_env({"MEGACPP_TEST_HOST_OOM_AT_STEP": "3"})
    env["PYTHONPATH"] = f"{hooks}{os.pathsep}{env['PYTHONPATH']}"
    args = tiny_train_args(tmp_path, small_corpus, **{"train.steps": "4", "train.ckpt_every": "2"})
    launch = python(["-m", "megacpp.cli", *args], timeout=120, env=env)
    assert launch.returncode == 1, launch.output
    assert "Traceback" not in launch.output
    errors = [line for line in launch.output.splitlines() if line.startswith("megacpp: ")]
    assert errors == ["megacpp: error: out of host memory: could not allocate 1,125,899,906,842,624 bytes (torch's "
                      "DefaultCPUAllocator); lower the batch (train.micro_batch), data.seq_len or the model's size, "
                      "or free memory; checkpoints already written are intact"], launch.output[-3000:]
    (kept,) = list_checkpoints(tmp_path / "run")
    assert kept.name == "step_00000002"
    verify_checkpoint(kept)


def test_a_full_disk_while_writing_optimizer_state_is_one_line_and_keeps_the_checkpoints(tmp_path, small_corpus):
    """DCP reports each rank's failure with its frame summaries: the error was a 4 KB line."""
    first = tiny_train_args(tmp_path, small_corpus, **{"train.steps": "2", "train.ckpt_every": "2"})
    python(["-m", "megacpp.cli", *first], timeout=120).check()
    hooks = Path(__file__).resolve().parent / "hooks"
    env = worker_env({"MEGACPP_TEST_DISK_FULL_IN_MOMENTS": "1"})
    env["PYTHONPATH"] = f"{hooks}{os.pathsep}{env['PYTHONPATH']}"
    more = tiny_train_args(tmp_path, small_corpus, **{"train.steps": "4", "train.ckpt_every": "2"})
    launch = python(["-m", "megacpp.cli", *more, "--resume"], timeout=120, env=env)
    assert launch.returncode != 0
    assert "Traceback" not in launch.output
    errors = [line for line in launch.output.splitlines() if line.startswith("megacpp: ")]
    assert len(errors) == 1 and len(errors[0]) < 400, launch.output[-3000:]
    assert ("checkpoint at step 4 was not saved (writing optimizer moments: No space left on device: "
            "optim/__0_0.distcp)") in errors[0]
    (kept,) = list_checkpoints(tmp_path / "run")
    assert kept.name == "step_00000002"
    verify_checkpoint(kept)


def test_a_device_out_of_memory_error_after_warmup_is_one_line(tmp_path, small_corpus, monkeypatch, capsys):
    """Outside auto-fit's warmup window nothing retries it; before, it printed a traceback."""
    original = Trainer.train_step

    def out_of_memory_in_step_two(self: Trainer) -> float:
        if self.step == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total)\n"
                                         "See documentation for Memory Management")
        return original(self)

    monkeypatch.setattr(Trainer, "train_step", out_of_memory_in_step_two)
    assert _train(tmp_path, small_corpus, **{"train.steps": "2"}) == 1
    line = _one_line_error(capsys.readouterr().err)
    assert line == ("megacpp: error: out of device memory: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; "
                    "79.1 GiB total); lower the batch (train.micro_batch), data.seq_len or the model's size, or free "
                    "memory; checkpoints already written are intact")
