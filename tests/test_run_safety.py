"""Run directories and checkpoints never lose work: a reused or busy run directory is refused before any
data work, overwriting moves the old run aside, pruning keeps usable checkpoints, non-finite weights are
never saved, silent divergence stops the run, meta.json is checksummed, an incompatible resume is named
before anything is written, Ctrl-C saves and says how to resume, and a cut-off metrics line is harmless."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megacpp.cli import main
from megacpp.distributed import checkpoint as dist_checkpoint
from megacpp.distributed.context import DistContext
from megacpp.runtime.checkpoint import CheckpointError, latest_valid_checkpoint, list_checkpoints, verify_checkpoint
from megacpp.train.guards import DivergenceError, NonFiniteWeightsError
from megacpp.train.loop import Trainer
from megacpp.train.metrics import MetricsLogger, plot_loss, read_metrics
from megacpp.train.rundir import LOCK_NAME, RunLock
from tests.helpers import tiny_train_args, tiny_train_config
from tests.torchrun import ROOT, Launch, free_port, kill_tree, python, torchrun, torchrun_args, worker_env


def _quiet(_msg: str) -> None:
    pass


def _train(tmp_path, corpus, *extra: str, **overrides: str) -> int:
    return main([*tiny_train_args(tmp_path, corpus, **overrides), *extra])


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    """Every file of a run directory and its bytes (the lock file is the one thing a refusal may touch)."""
    return {str(f.relative_to(run_dir)): f.read_bytes() for f in sorted(run_dir.rglob("*"))
            if f.is_file() and f.name != LOCK_NAME}


def _one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def finished_run(tmp_path, small_corpus, capsys) -> Path:
    """A 2-step run with its checkpoint and metrics, made through the CLI."""
    assert _train(tmp_path, small_corpus, **{"train.steps": "2", "train.ckpt_every": "2"}) == 0
    capsys.readouterr()
    return tmp_path / "run"


# ---------------------------------------------------------------- 1. a run directory holding a run


def test_training_into_a_used_run_directory_is_refused_before_data_work_and_changes_nothing(
        tmp_path, small_corpus, finished_run, capsys):
    before = _snapshot(finished_run)
    fresh_cache = tmp_path / "other-cache"
    assert _train(tmp_path, small_corpus, **{"data.cache_dir": str(fresh_cache)}) == 1
    line = _one_line_error(capsys.readouterr().err)
    assert f"train.out_dir {finished_run} already holds a run (checkpoints/, metrics.jsonl)" in line
    assert "--resume" in line and "--train.overwrite true" in line
    assert _snapshot(finished_run) == before
    assert not fresh_cache.exists(), "refused before the corpus and tokenizer work"


def test_overwrite_moves_the_previous_run_aside_byte_for_byte(tmp_path, small_corpus, finished_run, capsys):
    before = _snapshot(finished_run)
    assert _train(tmp_path, small_corpus, **{"train.steps": "2", "train.overwrite": "true"}) == 0
    (previous,) = finished_run.glob("previous-*")
    assert _snapshot(previous) == before
    assert [p.name for p in list_checkpoints(finished_run)] == ["step_00000002"]
    assert len([r for r in read_metrics(finished_run / "metrics.jsonl") if r["kind"] == "train"]) == 2


def test_overwrite_moves_only_what_megacpp_wrote(tmp_path, small_corpus, finished_run, capsys):
    """A run directory that holds the user's own files too (`--train.out_dir .` beside a corpus): they stay
    where they are, byte for byte; only the run's files move aside."""
    mine = {finished_run / "notes.txt": b"keep me", finished_run / "corpus" / "a.hpp": b"int a;"}
    for path, data in mine.items():
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(data)
    assert _train(tmp_path, small_corpus, **{"train.steps": "2", "train.overwrite": "true"}) == 0
    (previous,) = finished_run.glob("previous-*")
    assert all(path.read_bytes() == data for path, data in mine.items())
    assert not (previous / "notes.txt").exists() and not (previous / "corpus").exists()
    assert (previous / "metrics.jsonl").is_file() and (previous / "checkpoints").is_dir()


