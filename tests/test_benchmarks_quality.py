"""benchmarks/runs/compare_quality.py, loss_spread.py, quality_study.py and context_study.py: the runs a user names, and
mistakes in naming them, end in one line (SystemExit with a message), never a traceback; a mistake in
any quality_study variant is reported before any variant trains."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks" / "runs"


@pytest.fixture
def bench(monkeypatch):
    """The benchmark scripts importable as modules (they import each other by file name)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import compare_quality
    import context_study
    import loss_spread
    import quality_study
    return {"compare": compare_quality, "spread": loss_spread, "study": quality_study, "context": context_study}


def write_run(path: Path, steps: int = 4) -> Path:
    path.mkdir(parents=True)
    records = [{"step": 0, "kind": "baselines", "unigram_bpb": 2.5, "xz_bpb": 0.9, "xz_given_train_bpb": 0.6}]
    for s in range(1, steps + 1):
        records.append({"step": s, "kind": "train", "loss": 5.0 - s / 8, "elapsed_s": float(s)})
        records.append({"step": s, "kind": "val", "val_bpb": 3.0 - s / 16, "tokens": 64 * s, "elapsed_s": float(s)})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def one_line_exit(func, *args) -> str:
    with pytest.raises(SystemExit) as info:
        func(*args)
    message = info.value.code
    assert isinstance(message, str) and "\n" not in message
    return message


def test_tier1_missing_run_dir_or_metrics_is_one_line(bench, monkeypatch, tmp_path):
    (tmp_path / "no_metrics").mkdir()
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    (truncated / "metrics.jsonl").write_text('{"step": 1, "kind": "tra')  # killed mid-write
    good = write_run(tmp_path / "good")
    commands = [("compare_quality.py", bench["compare"].main, ["--out", str(tmp_path / "q.png")]),
                ("loss_spread.py", bench["spread"].main, ["--steps", "1:4"])]
    for script, main, options in commands:
        for run, expected in ((tmp_path / "missing", "no such run directory"), (tmp_path / "no_metrics",
                              "no metrics.jsonl"), (empty, "no complete record"), (truncated, "no complete record")):
            monkeypatch.setattr(sys, "argv", [script, str(good), str(run), *options])
            assert expected in one_line_exit(main)
    assert not (tmp_path / "q.png").exists()


def test_tier1_run_names_with_equals_signs(bench, tmp_path):
    """A directory whose name holds '=' (a sweep's `lr=0.02`) with or without a label; a label with '='."""
    run = write_run(tmp_path / "lr=0.02")
    for arg, label in ((str(run), "lr=0.02"), (f"fast={run}", "fast"), (f"a=b={run}", "a=b"), (f"={run}", "lr=0.02")):
        loaded = bench["compare"].load_run(arg)
        assert (loaded.label, loaded.tokens, loaded.bpb) == (label, [64, 128, 192, 256], [2.9375, 2.875, 2.8125, 2.75])


def test_tier1_bad_step_window_is_one_line(bench, monkeypatch, tmp_path):
    run = write_run(tmp_path / "r")
    for window in ("4", "a:b", "1:"):
        monkeypatch.setattr(sys, "argv", ["loss_spread.py", str(run), "--steps", window])
        assert "--steps" in one_line_exit(bench["spread"].main)


def test_tier1_quality_study_refuses_bad_variants_before_training(bench, monkeypatch, tmp_path):
    """Each of these used to train the first variant (a fake megacpp here) before failing on the second."""
    trained = []
    monkeypatch.setattr(bench["study"], "run_variant", lambda label, *a, **k: trained.append(label) or False)
    out = tmp_path / "study"
    cases = {
        "expected label=arguments": ["ok=--preset tiny", "nolabel --preset tiny"],
        "No closing quotation": ["ok=--preset tiny", "q=--preset 'tiny"],
        "same directory": ["a b=--preset tiny", "a_b=--preset tiny"],
        "--spread-steps": ["ok=--preset tiny", "--spread-steps", "20"],
    }
    for expected, variants in cases.items():
        monkeypatch.setattr(sys, "argv", ["quality_study.py", "--out", str(out), "--steps", "2", *variants])
        assert expected in one_line_exit(bench["study"].main)
    assert trained == [] and not out.exists()


