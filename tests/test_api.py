"""The Python API (megacpp.load): a CPU-trained checkpoint, generated text equal to `megacpp sample`'s,
scores and log-probabilities equal to the model's own forward, and the validation figure equal to the
run's and `megacpp eval`'s."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import megacpp
from megacpp.cli import main
from megacpp.train.loop import Trainer
from tests.helpers import REPO, tiny_train_config


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from tests.helpers import write_corpus

    tmp = tmp_path_factory.mktemp("api")
    write_corpus(tmp / "corpus")
    cfg = tiny_train_config(tmp, tmp / "corpus", **{"train.steps": "3", "train.ckpt_every": "3",
                                                    "train.eval_every": "3", "train.eval_batches": "0"})
    result = Trainer(cfg, log=lambda _line: None, progress=False).run()
    return tmp / "run", result


def test_import_megacpp_loads_no_torch():
    probe = "import sys, megacpp; assert 'torch' not in sys.modules; assert callable(megacpp.load)"
    subprocess.run([sys.executable, "-c", probe], check=True, cwd=REPO, timeout=120)


def test_tier2_generate_is_megacpps_sample(trained, capsys):
    run_dir, _ = trained
    model = megacpp.load(run_dir, device="cpu")
    text = model.generate("#include <", max_new_tokens=12, temperature=0.8, top_k=40, seed=3)
    assert main(["sample", "--checkpoint", str(run_dir), "--prompt", "#include <", "--tokens", "12",
                 "--temperature", "0.8", "--top-k", "40", "--seed", "3"]) == 0
    assert capsys.readouterr().out == text + "\n" and text.startswith("#include <")


def test_tier1_token_logprobs_and_score_are_the_models_forward(trained):
    """Against a hand-written pass through the model: BOS + the tokens, log-softmax, the next token's entry."""
    run_dir, _ = trained
    model = megacpp.load(run_dir, device="cpu")
    text = "int add(int a, int b) {\n  return a + b;\n}\n"
    tok = model._session.tokenizer
    ids = torch.tensor([tok.bos_id, *tok.encode(text)])
    with torch.no_grad():
        logits = model.module(ids[None, :-1])
    expected = F.log_softmax(logits.float(), dim=-1)[0].gather(-1, ids[1:, None]).view(-1)
    pairs = model.token_logprobs(text)
    assert [p for _, p in pairs] == expected.tolist()
    assert "".join(t for t, _ in pairs) == text
    assert model.score(text) == -float(expected.double().sum()) / math.log(2) / len(text.encode())
    with pytest.raises(ValueError, match="the text is empty"):
        model.score("")


def test_a_text_longer_than_the_sequence_is_scored_in_windows(trained):
    run_dir, _ = trained
    model = megacpp.load(run_dir, device="cpu")
    text = "int x = 0;\n" * 40  # about 4 times the toy model's 32-token rows
    pairs = model.token_logprobs(text)
    assert len(pairs) == len(model._session.tokenizer.encode(text)) > model.config.data.seq_len
    assert all(math.isfinite(p) and p <= 0 for _, p in pairs)


def test_tier1_evaluate_is_the_runs_figure_and_evals(trained):
    run_dir, result = trained
    evaluation, baselines = megacpp.load(run_dir, device="cpu").evaluate()
    assert evaluation == result.evaluation and evaluation.whole
    assert baselines == result.baselines
