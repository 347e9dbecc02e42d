"""The loss head op (megacpp.ops.softcap_xent): its references, the Triton kernel against them under
Triton's CPU interpreter, and the model and config around it. Tier in each name.

The kernel runs under the interpreter only when TRITON_INTERPRET=1 is set before triton is imported;
torch or another test may already have imported it in this process, so the comparisons run once in a
subprocess (`_report`) and the tests assert on its report.

Tolerance, derived for fp32 arithmetic with unit roundoff u = 2^-24 (`_rows_bound`). The kernel's
soft-cap is cap * (1 - e) / (1 + e), e = exp(-2|u / cap|), against torch.tanh: each is within ~8u of
tanh, so a capped logit z within dz = 9 cap u of the exact one. The row's log-sum-exp then carries dz,
exp's own 2u and the sum's reordering, at most gamma_V = V u / (1 - V u) relative (the kernel sums in
blocks, the reference after a max-shift): dlse = dz + 2u + gamma_V + u. The loss row is lse - z_target:
dlse + dz + u |loss|. A gradient element (p - [v = target]) * s, p = exp(z - lse), s = 1 - (z / cap)^2,
carries p (dz + dlse + 2u) s + |p - [v = target]| (2 dz / cap + 2u) + u |g| before its rounding to the
logits' dtype, which adds at most 2 u_out |g| between two roundings of nearby values. Both
implementations are within these bounds of the exact values, so the bound on their difference is
twice that. Observed differences are 3-100x below it, while a wrong term (a dropped s, the target's -1
on another column, a missed block) is off by O(p) or O(1) (checked by mutating the kernel).
"""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from megacpp.config import Config, ConfigError, apply_overrides
from megacpp.model.hybrid import IGNORE_INDEX, HybridLM
from megacpp.ops import softcap_xent, triton_choice
from megacpp.ops.softcap_xent import (
    LossKernelError,
    linear_softcap_cross_entropy,
    linear_softcap_xent_rows,
    linear_softcap_xent_rows_reference,
    softcap_xent_rows_reference,
)
from megacpp.presets import preset
from megacpp.validate import validate_config
from tests.helpers import interpreted_report
from tests.test_hybrid import randomize, shrunk

