"""MuonClip / QK-clip on a stand-in GQA attention: exploding heads are clipped, others untouched."""
from __future__ import annotations

import torch

from megacpp.optim import MuonClip, find_attention_modules, qk_clip_scales
from tests.test_optim_standins import TinyAttention, TinyHybrid

TAU = 100.0
# The recomputed bound equals eta * gamma * S = tau in exact arithmetic; fp32 recomputation of q, k
# and their norms may land a few ulps above. Stated slack: 1e-5 relative.
SLACK = 1 + 1e-5


def _exploding(head: int, factor: float = 40.0, seed: int = 0) -> tuple[TinyAttention, torch.Tensor]:
    torch.manual_seed(seed)
    attn = TinyAttention(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8)
    x = torch.randn(2, 10, 32)
    with torch.no_grad():
        attn.qkv.weight[head * 8:(head + 1) * 8] *= factor
        attn.qkv.weight *= 3.0  # every head's bound ~ 10-20; the exploding one in the thousands
        attn(x)
    return attn, x


def _rows(attn: TinyAttention, kind: str, index: int) -> torch.Tensor:
    hd, nq = attn.head_dim, attn.n_heads * attn.head_dim
    start = {"q": 0, "k": nq, "v": nq + attn.n_kv_heads * hd}[kind] + index * hd
    return attn.qkv.weight[start:start + hd]


def test_tier1_scales_mha_are_symmetric_sqrt() -> None:
    bound = torch.tensor([50.0, 400.0, 100.0])
    q, k = qk_clip_scales(bound, n_kv_heads=3, tau=TAU)
    assert torch.equal(k, torch.tensor([1.0, 0.5, 1.0]))
    assert torch.equal(q, torch.tensor([1.0, 0.5, 1.0]))


def test_tier3_scales_gqa_bring_every_head_to_at_most_tau() -> None:
    # Tolerance: 1e-6 relative (fp32 rounding of the scale factors).
    bound = torch.tensor([900.0, 30.0, 500.0, 400.0, 20.0, 150.0])  # 2 kv groups of 3 query heads
    q, k = qk_clip_scales(bound, n_kv_heads=2, tau=TAU)
    assert torch.allclose(k, torch.tensor([1 / 3, 1 / 2]), rtol=1e-6, atol=0)  # sqrt(tau / group max)
    # Every head ends at min(S * gamma, tau): group maxima and the second offender (500 / 3 > tau) at
    # tau; the 150 head (another offender) and the quiet heads only through the shared key.
    after = bound * q * k.repeat_interleave(3)
    assert torch.allclose(after, torch.tensor([100.0, 10.0, 100.0, 100.0, 10.0, 75.0]), rtol=1e-6, atol=0)
    assert q[1] == 1.0 and q[4] == 1.0 and q[5] == 1.0  # query rows not needed: untouched


def test_tier3_exploding_head_bound_at_most_tau_after_clip() -> None:
    attn, x = _exploding(head=1)
    before = attn.logit_bound.clone()
    assert before[1] > TAU and (before[[0, 2, 3]] < TAU).all()
    MuonClip([attn], tau=TAU).apply()
    after = attn.bound(x)
    assert after[1] <= TAU * SLACK and after[1] >= TAU / SLACK
    assert (attn.max_logit(x) <= TAU * SLACK).all()


def test_tier1_other_heads_untouched_by_clip() -> None:
    attn, _ = _exploding(head=1)  # query head 1 uses kv head 0 (group {0, 1})
    w0 = attn.qkv.weight.detach().clone()
    MuonClip([attn], tau=TAU).apply()
    w = attn.qkv.weight.detach()
    for head in (2, 3):  # the other kv group: query rows untouched
        assert torch.equal(_rows(attn, "q", head), w0[head * 8:(head + 1) * 8])
    assert torch.equal(_rows(attn, "q", 0), w0[0:8])  # same group, not offending: q rows untouched
    assert torch.equal(_rows(attn, "k", 1), w0[40:48])  # the other kv head
    assert torch.equal(w[48:], w0[48:])  # all value rows
    assert not torch.equal(_rows(attn, "q", 1), w0[8:16]) and not torch.equal(_rows(attn, "k", 0), w0[32:40])


def test_tier1_metrics() -> None:
    attn, _ = _exploding(head=3)
    bound = attn.logit_bound.clone()
    metrics = MuonClip([attn], tau=TAU).apply()
    assert torch.equal(metrics["muon_clip/max_logit"], bound.max())
    assert metrics["muon_clip/n_clipped"].item() == 1 and metrics["muon_clip/n_total"].item() == 4


def test_tier1_activation_mode_and_quiet_heads_leave_weights_alone() -> None:
    attn, _ = _exploding(head=0)
    w0 = attn.qkv.weight.detach().clone()
    metrics = MuonClip([attn], tau=TAU, mode="activation").apply()
    assert torch.equal(attn.qkv.weight, w0) and metrics["muon_clip/n_clipped"].item() == 1
    MuonClip([attn], tau=1e9).apply()  # no head above tau: every scale is exactly 1
    assert torch.equal(attn.qkv.weight, w0)


def test_tier1_finds_attention_modules_by_duck_typing() -> None:
    model = TinyHybrid()
    assert find_attention_modules(model) == [model.blocks[0].mixer]
