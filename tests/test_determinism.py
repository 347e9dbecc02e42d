"""Determinism tiers: pinned default path, weight perturbation, reruns, decoding, mode reporting."""
import json
import subprocess
import sys

import torch
from safetensors.torch import load_file

from megacpp.model.hybrid import HybridLM
from megacpp.model.perturb import perturb_, perturbed, restore_
from megacpp.runtime.generate import generate_tokens, sample_next
from megacpp.train.determinism import configure_mode, mode_report
from tests.fixtures.make_default_path import FIXTURE, pinned_config, pinned_run_in_child
from tests.helpers import tiny_train_config


def test_tier1_default_path_matches_pinned_fixture(tmp_path):
    """The default path (every new flag off) reproduces the stored logits, loss and gradient norm bit
    for bit on CPU (x86-64, CPU numerics pinned as the fixture script states).
    Breaks when any change alters the default numerics, e.g. adding an always-on
    scale of 1.0 inside a mixer, reordering a sum, or changing an initialiser. An intended change
    regenerates the fixture (tests/fixtures/make_default_path.py) and says why in the commit."""
    expected = load_file(str(FIXTURE))
    got = pinned_run_in_child(tmp_path / "run.safetensors")
    for key in ("logits", "loss", "grad_norm"):
        assert torch.equal(got[key], expected[key]), f"{key} changed on the default path"


def _model() -> HybridLM:
    torch.manual_seed(0)
    model = HybridLM(pinned_config())
    model.blocks[0].mixer.qkv.weight.requires_grad_(False)  # a frozen parameter
    return model


def test_tier1_perturb_restore():
    """perturb(seed, sigma) is reproducible whatever the global RNG did, changes frozen parameters too,
    and restore gives the original weights bitwise. Breaks if restore subtracted regenerated noise
    (floating-point round-off) or if the noise came from the global generator."""
    model = _model()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    saved = perturb_(model, seed=7, sigma=0.01)
    first = {k: v.clone() for k, v in model.state_dict().items()}
    assert not torch.equal(first["blocks.0.mixer.qkv.weight"], original["blocks.0.mixer.qkv.weight"])
    restore_(model, saved)
    assert all(torch.equal(model.state_dict()[k], original[k]) for k in original)
    torch.manual_seed(12345)  # the global RNG must not matter
    torch.randn(100)
    with perturbed(model, seed=7, sigma=0.01):
        assert all(torch.equal(model.state_dict()[k], first[k]) for k in first)
    assert all(torch.equal(model.state_dict()[k], original[k]) for k in original)


def _train_losses(tmp_path, corpus, name: str) -> list[float]:
    cfg = tiny_train_config(tmp_path / name, corpus, **{"train.steps": "20", "train.eval_every": "20",
                                                         "train.ckpt_every": "20"})
    args = [sys.executable, "-m", "megacpp.cli", "train", "--no-progress"]
    args += [f"--{k}={v}" for k, v in _flatten(cfg)]
    subprocess.run(args, check=True, capture_output=True, text=True, timeout=600)
    lines = (tmp_path / name / "run" / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"]


def _flatten(cfg, prefix=""):
    """Every key a user sets, as command-line overrides (not the derived ones: megacpp.config.DERIVED)."""
    from dataclasses import fields, is_dataclass

    from megacpp.config import DERIVED

    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if is_dataclass(value):
            yield from _flatten(value, f"{prefix}{f.name}.")
        elif value is not None and f"{prefix}{f.name}" not in DERIVED:
            text = json.dumps(value) if isinstance(value, (list, bool)) else str(value)
            yield f"{prefix}{f.name}", text


def test_tier2_two_processes_same_losses(tmp_path, small_corpus):
    """Two fresh processes, same seed and config: the same 20 losses exactly. Breaks on any unseeded
    randomness (a global RNG draw in the loader, hash-order iteration, uninitialised memory)."""
    first = _train_losses(tmp_path, small_corpus, "one")
    second = _train_losses(tmp_path, small_corpus, "two")
    assert len(first) == 20 and first == second


def test_tier2_sampling_reproducible():
    """Same prompt, seed and settings give the same tokens; another seed gives other tokens (so the
    equality is not vacuous). Breaks if sampling drew from the global generator."""
    model = _model().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)

    def run(seed):
        torch.manual_seed(seed * 31 + 1)  # scramble the global RNG differently each time
        return list(generate_tokens(model, [1, 2, 3], 24, temperature=1.0, top_k=50, seed=seed))

    assert run(5) == run(5)
    assert run(5) != run(6)
    logits = model.forward_step(torch.tensor([[4]]), model.init_cache(1, 4))
    assert torch.isfinite(logits).all()


def test_tier1_tiny_temperature_is_greedy_not_a_traceback():
    """logits / 1e-40 overflows to inf and softmax to NaN: multinomial raised "probability tensor contains
    either inf, nan or element < 0". Such a temperature is the greedy limit; normal ones still sample."""
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9], [4.0, -2.0, 1.0, 0.0]])
    greedy = logits.argmax(dim=-1, keepdim=True)
    for temperature in (1e-40, 1e-300):
        got = sample_next(logits, temperature, 0, torch.Generator().manual_seed(0))
        assert torch.equal(got, greedy)
    expected = torch.multinomial(torch.softmax(logits / 0.8, dim=-1), 1, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample_next(logits, 0.8, 0, torch.Generator().manual_seed(0)), expected)


def test_bitwise_mode_is_error_not_warning_and_reported():
    """Bitwise mode makes nondeterministic ops errors (naming the op), not warnings, and the report
    (printed at start, stored in checkpoints) says which mode ran."""
    try:
        report = configure_mode(True)
        assert report["mode"] == "bitwise"
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert report["tf32_matmul"] is False and report["cudnn_benchmark"] is False
    finally:
        configure_mode(False)
    assert mode_report()["mode"] == "fast"