U32 = 2.0**-24
UNIT = {torch.float32: U32, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# (n rows, vocabulary V, d, logits dtype, cap): one row of one column; V not a multiple of the kernel's
# block (2048) and V spanning two blocks, one partial; 16-bit logits; the smallest and the largest cap.
CASES = [(1, 1, 8, torch.float32, 15.0), (3, 37, 8, torch.float32, 15.0), (5, 2049, 16, torch.bfloat16, 15.0),
         (2, 4096, 8, torch.float16, 1.0), (4, 300, 8, torch.float32, 40.0)]


def _inputs(n: int, vocab: int, d: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """x (n, d), weight (V, d) in dtype, with logits of magnitude ~4 (the cap bites); targets with the
    first row ignored when there are several."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g).to(dtype)
    weight = (torch.randn(vocab, d, generator=g) * 4 / d**0.5).to(dtype)
    targets = torch.randint(0, vocab, (n,), generator=g)
    if n > 1:
        targets[0] = IGNORE_INDEX
    return x, weight, targets


def _rows_bound(logits: torch.Tensor, targets: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Twice the module doc's bounds on each row's loss and each gradient element (float64)."""
    vocab = logits.shape[-1]
    z = cap * torch.tanh(logits.double() / cap)
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    p = torch.exp(z - lse)
    valid = (targets != IGNORE_INDEX).unsqueeze(-1)
    onehot = F.one_hot(torch.where(valid.squeeze(-1), targets, 0), vocab).double()
    s = 1 - (z / cap).square()
    g = (p - onehot) * s
    dz = 9 * cap * U32
    gamma = vocab * U32 / (1 - vocab * U32)
    dlse = dz + 3 * U32 + gamma
    loss = (lse - (z * onehot).sum(-1, keepdim=True)).squeeze(-1)
    loss_bound = dlse + dz + U32 * loss.abs()
    grad_bound = p * (dz + dlse + 2 * U32) * s + (p - onehot).abs() * (2 * dz / cap + 2 * U32) + U32 * g.abs()
    grad_bound = grad_bound + 2 * UNIT[logits.dtype] * g.abs()
    return 2 * loss_bound, 2 * grad_bound * valid


def _case_report(case: tuple, seed: int) -> dict[str, float]:
    """The op against its reference: max |difference| / bound for the row losses and the gradient, and
    whether ignored rows are exactly zero in both; the whole fused loss (eager and compiled) against the
    reference loss and its x and weight gradients, as max |difference| / bound."""
    n, vocab, d, dtype, cap = case
    x, weight, targets = _inputs(n, vocab, d, dtype, seed)
    loss, grad = linear_softcap_xent_rows(x, weight, targets, cap, IGNORE_INDEX)
    ref_loss, ref_grad = linear_softcap_xent_rows_reference(x, weight, targets, cap, IGNORE_INDEX)
    assert loss.dtype == torch.float32 and grad.dtype == dtype and grad.shape == (n, vocab)
    loss_bound, grad_bound = _rows_bound(torch.nn.functional.linear(x, weight), targets, cap)
    ignored = targets == IGNORE_INDEX
    report = {
        "loss": ((loss - ref_loss).double().abs() / loss_bound).max().item(),
        "grad": ((grad - ref_grad).double().abs() / grad_bound.clamp_min(1e-300)).max().item(),
        "ignored_zero": bool((loss[ignored] == 0).all() and (grad[ignored] == 0).all()
                             and (ref_loss[ignored] == 0).all() and (ref_grad[ignored] == 0).all()),
    }
    if dtype == torch.float32:
        report.update(_loss_report(x, weight, targets, cap, loss_bound, grad_bound))
    return report


def _loss_report(x, weight, targets, cap, loss_bound, grad_bound) -> dict[str, float]:
    """The mean loss and the x / weight gradients of the fused path (eager and under torch.compile with
    Inductor, fullgraph) against the reference. Bounds: the rows' bounds averaged, and the gradient
    bound carried through the two GEMMs plus their own rounding (gamma_K of each sum, twice)."""
    n_valid = int((targets != IGNORE_INDEX).sum())
    upstream = 3.0  # a loss scale, as gradient accumulation divides the loss: the backward must apply it
    scale = upstream / n_valid
    ref_x, ref_w = (t.detach().clone().requires_grad_() for t in (x, weight))
    ref = softcap_xent.linear_softcap_cross_entropy_reference(ref_x, ref_w, targets, cap, IGNORE_INDEX)
    (ref * upstream).backward()
    _, ref_rows_grad = softcap_xent_rows_reference(F.linear(x, weight), targets, cap, IGNORE_INDEX)
    g_abs = ref_rows_grad.double().abs()
    gamma = lambda k: k * U32 / (1 - k * U32)  # noqa: E731
    x_bound = scale * (grad_bound @ weight.double().abs() + 2 * gamma(weight.shape[0]) * g_abs @ weight.double().abs())
    w_bound = scale * (grad_bound.T @ x.double().abs() + 2 * gamma(x.shape[0]) * g_abs.T @ x.double().abs())
    loss_bound = loss_bound.sum() / n_valid + 2 * gamma(x.shape[0]) * ref.detach().double().abs()
    out = {}
    compiled = torch.compile(linear_softcap_cross_entropy, backend="inductor", fullgraph=True)
    for name, fn in (("eager", linear_softcap_cross_entropy), ("compiled", compiled)):
        fx, fw = (t.detach().clone().requires_grad_() for t in (x, weight))
        loss = fn(fx, fw, targets, cap, IGNORE_INDEX, kernel="triton")
        (loss * upstream).backward()
        out[f"{name}_loss"] = ((loss - ref).double().abs() / loss_bound).item()
        out[f"{name}_grad_x"] = ((fx.grad - ref_x.grad).double().abs() / x_bound.clamp_min(1e-300)).max().item()
        out[f"{name}_grad_w"] = ((fw.grad - ref_w.grad).double().abs() / w_bound.clamp_min(1e-300)).max().item()
    return out


def _model_report() -> dict[str, float]:
    """HybridLM's training loss with loss_kernel "triton" against "reference" (a small hybrid, float32, two
    MTP heads, packed documents): max relative difference of the loss and of every gradient. The op's
    own differences at these sizes are below 1e-6 relative (the cases above); the model's plumbing
    around it (norm, flattening, shifted MTP targets) would be off by O(1) if wrong."""
    grads = {}
    for kernel in ("reference", "triton"):
        cfg = shrunk("tiny", depth=5)
        cfg.mtp_depth, cfg.loss_kernel = 2, kernel
        model = randomize(HybridLM(cfg))
        gen = torch.Generator().manual_seed(1)
        idx = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
        targets = idx.roll(-1, dims=1)
        targets[:, -1] = IGNORE_INDEX
        doc_ids = (torch.arange(16) >= 9).long().expand(2, 16).contiguous()
        loss = model(idx, targets, doc_ids)
        loss.backward()
        named = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        grads[kernel] = {"loss": loss.detach(), **named}
    out = {}
    for name, ref in grads["reference"].items():
        scale = ref.abs().max().clamp_min(1e-30)
        out[name] = ((grads["triton"][name] - ref).abs().max() / scale).item()
    return out


def _report() -> None:
    """Subprocess entry point: prints every case's report, and the model's, as one JSON line."""
    report = {str(i): _case_report(case, seed=i) for i, case in enumerate(CASES)}
    print(json.dumps({**report, "model": _model_report()}))


@pytest.fixture(scope="module")
def report_by_case() -> dict[str, dict]:
    return interpreted_report("tests.test_softcap_xent", timeout=600)


@pytest.mark.parametrize("index", range(len(CASES)), ids=lambda i: "n{}_V{}_d{}_{}_cap{}".format(*CASES[i]))
def test_tier3_kernel_matches_reference_interpreted(report_by_case, index):
    report = report_by_case[str(index)]
    assert report.pop("ignored_zero")
    for name, ratio in report.items():
        assert math.isfinite(ratio) and ratio <= 1.0, (name, ratio)


def test_tier3_model_loss_with_the_fused_kernel_matches_the_reference_interpreted(report_by_case):
    """Every gradient of the model (and its loss) within 1e-4 of its largest magnitude: 100x the op's
    own relative differences, far below a plumbing error's O(1)."""
    relative = report_by_case["model"]
    assert "loss" in relative and "lm_head.weight" in relative and any(k.startswith("mtp.") for k in relative)
    worst = max(relative.items(), key=lambda kv: kv[1])
    assert math.isfinite(worst[1]) and worst[1] <= 1e-4, worst


def test_tier3_rows_reference_gradient_is_autograds():
    """The reference's closed-form gradient against autograd through F.cross_entropy (float64, summed
    rows): |difference| <= 64 u64 max(1, |g|), the rounding of a few float64 operations."""
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, 53, generator=g, dtype=torch.float64) * 6).requires_grad_()
    targets = torch.randint(0, 53, (6,), generator=g)
    targets[[1, 4]] = IGNORE_INDEX
    for cap in (15.0, 2.0):
        rows, grad = softcap_xent_rows_reference(logits.detach(), targets, cap, IGNORE_INDEX)
        capped = cap * torch.tanh(logits / cap)
        expected_rows = F.cross_entropy(capped, targets, ignore_index=IGNORE_INDEX, reduction="none")
        (expected_grad,) = torch.autograd.grad(expected_rows.sum(), logits)
        bound = 64 * 2.0**-53 * expected_grad.abs().clamp_min(1.0)
        assert bool(((grad - expected_grad).abs() <= bound).all())
        assert bool(((rows - expected_rows.detach()).abs() <= 64 * 2.0**-53 * expected_rows.abs().clamp_min(1)).all())


