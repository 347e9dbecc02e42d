"""End-to-end trainer tests on a toy corpus: resume, checkpoints, NaN stop, CLI errors."""
import json
import math
import shutil
import time
import types

import pytest
import torch
from safetensors.torch import load_file

from megacpp.cli import main
from megacpp.config import Config
from megacpp.data.baselines import BASELINES_FILE
from megacpp.runtime.checkpoint import list_checkpoints
from megacpp.runtime.data import build_data
from megacpp.train import loop as loop_module
from megacpp.train.guards import NonFiniteLossError
from megacpp.train.loop import Trainer
from megacpp.train.metrics import BASELINE_LINES, baselines_of, read_metrics
from tests.helpers import tiny_train_args, tiny_train_config


def _quiet(_msg: str) -> None:
    pass


def _run(cfg, resume=False) -> Trainer:
    trainer = Trainer(cfg, log=_quiet, progress=False)
    trainer.run(resume=resume)
    return trainer


def test_tier1_interrupted_then_resumed_equals_uninterrupted(tmp_path, small_corpus, monkeypatch):
    """Kill after step 3 (checkpoint at 3), resume to 6: weights, optimizer state, MoE biases, loader
    position and losses equal an uninterrupted 6-step run bit for bit. Breaks if any piece of state
    (RNG, loader, schedule, momentum, MoE bias) is not checkpointed."""
    straight = _run(tiny_train_config(tmp_path / "a", small_corpus))
    _run_killed_after_three(tiny_train_config(tmp_path / "b", small_corpus), monkeypatch)
    resumed = _run(tiny_train_config(tmp_path / "b", small_corpus), resume=True)

    _assert_same_training_state(straight, resumed)
    assert straight.stack.state_dict() == resumed.stack.state_dict()
    assert straight.data.loader.state_dict() == resumed.data.loader.state_dict()


def _run_killed_after_three(cfg, monkeypatch) -> None:
    """Run `cfg` and kill it after step 3 (as a KeyboardInterrupt there would)."""
    original_step = Trainer.train_step

    def crash_after_three(self):
        if self.step == 3:
            raise KeyboardInterrupt
        return original_step(self)

    monkeypatch.setattr(Trainer, "train_step", crash_after_three)
    with pytest.raises(KeyboardInterrupt):
        _run(cfg)
    monkeypatch.setattr(Trainer, "train_step", original_step)


def _assert_same_training_state(a: Trainer, b: Trainer) -> None:
    """Losses, weights and optimizer moments equal bit for bit."""
    assert a.losses == b.losses
    wa, wb = a.model.state_dict(), b.model.state_dict()
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    ma, mb = a.stack.moments(), b.stack.moments()
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)


def test_tier1_resume_with_lr_factors_per_kind_is_exact_and_may_change_them(tmp_path, small_corpus, monkeypatch):
    """With optim.lr_scale_by_kind set, kill after step 3 and resume to 6: everything equals the
    uninterrupted run bit for bit. A resume may also change the factors: an lr is not a shape, so
    check_resume_settings compares no optim field and the moments are keyed by parameter name, not by
    group. The copy of the interrupted run resumed with R=0.5 instead of 0.25 runs, and its R groups
    train at the new factor."""
    scales = {"optim.lr_scale_by_kind": "M=0.5,R=0.25"}
    straight = _run(tiny_train_config(tmp_path / "a", small_corpus, **scales))
    _run_killed_after_three(tiny_train_config(tmp_path / "b", small_corpus, **scales), monkeypatch)
    shutil.copytree(tmp_path / "b" / "run", tmp_path / "c" / "run")
    resumed = _run(tiny_train_config(tmp_path / "b", small_corpus, **scales), resume=True)
    _assert_same_training_state(straight, resumed)

    changed = _run(tiny_train_config(tmp_path / "c", small_corpus, **{"optim.lr_scale_by_kind": "M=0.5,R=0.5"}),
                   resume=True)
    assert changed.step == 6
    optim = changed.cfg.optim
    # docs/optim.md: "original" Muon groups start from muon_lr, "match_rms_adamw" ones (muon_rms_lr None)
    # and AdamW's "other" group from adamw_lr.
    base = {"muon:original": optim.muon_lr, "muon:match_rms_adamw": optim.adamw_lr, "adamw:other": optim.adamw_lr}
    r_groups = {g["name"]: g["base_lr"] for opt in changed.stack.optimizers for g in opt.param_groups
                if "@R" in g["name"]}
    assert {"muon:original@R", "adamw:other@R:no_decay"} <= r_groups.keys()
    assert all(lr == base[name.split("@")[0]] / 2 for name, lr in r_groups.items()), r_groups
    r_out = f"blocks.{changed.model.layout.index('R')}.mixer.out_proj.weight"
    assert not torch.equal(changed.model.state_dict()[r_out], resumed.model.state_dict()[r_out])