def test_resume_together_with_overwrite_is_refused(tmp_path, small_corpus, capsys):
    assert _train(tmp_path, small_corpus, "--resume", **{"train.overwrite": "true"}) == 1
    assert "not both" in _one_line_error(capsys.readouterr().err)


# ---------------------------------------------------------------- 2. two runs at once


def test_a_second_run_on_a_locked_run_directory_is_refused_naming_the_holder(tmp_path, small_corpus, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    held = RunLock(run_dir)
    held.acquire()
    try:
        assert _train(tmp_path, small_corpus) == 1
    finally:
        held.release()
    line = _one_line_error(capsys.readouterr().err)
    assert f"train.out_dir {run_dir} is in use by another run (pid {os.getpid()} on {os.uname().nodename})" in line
    assert not (tmp_path / "cache").exists(), "refused before the corpus and tokenizer work"


# ---------------------------------------------------------------- 3. pruning


def _save(tmp_path, step: int, keep_last: int) -> Path:
    model = torch.nn.Linear(4, 3)
    return dist_checkpoint.save(DistContext(), tmp_path, step, model, {"w": torch.zeros(3)}, {"step": step},
                                {"config": {}, "tokenizer_hash": "abc"}, keep_last)


def test_pruning_never_deletes_usable_checkpoints_below_broken_newer_ones(tmp_path):
    """A run resumed from step 10 because step 20 is broken saves step 15: keep_last=2 keeps 15 and 10
    (the two usable ones) and leaves the broken 20 for the user to inspect."""
    _save(tmp_path, 10, keep_last=2)
    broken = _save(tmp_path, 20, keep_last=2)
    (broken / "state.pt").write_bytes(b"garbage")
    _save(tmp_path, 15, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000020", "step_00000015", "step_00000010"]
    _save(tmp_path, 16, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000020", "step_00000016", "step_00000015"]


def _count_verifications(monkeypatch) -> dict[str, int]:
    """How often each checkpoint directory is hashed against its meta.json (by name)."""
    from megacpp.runtime import checkpoint as ckpt_format

    counts: dict[str, int] = {}
    original = ckpt_format.verify_checkpoint

    def counting(path):
        counts[Path(path).name] = counts.get(Path(path).name, 0) + 1
        return original(path)

    monkeypatch.setattr(ckpt_format, "verify_checkpoint", counting)
    return counts


def test_pruning_hashes_each_older_checkpoint_at_most_once_per_process(tmp_path, monkeypatch):
    """Before, every save re-hashed up to keep_last - 1 older checkpoints; with keep_last=3 over six
    saves steps 1 to 4 were each hashed twice. Here a fresh process (nothing remembered) resumes a run
    of three checkpoints and saves six more."""
    from megacpp.runtime import checkpoint as ckpt_format

    for step in (1, 2, 3):
        _save(tmp_path, step, keep_last=3)
    monkeypatch.setattr(ckpt_format, "_verdicts", {})  # what a new process knows
    counts = _count_verifications(monkeypatch)
    for step in range(4, 10):
        _save(tmp_path, step, keep_last=3)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000009", "step_00000008", "step_00000007"]
    assert counts == {"step_00000003": 1, "step_00000002": 1}, "those written here are never re-hashed"


@pytest.mark.parametrize("damage", ["truncate", "remove_shard"])
def test_a_checkpoint_damaged_after_its_verdict_is_hashed_again_and_does_not_count(tmp_path, monkeypatch, damage):
    """Step 2 is remembered as usable when written, then damaged: the next save sees its files changed,
    hashes it again and keeps step 1 as the second usable checkpoint; the save after that has two usable
    checkpoints newer than both and removes them, without hashing step 2 again."""
    _save(tmp_path, 1, keep_last=2)
    broken = _save(tmp_path, 2, keep_last=2)
    if damage == "truncate":
        state = broken / "state.pt"
        state.write_bytes(state.read_bytes()[:-1])
    else:
        (shard,) = (broken / "optim").glob("*.distcp")
        shard.unlink()
    counts = _count_verifications(monkeypatch)
    with pytest.raises(CheckpointError):
        verify_checkpoint(broken)
    counts.clear()
    _save(tmp_path, 3, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000002", "step_00000001"]
    assert counts == {"step_00000002": 1}, "step 1 was written here and is unchanged: not hashed"
    _save(tmp_path, 4, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000004", "step_00000003"]
    assert counts == {"step_00000002": 1}, "nothing hashed twice"


# ---------------------------------------------------------------- 4. non-finite weights, divergence, zero steps


def test_a_checkpoint_of_nonfinite_weights_is_refused_naming_the_parameter(tmp_path, small_corpus):
    cfg = tiny_train_config(tmp_path, small_corpus, **{"train.steps": "4", "train.ckpt_every": "2"})
    trainer = Trainer(cfg, log=_quiet, progress=False)
    original = trainer.train_step

    def poison_after_step_four() -> float:
        loss = original()
        if trainer.step == 3:  # the step just run is step 4, whose checkpoint comes next
            with torch.no_grad():
                trainer.model.lm_head.weight[0, 0] = float("inf")
        return loss

    trainer.train_step = poison_after_step_four
    with pytest.raises(NonFiniteWeightsError, match=r"step 4: parameter lm_head.weight holds NaN or infinite"):
        trainer.run()
    (kept,) = list_checkpoints(tmp_path / "run")
    assert kept.name == "step_00000002"
    verify_checkpoint(kept)


def test_a_loss_far_above_uniform_for_three_steps_stops_the_run(tmp_path, small_corpus, monkeypatch):
    cfg = tiny_train_config(tmp_path, small_corpus, **{"train.steps": "6", "train.ckpt_every": "6"})
    monkeypatch.setattr(Trainer, "train_step", lambda self: 100.0)
    with pytest.raises(DivergenceError, match=r"step 3: loss 100.000 above .* for 3 consecutive steps"):
        Trainer(cfg, log=_quiet, progress=False).run()
    assert not list_checkpoints(tmp_path / "run")


def test_an_exactly_zero_gradient_norm_stops_the_run(tmp_path, small_corpus, monkeypatch):
    cfg = tiny_train_config(tmp_path, small_corpus, **{"train.steps": "4"})
    original = Trainer.train_step

    def no_gradient(self) -> float:
        loss = original(self)
        self.stack.metrics["grad_norm"] = torch.tensor(0.0)
        return loss

    monkeypatch.setattr(Trainer, "train_step", no_gradient)
    with pytest.raises(DivergenceError, match="step 1: the gradient norm is exactly 0"):
        Trainer(cfg, log=_quiet, progress=False).run()


def test_resuming_a_finished_run_trains_nothing_and_exits_cleanly(tmp_path, small_corpus, finished_run, capsys):
    before = _snapshot(finished_run)
    assert _train(tmp_path, small_corpus, "--resume", **{"train.steps": "2"}) == 0
    out, err = capsys.readouterr()
    assert "nothing to train: the run in" in out and "at step 2 and train.steps is 2" in out
    assert "Traceback" not in out + err and "done:" not in out
    assert _snapshot(finished_run) == before


def test_resuming_a_run_whose_time_budget_is_spent_trains_nothing(tmp_path, small_corpus, capsys):
    """A budget spent by the first step ends the run there; the same command with --resume says so and
    writes nothing (before, it trained, evaluated and saved one more step each time)."""
    budget = {"train.steps": "50", "train.time_budget_s": "0.001"}
    assert _train(tmp_path, small_corpus, **budget) == 0
    capsys.readouterr()
    before = _snapshot(tmp_path / "run")
    assert _train(tmp_path, small_corpus, "--resume", **budget) == 0
    out = capsys.readouterr().out
    assert "nothing to train: the run in" in out and "of its train.time_budget_s 0.001; raise" in out
    assert _snapshot(tmp_path / "run") == before


# ---------------------------------------------------------------- 5. meta.json and incompatible resumes


def test_an_edited_meta_json_is_detected_and_resume_skips_it(tmp_path):
    good = _save(tmp_path, 1, keep_last=3)
    edited = _save(tmp_path, 2, keep_last=3)
    meta = json.loads((edited / "meta.json").read_text())
    meta["step"] = 3
    (edited / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    with pytest.raises(CheckpointError, match=r"meta.json: edited or corrupt"):
        verify_checkpoint(edited)
    warnings: list[str] = []
    assert latest_valid_checkpoint(tmp_path, warn=warnings.append) == good
    assert "edited or corrupt" in warnings[0]


@pytest.mark.parametrize(("override", "named"), [
    ({"data.seq_len": "16"}, "data.seq_len: checkpoint 32 vs now 16"),
    ({"model.d_model": "48"}, "model.d_model: checkpoint 32 vs now 48"),
    ({"model.pattern": "AEMRF"}, "model.pattern: checkpoint 'AEMFR' vs now 'AEMRF'"),
    ({"train.batch_size": "2"}, "written with 4 rows per optimizer step (1 rank(s) x train.batch_size x "
                                "train.grad_accum), this run has 2 (1 x 2 x 1)"),
    ({"train.grad_accum": "3"}, "written with 4 rows per optimizer step"),
    ({"data.vocab_size": "320"}, "data.vocab_size: checkpoint 300 vs now 320: the tokenizer would be trained"),
    ({"train.seed": "1"}, "train.seed + data.shuffle_seed: checkpoint 1337 + 0 vs now 1 + 0"),
])
def test_an_incompatible_resume_is_named_before_data_preparation_and_anything_written(
        tmp_path, small_corpus, finished_run, capsys, override, named):
    """The settings are compared with the checkpoint before the corpus is read: a fresh data cache stays
    absent (preparing the data would create it, and takes minutes on a real corpus)."""
    before = _snapshot(finished_run)
    fresh_cache = tmp_path / "fresh-cache"
    assert _train(tmp_path, small_corpus, "--resume",
                  **{"train.steps": "4", "data.cache_dir": str(fresh_cache), **override}) == 1
    line = _one_line_error(capsys.readouterr().err)
    assert named in line and str(list_checkpoints(finished_run)[0]) in line
    assert not fresh_cache.exists(), "refused before the corpus and tokenizer work"
    assert _snapshot(finished_run) == before


def test_a_resume_with_the_same_rows_per_step_reads_the_same_rows(tmp_path, small_corpus):
    """Batch 4 for 3 steps, resumed as batch 2 x 2 accumulated: ranks x batch_size x grad_accum is kept, so
    steps 4-6 read exactly the rows an uninterrupted batch-4 run reads (torch.equal), although the loader's
    own global batch changed from 4 to 2."""
    def training_rows(run_dir, resume=False, **overrides):
        seen = []
        cfg = tiny_train_config(run_dir, small_corpus, **{"train.steps": "6", "train.ckpt_every": "3", **overrides})
        trainer = Trainer(cfg, log=_quiet, progress=False)
        trainer.model.register_forward_pre_hook(lambda m, args: seen.append(args[0].clone()) if m.training else None)
        if not resume:
            original = trainer.train_step

            def stop_after_three():
                if trainer.step == 3 and run_dir.name == "b":
                    raise KeyboardInterrupt
                return original()

            trainer.train_step = stop_after_three
        try:
            trainer.run(resume=resume)
        except KeyboardInterrupt:
            pass
        return torch.cat(seen)

    straight = training_rows(tmp_path / "a")
    assert straight.shape[0] == 6 * 4
    training_rows(tmp_path / "b")
    resumed = training_rows(tmp_path / "b", resume=True, **{"train.batch_size": "2", "train.grad_accum": "2"})
    assert resumed.shape[0] == 3 * 4
    assert torch.equal(resumed, straight[3 * 4:])


def test_a_compatible_resume_against_a_fresh_cache_prepares_the_data_and_continues(
        tmp_path, small_corpus, finished_run, capsys):
    """The early check refuses nothing that can continue: a new cache directory (the tokenizer is trained
    again, to the same file) resumes the run."""
    fresh_cache = tmp_path / "fresh-cache"
    assert _train(tmp_path, small_corpus, "--resume",
                  **{"train.steps": "3", "data.cache_dir": str(fresh_cache)}) == 0
    assert "resumed from" in capsys.readouterr().out
    assert fresh_cache.is_dir()
    assert [p.name for p in list_checkpoints(finished_run)][0] == "step_00000003"


# ---------------------------------------------------------------- 6. Ctrl-C


def _wait_for_first_step(proc: subprocess.Popen, metrics: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not (metrics.is_file() and '"kind": "train"' in metrics.read_text()):
        assert proc.poll() is None, f"exited early: {proc.communicate()[0][-3000:]}"
        assert time.monotonic() < deadline, "no step logged in time"
        time.sleep(0.2)


def _interrupt(cmd: list[str], run_dir: Path, timeout: float = 240, sig: int = signal.SIGINT,
               group: bool = True, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Start `cmd` in its own process group, send `sig` to the group (Ctrl-C, as a terminal does) or to
    the process alone after the first logged step, and return (exit code, output). A hang fails the test."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=worker_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        _wait_for_first_step(proc, run_dir / "metrics.jsonl", timeout)
        if group:
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)  # a torchrun launch's workers too
            proc.communicate()
    return proc.returncode, out


def test_sigint_saves_a_checkpoint_exits_130_and_says_how_to_resume(tmp_path, small_corpus):
    args = tiny_train_args(tmp_path, small_corpus, **{"train.steps": "1000", "train.ckpt_every": "1000"})
    code, out = _interrupt([sys.executable, "-m", "megacpp.cli", *args], tmp_path / "run")
    assert code == 130, out[-3000:]
    assert "Traceback" not in out
    (ckpt,) = list_checkpoints(tmp_path / "run")
    step = verify_checkpoint(ckpt)["step"]
    # Ctrl-C may land in a training step or in an evaluation (every 3 steps here), which it cuts short.
    assert re.search(rf"megacpp: interrupted (during the evaluation )?at step {step}; saved checkpoint "
                     rf"{re.escape(str(ckpt))}; continue with: megacpp train", out), out[-3000:]
    assert out.rstrip().endswith("--resume")


def test_sigterm_saves_the_step_reached_and_exits_143_saying_so(tmp_path, small_corpus):
    """What a scheduler sends before it kills a job: handled like Ctrl-C (the step finishes, one checkpoint),
    with a message naming SIGTERM and the exit status the signal would have given."""
    args = tiny_train_args(tmp_path, small_corpus, **{"train.steps": "1000", "train.ckpt_every": "1000"})
    code, out = _interrupt([sys.executable, "-m", "megacpp.cli", *args], tmp_path / "run", sig=signal.SIGTERM,
                           group=False)
    assert code == 143, out[-3000:]
    assert "Traceback" not in out
    (ckpt,) = list_checkpoints(tmp_path / "run")
    step = verify_checkpoint(ckpt)["step"]
    assert re.search(rf"megacpp: stopped by SIGTERM \(a scheduler's preemption or shutdown\) (during the "
                     rf"evaluation )?at step {step}; saved checkpoint {re.escape(str(ckpt))}; continue with: "
                     "megacpp train", out), out[-3000:]


@pytest.mark.slow
def test_sigterm_to_the_autofit_supervisor_reaches_the_child_which_saves(tmp_path, small_corpus):
    """The supervisor (on CPU through the test hook) forwards SIGTERM; its child saves and says so, and
    the supervisor exits 143 without reporting a crash."""
    hooks = ROOT / "tests" / "hooks"
    env = {"MEGACPP_TEST_OOM_ABOVE": "1000",
           "PYTHONPATH": f"{hooks}{os.pathsep}{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    args = tiny_train_args(tmp_path, small_corpus, **{"train.steps": "1000", "train.ckpt_every": "1000"})
    code, out = _interrupt([sys.executable, "-m", "megacpp.cli", *args], tmp_path / "run", sig=signal.SIGTERM,
                           group=False, env=env)
    assert code == 143, out[-3000:]
    (ckpt,) = list_checkpoints(tmp_path / "run")
    assert "megacpp: stopped by SIGTERM" in out and str(ckpt) in out
    assert "failed" not in out and "Traceback" not in out


@pytest.mark.slow
def test_sigint_under_two_rank_torchrun_saves_one_checkpoint_on_every_rank(tmp_path, small_corpus):
    args = tiny_train_args(tmp_path, small_corpus, **{"train.steps": "1000", "train.ckpt_every": "1000",
                                                      "train.batch_size": "2"})
    code, out = _interrupt([*torchrun_args(2, free_port()), "-m", "megacpp.cli", *args], tmp_path / "run")
    assert code != 0
    (ckpt,) = list_checkpoints(tmp_path / "run")
    meta = verify_checkpoint(ckpt)
    assert meta["world_size"] == 2
    said = [line for line in out.splitlines() if "megacpp: interrupted" in line]
    pattern = rf"interrupted (during the evaluation )?at step {meta['step']}; saved checkpoint"
    assert len(said) == 2 and all(re.search(pattern, s) for s in said), out
    assert all(s.endswith("continue with: the same torchrun command plus --resume") for s in said)
    # torchrun itself prints a traceback of its own SignalException; no rank does.
    assert not [line for line in out.splitlines() if line.startswith("[default") and "Traceback" in line]


def _launch_with_fault(tmp_path, corpus, fault: str, torchrun_ranks: int = 0, **overrides: str) -> Launch:
    """`megacpp train` (tiny, 6 steps, evaluation and checkpoint at 3 and 6) through the test launcher,
    which makes the process itself get SIGINT at the moment `fault` names (tests/distributed/launch.py)."""
    args = ["tests/distributed/launch.py", "--fault", fault, *tiny_train_args(tmp_path, corpus, **overrides)]
    if torchrun_ranks:
        return torchrun(args, nproc=torchrun_ranks, timeout=300)
    return python(args, timeout=240)


def _val_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "val"]


def _interrupted_line(output: str) -> str:
    (line,) = [line for line in output.splitlines() if "megacpp: interrupted" in line]
    return line


def test_sigint_during_the_final_evaluation_stops_it_saves_and_says_the_run_is_complete(tmp_path, small_corpus):
    run = _launch_with_fault(tmp_path, small_corpus, "sigint_eval@0:6")
    assert run.returncode == 130, run.output[-3000:]
    assert "Traceback" not in run.output
    final, earlier = list_checkpoints(tmp_path / "run")
    assert verify_checkpoint(final)["step"] == 6 and verify_checkpoint(earlier)["step"] == 3
    assert _interrupted_line(run.output) == (
        f"megacpp: interrupted during the evaluation at step 6; saved checkpoint {final}; the run is complete "
        f"(train.steps 6): nothing to resume; its final evaluation was skipped: `megacpp eval --checkpoint {final}` "
        "runs it")
    assert _val_steps(tmp_path / "run") == [3], "the final evaluation was cut short, not finished"
    assert not (tmp_path / "run" / "sample.txt").exists()


def test_sigint_during_an_evaluation_mid_run_saves_that_step_and_says_how_to_resume(tmp_path, small_corpus):
    run = _launch_with_fault(tmp_path, small_corpus, "sigint_eval@0:3")
    assert run.returncode == 130, run.output[-3000:]
    assert "Traceback" not in run.output
    (ckpt,) = list_checkpoints(tmp_path / "run")
    assert verify_checkpoint(ckpt)["step"] == 3
    line = _interrupted_line(run.output)
    assert line.startswith(f"megacpp: interrupted during the evaluation at step 3; saved checkpoint {ckpt}; "
                           "continue with: megacpp train ")
    assert line.endswith("--resume")
    assert _val_steps(tmp_path / "run") == []


def test_sigint_during_the_end_of_run_sample_stops_it_keeps_the_final_checkpoint_and_says_complete(
        tmp_path, small_corpus):
    run = _launch_with_fault(tmp_path, small_corpus, "sigint_sample@0:3")
    assert run.returncode == 130, run.output[-3000:]
    assert "Traceback" not in run.output
    final = list_checkpoints(tmp_path / "run")[0]
    assert verify_checkpoint(final)["step"] == 6
    assert _interrupted_line(run.output) == (
        f"megacpp: interrupted during the end-of-run sample at step 6; its final checkpoint {final} was written; "
        f"the run is complete (train.steps 6): nothing to resume; `megacpp sample --checkpoint {final}` samples "
        "from it")
    assert _val_steps(tmp_path / "run") == [3, 6]
    assert not (tmp_path / "run" / "sample.txt").exists()
    assert "--- sample" not in run.output


@pytest.mark.slow
def test_sigint_on_one_rank_during_the_final_evaluation_stops_both_ranks_together(tmp_path, small_corpus):
    """Rank 1 alone gets SIGINT: the ranks agree before every evaluation batch, so both stop the
    evaluation at the same batch and save the one checkpoint together."""
    run = _launch_with_fault(tmp_path, small_corpus, "sigint_eval@1:6", torchrun_ranks=2,
                             **{"train.batch_size": "2"})
    assert run.returncode != 0
    final = list_checkpoints(tmp_path / "run")[0]
    assert verify_checkpoint(final)["world_size"] == 2
    said = [line for line in run.output.splitlines() if "megacpp: interrupted during the evaluation" in line]
    assert len(said) == 2 and all("the run is complete (train.steps 6): nothing to resume" in s for s in said)
    assert _val_steps(tmp_path / "run") == [3]
    assert not [line for line in run.output.splitlines() if line.startswith("[default") and "Traceback" in line]


@pytest.mark.slow
def test_tier2_sigint_on_one_rank_during_a_step_stops_both_ranks_after_it_with_one_checkpoint(tmp_path, small_corpus):
    """Rank 1 alone gets SIGINT as step 4 starts: the ranks vote on it with step 4's loss, and both save
    step 4 and stop (no checkpoint was due there)."""
    run = _launch_with_fault(tmp_path, small_corpus, "sigint_step@1:4", torchrun_ranks=2,
                             **{"train.batch_size": "2"})
    assert run.returncode != 0
    latest, earlier = list_checkpoints(tmp_path / "run")
    assert verify_checkpoint(latest)["step"] == 4 and verify_checkpoint(earlier)["step"] == 3
    said = [line for line in run.output.splitlines() if "megacpp: interrupted" in line]
    assert len(said) == 2 and all(f"interrupted at step 4; saved checkpoint {latest}" in s for s in said), said
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4]
    assert not [line for line in run.output.splitlines() if line.startswith("[default") and "Traceback" in line]


# ---------------------------------------------------------------- 7. metrics.jsonl cut short


def test_a_truncated_last_metrics_line_is_skipped_and_appending_starts_a_new_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "kind": "train", "loss": 5.0}\n{"step": 2, "kind": "tr')
    assert [r["step"] for r in read_metrics(path)] == [1]
    logger = MetricsLogger(tmp_path, tensorboard=False, resume=True)
    logger.log(2, "train", {"loss": 4.0})
    logger.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [(1, 5.0), (2, 4.0)]
    assert '{"step": 2, "kind": "tr\n' in path.read_text(), "the partial bytes stay on disk"
    assert plot_loss(path, tmp_path / "loss.png").stat().st_size > 1000