@pytest.mark.parametrize("mtp_depth", [0, 2])
def test_tier1_cpu_loss_is_the_cross_entropy_of_the_logits_for_every_setting(mtp_depth):
    """On CPU every loss_kernel but "triton" is the reference: the loss and all gradients are bitwise
    those of F.cross_entropy on `logits(h)`, as the head computed before the op existed."""
    results = []
    for kernel in ("reference", "auto", None):
        cfg = shrunk("tiny", depth=5)
        cfg.mtp_depth = mtp_depth
        cfg.loss_kernel = kernel or "reference"
        model = randomize(HybridLM(cfg))
        idx = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
        targets = idx.roll(-1, dims=1)
        targets[:, -1] = IGNORE_INDEX
        h = model.hidden(idx, model.segments(idx))
        if kernel is None:  # the head as written before the op: F.cross_entropy of the capped logits
            loss = F.cross_entropy(model.logits(h).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
            if mtp_depth:
                loss = loss + cfg.mtp_loss_weight * model._mtp_loss(h, targets, None)
        else:
            loss = model.loss(h, targets)
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    for loss, grads in results[1:]:
        assert torch.equal(loss, results[0][0])
        assert all(torch.equal(a, b) for a, b in zip(grads, results[0][1], strict=True))


def test_tier1_kernel_choice_is_checked():
    with pytest.raises(LossKernelError, match="kernel must be one of"):
        linear_softcap_cross_entropy(torch.ones(2, 4), torch.ones(3, 4), torch.zeros(2, dtype=torch.long), 15.0,
                                     IGNORE_INDEX, kernel="cuda")
    x, weight = torch.ones(2, 4), torch.ones(3, 4)
    assert "soft-cap in (0, 40], got 0" in softcap_xent.fused_unsupported_reason(x, weight, 0.0)
    assert "one float dtype" in softcap_xent.fused_unsupported_reason(x, weight.double(), 15.0)
    if softcap_xent.softcap_xent_triton is not None and not triton_choice.INTERPRETED:
        assert "needs CUDA tensors, got cpu" in softcap_xent.fused_unsupported_reason(x, weight, 15.0)
        with pytest.raises(LossKernelError, match="loss_kernel 'triton' cannot run this call: .*CUDA tensors"):
            linear_softcap_cross_entropy(x, weight, torch.zeros(2, dtype=torch.long), 15.0, IGNORE_INDEX,
                                         kernel="triton")


def test_tier1_loss_kernel_setting_is_checked():
    with pytest.raises(ConfigError, match=r"loss_kernel.*expected one of 'auto', 'reference', 'triton'"):
        apply_overrides(Config(), [("model.loss_kernel", "cuda")])
    cfg = apply_overrides(preset("small"), [("model.loss_kernel", "triton"), ("model.logit_softcap", "0")])
    problem = r"model\.loss_kernel.*logit_softcap in \(0, 40\], got 0.*model\.logit_softcap"
    with pytest.raises(ConfigError, match=problem):
        validate_config(cfg)
    validate_config(apply_overrides(preset("small"), [("model.loss_kernel", "triton")]))
    assert preset("small").model.loss_kernel == "auto" and Config().model.loss_kernel == "reference"