def test_tier1_context_study_refuses_bad_variants_before_training(bench, monkeypatch, tmp_path):
    """A mistake in any variant ends the study in one line before the first variant trains."""
    trained = []
    monkeypatch.setattr(bench["context"], "run_variant", lambda v, *a, **k: trained.append(v))
    out = tmp_path / "study"
    cases = {
        "expected PRESET:SEQ_LEN": ["small:2048", "small"],
        "not a multiple of small_3000's length": ["small:2048", "small:3000"],
        "no documented rope_theta": ["--tokens-per-step", "131072", "small:2048", "small:131072"],
        "--window -1: must be >= 0 tokens": ["--window", "-1", "small:2048"],
    }
    for expected, variants in cases.items():
        monkeypatch.setattr(sys, "argv", ["context_study.py", "--out", str(out), *variants, "--", "--data.corpus", "x"])
        assert expected in one_line_exit(bench["context"].main)
    assert trained == [] and not out.exists()


def test_tier1_context_study_reports_a_failed_run_and_still_compares_the_others(bench, monkeypatch, tmp_path):
    """A variant whose training failed at its start (a metrics file without any validation record) is one row
    naming its log; the table and the comparisons of the other runs are still written."""
    out = tmp_path / "study"

    def fake_run(v, gpu, args, extra):
        if v.preset == "small":
            metrics = write_run(out / v.label) / "metrics.jsonl"
            records = [json.loads(line) for line in metrics.read_text().splitlines()]
            metrics.write_text("".join(json.dumps({**r, "tok_per_s": 1000.0} if r["kind"] == "train" else r) + "\n"
                                       for r in records))
        else:
            (out / v.label).mkdir(parents=True)
            (out / v.label / "metrics.jsonl").write_text(json.dumps({"step": 0, "kind": "baselines"}) + "\n")

    monkeypatch.setattr(bench["context"], "run_variant", fake_run)
    monkeypatch.setattr(sys, "argv", ["context_study.py", "--out", str(out), "small:2048", "dense:2048"])
    bench["context"].main()
    summary = (out / "summary.md").read_text()
    assert f"| dense_2048 | no validation record: the training failed or stopped before its first evaluation " \
           f"(its output: {out / 'dense_2048.train.log'}) |" in summary
    assert "| small_2048 | " in summary and "## 2048 tokens of context" in summary


def test_tier1_context_study_cuts_the_context_for_a_second_curve(bench, monkeypatch, tmp_path):
    """--window W: after the full evaluation, one more `eval --by-position --context-window W` per run whose
    rows are longer than W (none for a run at W or shorter), and the summary gives both curves."""
    study = bench["context"]
    commands = []
    monkeypatch.setattr(study, "run_logged", lambda cmd, log, gpu, timeout_s: commands.append(cmd) or "0")
    args = argparse.Namespace(out=tmp_path, cpp_syntax=0, window=512, timeout_s=10.0, steps=2, eval_every=1,
                              tokens_per_step=4096)
    study.run_variant(study.Variant("small", 2048), "0", args, [])
    assert [c[c.index("megacpp.cli") + 1] for c in commands] == ["train", "eval", "eval"]
    cut = commands[-1]
    assert cut[cut.index("--context-window") + 1] == "512" and "--by-position" in cut
    assert cut[cut.index("--out") + 1] == str(tmp_path / "small_2048" / study.WINDOW_CURVE)
    commands.clear()
    study.run_variant(study.Variant("small", 512), "0", args, [])
    assert [c[c.index("megacpp.cli") + 1] for c in commands] == ["train", "eval"]

    run = write_run(tmp_path / "dense_2048")
    metrics = run / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    metrics.write_text("".join(json.dumps({**r, "tok_per_s": 1000.0} if r["kind"] == "train" else r) + "\n"
                               for r in records))
    bucket = {"first": 1, "last": 64, "tokens": 1, "bytes": 1, "nats": 1.0}
    for name, bpb, window in (("position_curve.json", 1.25, None), (study.WINDOW_CURVE, 1.5, 512)):
        (run / name).write_text(json.dumps({"context_window": window, "buckets": [{**bucket, "bits_per_byte": bpb}]}))
    assert "1-64: 1.250; context cut to 512: 1-64: 1.500 |" in study.summary_row(study.Variant("dense", 2048), tmp_path)