def test_tier1_bf16_moments_resume_exactly_and_widen_exactly_when_resumed_into_float32(tmp_path, small_corpus,
                                                                                    monkeypatch):
    """Muon's momentum and AdamW's first moments stored in bf16: killed after step 3 and resumed to 6, the run
    equals the uninterrupted one bit for bit. The same checkpoint resumed with both settings float32 says so
    in one line per setting and widens the moments exactly: its step 4 is the bf16 run's step 4 (each step
    computes in fp32 from the stored value), so the losses of steps 1-5 are equal; from step 5 on the fp32
    buffers keep what bf16 would round, and the weights part."""
    bf16 = {"optim.momentum_dtype": "bfloat16", "optim.adamw_momentum_dtype": "bfloat16"}
    straight = _run(tiny_train_config(tmp_path / "a", small_corpus, **bf16))
    _run_killed_after_three(tiny_train_config(tmp_path / "b", small_corpus, **bf16), monkeypatch)
    shutil.copytree(tmp_path / "b" / "run", tmp_path / "c" / "run")
    resumed = _run(tiny_train_config(tmp_path / "b", small_corpus, **bf16), resume=True)
    _assert_same_training_state(straight, resumed)
    first_moments = {k: v.dtype for k, v in resumed.stack.moments().items()
                     if k.endswith(("/momentum_buffer", "/exp_avg"))}
    assert first_moments and set(first_moments.values()) == {torch.bfloat16}

    lines: list[str] = []
    fp32 = {"optim.momentum_dtype": "float32", "optim.adamw_momentum_dtype": "float32"}
    widened = Trainer(tiny_train_config(tmp_path / "c", small_corpus, **fp32), log=lines.append, progress=False)
    widened.run(resume=True)
    assert [line for line in lines if "the checkpoint stored" in line] == [
        f"resuming with optim.{key} = 'float32' (the checkpoint stored 'bfloat16'): its moments are widened exactly "
        "as they load" for key in ("momentum_dtype", "adamw_momentum_dtype")]
    assert widened.losses[:5] == straight.losses[:5]
    assert all(widened.stack.moments()[k].dtype == torch.float32 for k in first_moments)
    final_a, final_c = straight.model.state_dict(), widened.model.state_dict()
    assert any(not torch.equal(final_a[k], final_c[k]) for k in final_a)


def test_run_writes_metrics_plot_sample_and_keeps_last_k(tmp_path, small_corpus):
    cfg = tiny_train_config(tmp_path, small_corpus, **{"train.steps": "7", "train.ckpt_every": "2",
                                                        "train.keep_last": "2"})
    trainer = _run(cfg)
    out = tmp_path / "run"
    assert (out / "loss.png").stat().st_size > 1000
    assert (out / "sample.txt").read_text().startswith(cfg.train.sample_prompt)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 8))
    assert all(math.isfinite(r["val_bpb"]) for r in records if r["kind"] == "val")
    assert [p.name for p in list_checkpoints(out)] == ["step_00000007", "step_00000006"]
    assert (list_checkpoints(out)[0] / "tokenizer.json").is_file()
    assert trainer.step == 7


def test_nan_loss_stops_with_step_and_sublayer_and_keeps_checkpoint(tmp_path, small_corpus):
    cfg = tiny_train_config(tmp_path, small_corpus, **{"train.steps": "5", "train.ckpt_every": "2",
                                                       "train.eval_every": "5"})
    trainer = Trainer(cfg, log=_quiet, progress=False)
    original = trainer.train_step

    def poison_then_step():
        if trainer.step == 3:  # corrupt one Mamba-3 weight: the forward turns NaN from that sublayer on
            block = next(b for b in trainer.model.blocks if b.kind == "M")
            with torch.no_grad():
                block.mixer.out_proj.weight.fill_(float("nan"))
        return original()

    trainer.train_step = poison_then_step
    good = None
    with pytest.raises(NonFiniteLossError) as err:
        try:
            trainer.run()
        finally:
            good = list_checkpoints(tmp_path / "run")
    msg = str(err.value)
    assert "step 4" in msg and "nan" in msg
    assert "sublayer 2 (M: Mamba3)" in msg
    assert [p.name for p in good] == ["step_00000002"]
    # Step 3's record waits for step 4 to be queued; the stop in step 4 still writes it.
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in trained] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in trained)


