"""On a CUDA machine: the prompt pass (`HybridLM.prefill`) through the CUDA paths the CPU tests never take
(the fused Mamba-3 scan, M2RNN's fast scan, FlexAttention's causal layout) against the token-by-token path.
Run with `python -m pytest -m gpu tests/test_gpu_prefill.py`."""
from __future__ import annotations

import pytest
import torch

from megacpp.model.hybrid import HybridLM
from tests.test_hybrid import randomize, shrunk

pytestmark = pytest.mark.gpu

NEW_TOKENS = 4


@pytest.mark.parametrize("prompt", (1, 67, 300))
def test_tier3_small_mix_prefill_then_steps_matches_steps_on_cuda(prompt):
    """`small`'s block mix (its fused-kernel settings, the Mamba-3 chunk of 64 so that 67 and 300 cross chunk
    boundaries) at test width, fp32 weights. The fused kernels multiply through tensor cores (TF32 for fp32
    operands: 10 bits of mantissa), the steps in plain fp32, so the two differ by ~1e-3 of each product:
    bounded at 2% of the logits' scale after the 12 sublayers."""
    cfg = shrunk("small")
    cfg.mamba.chunk_size = 64
    torch.manual_seed(prompt)
    model = randomize(HybridLM(cfg), seed=prompt).cuda().eval()
    tokens = torch.randint(0, cfg.vocab_size, (1, prompt + NEW_TOKENS), device="cuda")
    with torch.no_grad():
        cache = model.init_cache(1, prompt + NEW_TOKENS)
        got = [model.prefill(tokens[:, :prompt], cache)]
        got += [model.forward_step(tokens[:, i : i + 1], cache) for i in range(prompt, prompt + NEW_TOKENS)]
        ref_cache = model.init_cache(1, prompt + NEW_TOKENS)
        ref = [model.forward_step(tokens[:, i : i + 1], ref_cache) for i in range(prompt + NEW_TOKENS)]
    want = [ref[prompt - 1], *ref[prompt:]]
    scale = max(w.abs().max().item() for w in want)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert (g - w).abs().max().item() <= 0.02 * scale, f"position {prompt - 1 + step}"
