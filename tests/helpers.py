"""Shared test helpers: a synthetic C++ corpus and a training config small enough for CI."""
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import torch

from megacpp.config import Config, apply_overrides
from megacpp.presets import preset

REPO = Path(__file__).resolve().parents[1]

_SNIPPETS = [
    "#include <vector>\n#include <string>\n",
    "namespace detail {\ntemplate <typename T>\nstruct Box {\n  T value;\n};\n}  // namespace detail\n",
    "int add(int a, int b) {\n  return a + b;\n}\n",
    "class Widget {\n public:\n  explicit Widget(int n) : n_(n) {}\n  int size() const { return n_; }\n"
    " private:\n  int n_;\n};\n",
    "for (size_t i = 0; i < items.size(); ++i) {\n  total += items[i];\n}\n",
    "static_assert(sizeof(int) == 4, \"int is 32 bits\");\n",
    "std::vector<std::string> split(const std::string& s, char sep);\n",
    "if (ptr == nullptr) {\n  throw std::runtime_error(\"null\");\n}\n",
]


def write_corpus(root, n_files: int = 60, seed: int = 0) -> None:
    """Deterministic pseudo-C++ files, each a distinct mix of snippets (so dedup keeps them all)."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        body = "".join(rng.choice(_SNIPPETS) for _ in range(rng.randint(3, 9)))
        (root / f"file_{i:03d}.hpp").write_text(f"// file {i}\n#pragma once\n{body}")


def tiny_train_config(tmp_path, corpus, **overrides: str) -> Config:
    """Every block kind at toy width; 300-token vocabulary; no compile, no TensorBoard."""
    cfg: Config = preset("tiny")
    return apply_overrides(cfg, list(tiny_overrides(tmp_path, corpus, **overrides).items()))


def tiny_train_args(tmp_path, corpus, **overrides: str) -> list[str]:
    """`tiny_train_config` as `megacpp train` command-line arguments."""
    return ["train", "--no-progress", "--preset", "tiny",
            *(arg for key, value in tiny_overrides(tmp_path, corpus, **overrides).items()
              for arg in (f"--{key}", value))]


def tiny_overrides(tmp_path, corpus, **overrides: str) -> dict[str, str]:
    base = {
        "model.d_model": "32", "model.depth": "5",
        "model.attention.n_heads": "2", "model.attention.n_kv_heads": "1", "model.attention.head_dim": "16",
        "model.mamba.d_state": "8", "model.mamba.head_dim": "16", "model.mamba.chunk_size": "16",
        "model.moe.n_experts": "4", "model.moe.expert_hidden": "32",
        "model.rnn.n_heads": "2", "model.rnn.key_dim": "8", "model.rnn.value_dim": "8",
        "model.ffn.hidden": "64", "model.engram.layers": "[1]", "model.engram.dim": "8",
        "model.engram.ngram_table_size": "257",
        "data.corpus": f'["{corpus}"]', "data.cache_dir": str(tmp_path / "cache"), "data.vocab_size": "300",
        "data.seq_len": "32", "data.val_fraction": "0.1",
        "train.batch_size": "4", "train.steps": "6", "train.eval_every": "3", "train.eval_batches": "2",
        "train.ckpt_every": "3", "train.log_every": "1", "train.out_dir": str(tmp_path / "run"),
        "train.sample_tokens": "8", "train.tensorboard": "false", "compile.mode": "none",
    }
    base.update(overrides)
    return base


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """|actual - expected| <= tol * max|expected| elementwise (expected is the higher-precision side)."""
    bound = tol * expected.abs().max().item()
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= bound, f"max error {err:.3e} > {bound:.3e}"


def documents(bounds: list[int]) -> torch.Tensor:
    """(1, bounds[-1]) doc ids with documents [bounds[i], bounds[i+1])."""
    return torch.cat([torch.full((1, hi - lo), i) for i, (lo, hi) in enumerate(spans(bounds))], dim=1)


def spans(bounds: list[int]) -> list[tuple[int, int]]:
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def interpreted_report(module: str, timeout: float) -> dict:
    """Run `module._report()` in a subprocess under Triton's CPU interpreter and return the JSON it
    prints last. TRITON_INTERPRET=1 only takes effect before triton is imported, and torch or another
    test may already have imported it in this process; the timeout turns a hang into a failure."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-c", f"from {module} import _report; _report()"]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])