def test_cli_bad_config_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('preset = "tiny"\n[train]\nsteps = "many"\n')
    assert main(["train", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:3" in err and "train.steps" in err and "expected int" in err
    assert main(["train", "--model.patern", "AM"]) == 2
    assert "did you mean 'pattern'" in capsys.readouterr().err


def test_cli_corrupt_checkpoint_is_a_clear_error(tmp_path, small_corpus, capsys):
    cfg = tiny_train_config(tmp_path, small_corpus, **{"train.steps": "2", "train.ckpt_every": "2"})
    _run(cfg)
    ckpt = list_checkpoints(tmp_path / "run")[0]
    blob = ckpt / "model.safetensors"
    blob.write_bytes(blob.read_bytes()[:100])
    assert main(["sample", "--checkpoint", str(ckpt), "--tokens", "3"]) == 1
    err = capsys.readouterr().err
    assert "truncated" in err and "model.safetensors" in err
    warnings: list[str] = []
    assert Trainer(cfg, log=warnings.append, progress=False).resume() is None, "resume must skip it"
    assert any("truncated" in w for w in warnings)


def test_cli_sample_streams_from_checkpoint(tmp_path, small_corpus, capsys):
    cfg = tiny_train_config(tmp_path, small_corpus, **{"train.steps": "2", "train.ckpt_every": "2"})
    _run(cfg)
    args = ["sample", "--checkpoint", str(tmp_path / "run"), "--tokens", "6", "--prompt", "int ", "--seed", "3"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first and first.startswith("int ")


def test_compiled_training_forbids_recompiles_after_warmup(tmp_path, small_corpus):
    """The trainer in blocks mode with compile.forbid_recompiles: any recompile after the first step would
    raise at once; the run completes and records zero break sites and zero late recompiles."""
    cfg = tiny_train_config(tmp_path, small_corpus, **{"compile.mode": "blocks", "compile.backend": "aot_eager",
                                                        "compile.forbid_recompiles": "true", "train.steps": "4"})
    lines: list[str] = []
    Trainer(cfg, log=lines.append, progress=False).run()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    summary = next(r for r in records if r["kind"] == "compile")
    assert summary["graphs"] >= 1
    assert summary["graph_break_sites"] == 0 and summary["recompiles_after_warmup"] == 0
    # Issue 35's compile time: the first step split into phases, the compiled regions named by compile time.
    phases = summary["first_step_phases_s"]
    assert list(phases) == ["data", "forward", "backward", "gradient exchange", "gradient norms", "optimizer step"]
    assert phases["forward"] > 0 and phases["backward"] > 0 and min(phases.values()) >= 0
    (line,) = [line for line in lines if line.startswith("first step ")]
    assert f"forward {phases['forward']:.1f} s" in line and "compile by region: " in line
    assert "Block.forward" in line.split("compile by region: ")[1]  # blocks mode compiles each block's forward
    # The allocator's peak is read on CUDA only: a CPU run's line and record carry none.
    assert "peak memory" not in line and "first_step_peak_gib" not in summary


def test_tier1_phase_clock_line_names_the_phase_that_raised_the_peak():
    """On CUDA the clock reads the allocator's peak at each mark; the line lists them in phase order after
    the times (here the readings are set by hand: the CPU has no allocator peak)."""
    from megacpp.train.phase_clock import PhaseClock

    clock = PhaseClock(torch.device("cpu"))
    clock.seconds.update({"forward": 30.0, "backward": 7.5, "optimizer step": 40.0})
    clock.peak_gib = {"forward": 30.06, "backward": 46.5, "optimizer step": 61.84}
    assert clock.line("first step") == ("first step 77.5 s: forward 30.0 s, backward 7.5 s, optimizer step 40.0 s "
                                        "(peak memory after each: forward 30.1 GiB, backward 46.5 GiB, "
                                        "optimizer step 61.8 GiB)")


def test_cli_eval_reports_bits_per_byte_from_checkpoint(tmp_path, small_corpus, capsys):
    cfg = tiny_train_config(tmp_path, small_corpus, **{"train.steps": "2", "train.ckpt_every": "2"})
    trainer = _run(cfg)
    assert main(["eval", "--checkpoint", str(tmp_path / "run"), "--batches", "2"]) == 0
    out = capsys.readouterr().out
    reported = float(out.split("validation bits per byte:")[1].split()[0])
    from megacpp.runtime.evaluate import evaluate_bpb

    expected = evaluate_bpb(trainer.model, trainer.data, trainer.device, 2)
    assert abs(reported - expected.bpb) < 5e-5  # printed with 4 decimals; the same batches and weights
    assert f"over {expected.tokens:,} tokens (" in out and "of the validation split)" in out


def test_tier1_a_validation_batch_is_the_optimizer_steps_rows_in_training_and_in_eval(tmp_path, small_corpus, capsys):
    """A run of 2 rows x 2 accumulated with `train.eval_batches` 2 evaluates 2 batches of 4 rows, its optimizer
    step's (the text a run of 4 rows, or of 2 GPUs x 2, evaluates), and `megacpp eval --batches 2` on its
    checkpoint covers the same tokens with the same figure. Before, a validation batch was train.batch_size rows:
    the figure covered half that text, and another share of it after a resume on other GPUs."""
    cfg = tiny_train_config(tmp_path, small_corpus, **{"train.steps": "2", "train.ckpt_every": "2",
                                                       "train.eval_every": "2", "train.batch_size": "2",
                                                       "train.grad_accum": "2", "train.eval_batches": "2"})
    _run(cfg)
    (val,) = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "val"]

    def tokens(batch_size: int) -> int:  # targets standing for bytes in 2 batches of a plain loader at batch_size
        data = build_data(cfg.data, cfg.train.seed, batch_size, "cpu", _quiet, progress=False)
        return sum(int((batch.target_bytes > 0).sum()) for batch in data.val_batches(2))

    step_rows, micro_rows = tokens(4), tokens(2)
    assert step_rows > micro_rows > 0  # the split is long enough for the two to differ
    assert val["val_tokens"] == step_rows and val["val_whole_split"] is False
    assert main(["eval", "--checkpoint", str(tmp_path / "run"), "--batches", "2"]) == 0
    out = capsys.readouterr().out
    assert f"validation bits per byte: {val['val_bpb']:.4f} over {step_rows:,} tokens (" in out


def test_the_runs_validation_figure_is_eval_figure_on_the_whole_split(tmp_path, small_corpus, capsys):
    """By default training evaluates the whole validation split, the text its baselines cover: the last
    figure of metrics.jsonl, the summary line and `megacpp eval` on the final checkpoint are one number
    over the same tokens, and each says it covers the whole split."""
    cfg = tiny_train_config(tmp_path, small_corpus, **{"train.steps": "3", "train.eval_batches": "0",
                                                       "train.ckpt_every": "3", "train.eval_every": "3"})
    result = Trainer(cfg, log=_quiet, progress=False).run()
    (val,) = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "val"]
    assert val["val_whole_split"] is True and val["val_tokens"] == result.evaluation.tokens > 0
    assert val["val_bpb"] == result.evaluation.bpb
    from megacpp.infer.session import load_session

    evaluation, _ = load_session(tmp_path / "run", Config()).evaluate()
    assert evaluation == result.evaluation
    assert main(["eval", "--checkpoint", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert f"validation bits per byte: {result.evaluation.bpb:.4f} over {evaluation.tokens:,} tokens (the whole " \
           "validation split)" in out
    assert out.count("baselines on the validation split") == 1


def test_config_problems_are_reported_before_any_data_work(tmp_path, capsys):
    """A bad pattern or a sequence longer than the RoPE table fails at once: the corpus path does not
    even exist, so reaching the data step would raise a different error."""
    missing = tmp_path / "no-corpus"
    assert main(["train", "--model.pattern", "AEXM", f"--data.corpus=[\"{missing}\"]"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megacpp: config error: command line --model.pattern") and "'X' at position 2" in err
    args = ["train", "--data.seq_len", "9000", f"--data.corpus=[\"{missing}\"]"]
    assert main(args) == 2
    assert "exceeds model.attention.max_seq_len" in capsys.readouterr().err


def test_summary_eval_and_metrics_show_the_baselines_beside_validation_bits_per_byte(tmp_path, small_corpus, capsys):
    """The end-of-run summary, `megacpp eval` and metrics.jsonl carry the three figures cached with the
    shards (read back from baselines.json here, not from the trainer), and a CPU run says it is a smoke
    test with the GPU figures beside it."""
    assert main(tiny_train_args(tmp_path, small_corpus, **{"train.steps": "2", "train.ckpt_every": "2"})) == 0
    out = capsys.readouterr().out
    [cache_file] = (tmp_path / "cache").rglob(BASELINES_FILE)
    figures = json.loads(cache_file.read_text())["baselines"]
    expected = (f"(baselines on the whole validation split: unigram {figures['unigram_bpb']:.3f}, "
                f"xz {figures['xz_bpb']:.3f}, xz given train {figures['xz_given_train_bpb']:.3f})")
    done = next(line for line in out.splitlines() if line.startswith("done: 2 steps, validation "))
    assert expected in done and " tokens (" in done and "of the validation split)" in done  # eval_batches 2
    assert out.count("baselines on the validation split (") == 1, "the baselines line is printed once"
    assert "note: a CPU run is a smoke test" in out and "on one H200 the `small` preset reaches" in out
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert {k: v for k, v in baselines_of(records).items() if k not in ("step", "kind")} == figures
    assert {key for key, _, _ in BASELINE_LINES} <= figures.keys()  # every figure has its line in loss.png
    [val] = [r for r in records if r["kind"] == "val"]
    assert val["tokens"] == 2 * 4 * 32 and val["elapsed_s"] > 0

    assert main(["eval", "--checkpoint", str(tmp_path / "run"), "--batches", "2"]) == 0
    out = capsys.readouterr().out
    assert (f"unigram entropy {figures['unigram_bpb']:.3f}, xz -9e alone {figures['xz_bpb']:.3f}, "
            f"xz -9e after the whole training split {figures['xz_given_train_bpb']:.3f} bits/byte") in out


def test_time_budget_ends_the_run_with_an_evaluation_and_a_checkpoint(tmp_path, small_corpus, capsys):
    """A budget spent by the first step stops the run there, before train.steps, with the last step's
    evaluation, checkpoint and sample; the elapsed time is saved and a resume with a larger budget
    continues from it."""
    args = tiny_train_args(tmp_path, small_corpus, **{"train.steps": "50", "train.time_budget_s": "0.001"})
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "time budget of 0.001 s spent at step 1" in out
    assert "done: 1 steps (train.time_budget_s spent), validation" in out
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step_00000001"]
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [(r["step"], r["kind"]) for r in records if r["kind"] in ("train", "val")] == [(1, "train"), (1, "val")]
    saved = torch.load(list_checkpoints(tmp_path / "run")[0] / "state.pt", weights_only=True)["elapsed_s"]
    assert saved >= [r for r in records if r["kind"] == "val"][0]["elapsed_s"] > 0
    assert main([*args, "--resume", "--train.time_budget_s", "600", "--train.steps", "2"]) == 0
    resumed = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "val"]
    assert [r["step"] for r in resumed] == [1, 2] and resumed[1]["elapsed_s"] >= saved


def test_fine_tuning_starts_from_the_checkpoints_weights_and_tokenizer_on_other_data(tmp_path, small_corpus):
    """train.init_from: a changed source tree (new files) trains from the checkpoint's weights (step 0's
    weights equal its final ones bit for bit), keeps its tokenizer and says so, with a fresh schedule; the
    model settings asked for (d_model 48) give way to the checkpoint's (32), which its weights fit."""
    source = tmp_path / "source"
    _run(tiny_train_config(source, small_corpus, **{"train.steps": "3", "train.ckpt_every": "3"}))
    (ckpt,) = list_checkpoints(source / "run")
    changed = tmp_path / "changed"
    shutil.copytree(small_corpus, changed)
    (changed / "new.hpp").write_text("// a file the first run never saw\nstruct Fresh { int n; };\n" * 8)
    lines: list[str] = []
    cfg = tiny_train_config(tmp_path / "tuned", changed, **{"train.init_from": str(source / "run"), "train.steps": "2",
                                                             "model.d_model": "48"})
    trainer = Trainer(cfg, log=lines.append, progress=False)
    assert trainer.cfg.model.d_model == 32
    weights = load_file(ckpt / "model.safetensors")
    assert all(torch.equal(trainer.model.state_dict()[name], value) for name, value in weights.items())
    tuned_meta = json.loads((ckpt / "meta.json").read_text())
    assert trainer.data.tokenizer_hash == tuned_meta["tokenizer_hash"]
    assert any(line.startswith(f"fine-tuning from {ckpt} (step 3): its weights") for line in lines)
    assert "fine-tuning: the checkpoint's model settings replace this run's: model.d_model 48 -> 32" in lines
    assert trainer.stack.scheduler.state_dict()["position"] == 0
    result = trainer.run()
    assert result.step == 2 and math.isfinite(result.losses[-1])


def test_eval_says_when_the_corpus_changed_since_the_run_trained(tmp_path, small_corpus, capsys):
    corpus = tmp_path / "mine"
    shutil.copytree(small_corpus, corpus)
    _run(tiny_train_config(tmp_path, corpus, **{"train.steps": "2", "train.ckpt_every": "2"}))
    assert main(["eval", "--checkpoint", str(tmp_path / "run")]) == 0
    assert "changed since the run trained" not in capsys.readouterr().out
    (corpus / "added.hpp").write_text("// new\nint added() { return 1; }\n" * 4)
    assert main(["eval", "--checkpoint", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert f"note: the corpus ['{corpus}'] changed since the run trained" in out
    assert "this is today's validation split, not the one the run was measured on" in out


@pytest.mark.parametrize("how", ["rewarm", "hold"])
def test_extending_a_finished_run_says_what_the_schedule_does_and_offers_the_choice(tmp_path, small_corpus, how):
    """A 4-step run whose last step trains at 0.5x (two decay steps); resumed with train.steps 8, "rewarm"
    follows the 8-step schedule (back to 1.0x at step 5) and says so, "hold" trains steps 5-8 at the 0.5x
    the first schedule ended with."""
    base = {"optim.decay_frac": "0.5", "optim.final_lr_frac": "0.0", "train.ckpt_every": "4"}
    _run(tiny_train_config(tmp_path, small_corpus, **{**base, "train.steps": "4"}))
    lines: list[str] = []
    cfg = tiny_train_config(tmp_path, small_corpus, **{**base, "train.steps": "8", "optim.extend_schedule": how})
    trainer = Trainer(cfg, log=lines.append, progress=False)
    trainer.resume()
    multiplier = trainer.stack.scheduler.multiplier
    (note,) = [line for line in lines if line.startswith("schedule: train.steps 4 -> 8")]
    if how == "rewarm":
        assert multiplier == 1.0
        assert "puts step 5 at 1x the base learning rate, where the checkpoint's was at 0.5x" in note
    else:
        assert multiplier == 0.5 and "the added steps train at 0.5x the base learning rate" in note
    trainer.close()


def test_tier1_the_step_after_an_evaluation_and_a_checkpoint_is_timed_without_them(tmp_path, small_corpus,
                                                                                  monkeypatch):
    # the trainer's clock jumps 1,000 s in the evaluation and 1,000 s in the checkpoint at step 3: step 4's
    # tok/s must count neither, as step 3's own does not. A jumping clock, not a sleep: a sleep's margin is
    # what a loaded CI machine eats (a 3 s sleep against a 0.05 s step failed there with 3.7 s)
    jumped = [0.0]
    clock = types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + jumped[0])
    monkeypatch.setattr(loop_module, "time", clock)
    evaluate, save = Trainer._evaluate, Trainer.save

    def slow_evaluate(self, records, watchdog):
        jumped[0] += 1000.0
        evaluate(self, records, watchdog)

    def slow_save(self):
        jumped[0] += 1000.0
        return save(self)

    monkeypatch.setattr(Trainer, "_evaluate", slow_evaluate)
    monkeypatch.setattr(Trainer, "save", slow_save)
    _run(tiny_train_config(tmp_path, small_corpus))
    tokens_per_step = 4 * 32
    seconds = {r["step"]: tokens_per_step / r["tok_per_s"]
               for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "train"}
    assert jumped[0] >= 4000.0  # evaluated and saved at steps 3 and 6
    assert all(seconds[step] < 1000.0 for step in range(1, 7)), seconds
