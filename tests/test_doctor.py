import re
from pathlib import Path

import torch

from megacpp.config import Config
from megacpp.doctor import PROMISES, doctor_report

ROOT = Path(__file__).resolve().parent.parent


def test_every_promise_names_a_test_that_exists():
    """The promise table is only worth what backs it: each tests/... reference must resolve to a test
    function of that name in that file, and the tier in the row must match the test's name."""
    for tier, _what, ref in PROMISES:
        if not ref.startswith("tests/"):
            continue
        path, _, name = ref.partition("::")
        source = (ROOT / path).read_text()
        assert re.search(rf"^def {re.escape(name)}\(", source, re.M), f"{ref} does not exist"
        if tier.startswith("tier"):
            assert name.startswith(f"test_tier{tier.split()[1]}_"), f"{ref} is not named for {tier}"


def test_doctor_report_sections():
    report = doctor_report(Config())
    for section in ("versions", "devices", "caches", "kernels", "distributed", "determinism promises"):
        assert f"\n{section}" in f"\n{report}"
    assert "torch " in report and "tier 1 bit-exact" in report
    assert "megacpp uses gloo (CPU)" in report or "megacpp uses cuda:nccl,cpu:gloo" in report
    assert "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=" in report and "reshard_after_forward=False" in report
    gram_path = "Triton kernel of upper tiles" if torch.cuda.is_available() else "matmuls (no CUDA)"
    assert f"Muon's Gram products: {gram_path}" in report
