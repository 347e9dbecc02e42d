"""Tests for the E block (megacpp.model.moe). Tier in each name: tier1 bitwise, tier2 rerun, tier3 tol."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from megacpp.model.hints import collect_param_hints, reduced_buffers
from megacpp.model.moe import (
    MoE,
    dispatch_slots,
    expert_capacity,
    expert_order,
    grouped_expert_rows,
    padded_expert_rows,
    permute_rows,
    token_choice_route,
)
from megacpp.model.moe_config import MoEConfig

D = 8
# float64 reference comparisons: a few ulps of ~1e-16 amplified by short sums of O(1) terms.
F64_TOL = {"atol": 1e-12, "rtol": 1e-12}
# float32 compiled-vs-eager: reduction order may differ; eps(fp32) ~1.2e-7 times a small margin.
F32_TOL = {"atol": 1e-5, "rtol": 1e-5}


def make_moe(seed: int = 0, dtype: torch.dtype = torch.float64, **overrides) -> MoE:
    """Tiny MoE with non-zero output projections and a non-zero selection bias, so every term of
    the forward is exercised (the house init zeroes the output projections)."""
    fields = {"n_experts": 4, "top_k": 2, "expert_hidden": 16, "shared_expert": True}
    fields.update(overrides)
    torch.manual_seed(seed)
    m = MoE(D, MoEConfig(**fields), layer_idx=0)
    with torch.no_grad():
        m.w_down.normal_(std=0.3)
        if m.shared_down is not None:
            m.shared_down.weight.normal_(std=0.3)
        m.expert_bias.normal_(std=0.1)
    return m.to(dtype)


def no_overflow_factor(cfg: MoEConfig) -> float:
    """Capacity factor giving capacity = n_tokens (every assignment fits)."""
    return cfg.n_experts / cfg.top_k


def dense_reference(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """Loop over tokens; compute every selected expert; weighted sum. Independent of moe.py."""
    xf = x.reshape(-1, x.shape[-1])
    scores = torch.sigmoid(xf @ m.gate.weight.T)
    out = torch.zeros_like(xf)
    for n in range(xf.shape[0]):
        biased = [(scores[n, e] + m.expert_bias[e]).item() for e in range(m.cfg.n_experts)]
        chosen = sorted(range(m.cfg.n_experts), key=lambda e: -biased[e])[: m.cfg.top_k]
        total = sum(scores[n, e] for e in chosen)
        for e in chosen:
            hidden = F.relu(xf[n] @ m.w_up[e]).square()
            out[n] += scores[n, e] / total * (hidden @ m.w_down[e])
        if m.shared_up is not None:
            out[n] += m.shared_down.weight @ F.relu(m.shared_up.weight @ xf[n]).square()
    return out.view_as(x)


def test_tier3_matches_dense_reference_without_overflow():
    m = make_moe(seed=1)
    m.cfg.capacity_factor = no_overflow_factor(m.cfg)
    x = torch.randn(2, 6, D, dtype=torch.float64)
    y = m(x)
    assert int(m.overflow) == 0
    torch.testing.assert_close(y, dense_reference(m, x), **F64_TOL)


def test_tier3_matches_dense_reference_without_shared_expert():
    m = make_moe(seed=2, shared_expert=False, n_experts=5, top_k=3)
    m.cfg.capacity_factor = no_overflow_factor(m.cfg)
    x = torch.randn(1, 7, D, dtype=torch.float64)
    torch.testing.assert_close(m(x), dense_reference(m, x), **F64_TOL)


def test_tier3_permutation_equivariance_without_overflow():
    m = make_moe(seed=3)
    m.cfg.capacity_factor = no_overflow_factor(m.cfg)
    x = torch.randn(1, 10, D, dtype=torch.float64)
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(m(x[:, perm]), m(x)[:, perm], **F64_TOL)


def test_tier1_overflow_counted_exactly_and_dropped_in_token_order():
    # Zero gate: every score is 0.5, so the bias alone selects experts 0 and 1 for every token.
    m = make_moe(seed=4, shared_expert=False, capacity_factor=1.0)
    with torch.no_grad():
        m.gate.weight.zero_()
        m.expert_bias.copy_(torch.tensor([2.0, 1.0, 0.0, 0.0]))
    x = torch.randn(1, 10, D, dtype=torch.float64)
    y = m(x)
    # 10 tokens, k=2, E=4, factor 1: ceil(10*2/4) = 5 -> power of two 8 slots per expert.
    assert m.capacity(10) == 8
    assert torch.equal(m.tokens_per_expert, torch.tensor([10, 10, 0, 0]))
    assert int(m.overflow) == (10 - 8) * 2
    # Tokens 8 and 9 lost both assignments (last in token order); tokens 0..7 kept both.
    assert torch.equal(y[0, 8:], torch.zeros(2, D, dtype=torch.float64))
    assert bool((y[0, :8].abs().sum(-1) > 0).all())


def test_tier1_tokens_per_expert_exact():
    m = make_moe(seed=5, n_experts=6, top_k=2, capacity_factor=0.5)
    x = torch.randn(3, 7, D, dtype=torch.float64)
    m(x)
    scores = torch.sigmoid(x @ m.gate.weight.T)
    chosen = torch.argsort(scores + m.expert_bias, dim=-1, descending=True)[..., :2]  # (3, 7, 2)
    per_row = torch.stack([(chosen == e).sum(dim=(1, 2)) for e in range(6)], dim=1)  # (3, 6)
    assert torch.equal(m.tokens_per_expert, per_row.sum(0))
    cap = m.capacity(7)  # capacity is per sequence: ceil(0.5 * 7 * 2 / 6) = 2 -> 2
    assert cap == 2
    assert int(m.overflow) == int((per_row - cap).clamp(min=0).sum())


def test_tier1_dispatch_slots_positions_by_token_then_slot():
    # Two rows of 4 tokens, k=2, E=3, capacity 2. Buffer row = e*(b*cap) + row*cap + position;
    # trash row = 3*2*2 = 12.
    expert_idx = torch.tensor([[0, 1, 1, 0, 0, 2, 1, 2], [2, 0, 2, 1, 2, 0, 1, 0]])
    dest, keep, counts = dispatch_slots(expert_idx, n_experts=3, capacity=2)
    assert torch.equal(dest, torch.tensor([[0, 4, 5, 1, 12, 8, 12, 9], [10, 2, 11, 6, 12, 3, 7, 12]]))
    assert torch.equal(keep, dest != 12)
    assert torch.equal(counts, torch.tensor([6, 5, 5]))


def test_tier3_rows_independent_even_with_overflow():
    """Breaks when dispatch ranks assignments across the whole batch (a batch-wide capacity): a row's drops
    then depend on the rows before it."""
    m = make_moe(seed=15, capacity_factor=0.5)
    x = torch.randn(3, 8, D, dtype=torch.float64)
    y = m(x)
    assert int(m.overflow) > 0
    for r in range(3):
        torch.testing.assert_close(m(x[r : r + 1]), y[r : r + 1], **F64_TOL)


def test_tier1_bias_affects_selection_only():
    scores = torch.tensor([[0.9, 0.8, 0.1, 0.2]])
    idx0, w0 = token_choice_route(scores, torch.zeros(4), top_k=2)
    idx1, w1 = token_choice_route(scores, torch.tensor([0.05, 0.0, 0.0, 0.01]), top_k=2)
    assert torch.equal(idx0, idx1)
    assert torch.equal(w0, w1)
    assert torch.equal(w0, scores[:, :2] / scores[:, :2].sum())
    idx2, w2 = token_choice_route(scores, torch.tensor([0.0, 0.0, 1.0, 0.0]), top_k=2)
    assert torch.equal(idx2, torch.tensor([[2, 0]]))
    # Weights are the unbiased scores of the new selection, normalised: 0.1 and 0.9 over their sum.
    picked = torch.tensor([[0.1, 0.9]])
    assert torch.equal(w2, picked / picked.sum(-1, keepdim=True))


@pytest.mark.parametrize(("shape", "k"), [((5, 16), 2), ((2, 7, 9), 3), ((3, 4), 4), ((11, 6), 1)])
def test_tier1_route_picks_what_topk_picks(shape, k):
    """The fused selection equals torch.topk's (sorted, highest first) on tie-free random scores and a
    random bias, and the weights are the gathered unbiased scores over their sum, bitwise."""
    gen = torch.Generator().manual_seed(k * 31 + len(shape))
    scores = torch.sigmoid(torch.randn(shape, generator=gen))
    bias = 0.1 * torch.randn(shape[-1], generator=gen)
    idx, weights = token_choice_route(scores, bias, top_k=k)
    want = torch.topk(scores + bias, k, dim=-1).indices
    picked = scores.gather(-1, want)
    assert torch.equal(idx, want)
    assert torch.equal(weights, picked / picked.sum(dim=-1, keepdim=True))


def test_tier1_route_breaks_ties_toward_the_lower_expert():
    scores = torch.tensor([[0.5, 0.7, 0.7, 0.7]])
    idx, weights = token_choice_route(scores, torch.zeros(4), top_k=2)
    assert idx.tolist() == [[1, 2]]
    assert torch.equal(weights, torch.tensor([[0.5, 0.5]]))


def test_tier1_update_bias_applies_sign_rule():
    m = make_moe(seed=6, bias_update_rate=0.25)
    m.cfg.capacity_factor = no_overflow_factor(m.cfg)
    m.expert_bias.zero_()  # from zero the update is exact in floating point
    m(torch.randn(2, 6, D, dtype=torch.float64))
    load = m.tokens_per_expert.double()
    before = m.expert_bias.clone()
    m.update_bias()
    assert torch.equal(m.expert_bias - before, 0.25 * torch.sign(load.mean() - load))


def test_tier2_update_bias_moves_load_toward_balance():
    m = make_moe(seed=7, bias_update_rate=0.05)
    m.cfg.capacity_factor = no_overflow_factor(m.cfg)
    with torch.no_grad():
        m.expert_bias.copy_(torch.tensor([0.6, 0.0, 0.0, 0.0], dtype=torch.float64))
    x = torch.randn(2, 16, D, dtype=torch.float64)
    with torch.no_grad():
        m(x)
        spread_before = int(m.tokens_per_expert.max() - m.tokens_per_expert.min())
        for _ in range(20):
            m.update_bias()
            m(x)
    spread_after = int(m.tokens_per_expert.max() - m.tokens_per_expert.min())
    assert spread_before >= 20  # expert 0 starts out taking (almost) every token
    assert spread_after <= spread_before // 4


@pytest.mark.parametrize(
    ("n_tokens", "top_k", "n_experts", "factor", "expected"),
    [(16, 2, 8, 1.25, 8), (10, 2, 4, 1.0, 8), (100, 2, 4, 1.0, 64), (1, 2, 8, 1.25, 1),
     (10, 2, 2, 2.0, 10), (64, 1, 4, 1.0, 16), (3, 1, 4, 1.0, 1)],
)
def test_tier1_capacity_rounding(n_tokens, top_k, n_experts, factor, expected):
    assert expert_capacity(n_tokens, top_k, n_experts, factor) == expected


def expert_choice_reference(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """Per row, each expert takes its top-capacity tokens by score; output = sum of score * expert."""
    scores = torch.sigmoid(x @ m.gate.weight.T)
    cap = m.capacity(x.shape[1])
    out = torch.zeros_like(x)
    for r in range(x.shape[0]):
        for e in range(m.cfg.n_experts):
            for n in torch.argsort(scores[r, :, e], descending=True)[:cap].tolist():
                out[r, n] += scores[r, n, e] * (F.relu(x[r, n] @ m.w_up[e]).square() @ m.w_down[e])
    return out


def test_tier3_expert_choice_shapes_capacity_and_reference():
    m = make_moe(seed=8, routing="expert_choice", shared_expert=False, capacity_factor=1.0)
    x = torch.randn(2, 5, D, dtype=torch.float64)
    y = m(x)
    cap = m.capacity(5)
    assert cap == 4  # ceil(1.0 * 5 * 2 / 4) = 3 -> 4 slots per expert per sequence
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.equal(m.tokens_per_expert, torch.full((4,), 2 * cap))
    scores = torch.sigmoid(x @ m.gate.weight.T)
    top = torch.argsort(scores, dim=1, descending=True)[:, :cap]  # (b, cap, E) token ids per row
    unpicked = sum(1 for r in range(2) for n in range(5) if not bool((top[r] == n).any()))
    assert int(m.overflow) == unpicked
    torch.testing.assert_close(y, expert_choice_reference(m, x), **F64_TOL)


@pytest.mark.parametrize("routing", ["token_choice", "expert_choice"])
def test_tier2_rerun_identical_outputs_stats_and_grads(routing):
    """Two calls on the same input give bitwise the same outputs, routing statistics and gradients.
    Breaks with an order-dependent combine (a float scatter-add over duplicate rows) or an unstable
    tie-break in slot assignment."""
    m = make_moe(seed=9, dtype=torch.float32, routing=routing, capacity_factor=1.0)
    x = torch.randn(2, 9, D)
    runs = []
    for _ in range(2):
        m.zero_grad()
        y = m(x)
        y.square().sum().backward()
        runs.append((y, m.tokens_per_expert.clone(), m.overflow.clone(),
                     [p.grad.clone() for p in m.parameters()]))
    (y0, t0, o0, g0), (y1, t1, o1, g1) = runs
    assert torch.equal(y0, y1) and torch.equal(t0, t1) and torch.equal(o0, o1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True))


def test_tier1_router_ignores_bf16_autocast():
    m = make_moe(seed=10, dtype=torch.float32, capacity_factor=1.0)
    x = torch.randn(2, 9, D)
    m(x)
    ref_counts, ref_overflow = m.tokens_per_expert.clone(), m.overflow.clone()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.float32
    assert torch.equal(m.tokens_per_expert, ref_counts) and torch.equal(m.overflow, ref_overflow)


def test_tier3_forward_step_equals_forward_and_cache_empty():
    m = make_moe(seed=11)
    m.cfg.capacity_factor = no_overflow_factor(m.cfg)
    x = torch.randn(2, 4, D, dtype=torch.float64)
    cache = m.init_cache(2, 4, device="cpu", dtype=torch.float64)
    assert cache == {}
    steps = torch.cat([m.forward_step(x[:, i : i + 1], cache) for i in range(4)], dim=1)
    torch.testing.assert_close(steps, m(x), **F64_TOL)


def test_tier1_init_hints_and_buffers():
    m = MoE(D, MoEConfig(n_experts=4, top_k=2, expert_hidden=16), layer_idx=3)
    hints = collect_param_hints(m)
    assert hints["gate.weight"].optimizer == "adamw"
    assert hints["w_up"].lr_scaling == "match_rms_adamw" and hints["w_down"].lr_scaling == "match_rms_adamw"
    assert {name: how for name, _, how in reduced_buffers(m)} == {"tokens_per_expert": "sum", "overflow": "sum"}
    assert m.w_up.shape == (4, D, 16) and m.w_down.shape == (4, 16, D)
    assert not m.w_down.any() and not m.shared_down.weight.any()
    assert not m(torch.randn(1, 3, D)).any()  # zero output projections -> zero output at init
    state = m.state_dict()
    assert "expert_bias" in state and "tokens_per_expert" not in state and "overflow" not in state
    assert m.overflow.dim() == 0 and m.tokens_per_expert.shape == (4,)


def test_tier1_rejects_bad_config():
    with pytest.raises(ValueError, match="routing"):
        MoE(D, MoEConfig(routing="hash"), 0)
    with pytest.raises(ValueError, match="top_k"):
        MoE(D, MoEConfig(n_experts=2, top_k=3), 0)


def python_scalars(module: torch.nn.Module) -> dict[str, object]:
    return {f"{name}.{k}": v for name, sub in module.named_modules() for k, v in vars(sub).items()
            if isinstance(v, (bool, int, float, str))}


@pytest.mark.parametrize("routing", ["token_choice", "expert_choice"])
def test_tier1_forward_mutates_no_python_scalar(routing):
    m = make_moe(seed=12, dtype=torch.float32, routing=routing)
    before = python_scalars(m)
    m(torch.randn(2, 5, D)).sum().backward()
    assert python_scalars(m) == before


def compile_and_check(m: MoE, x: torch.Tensor, backend: str, backward: bool) -> None:
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(m, backend=backend, fullgraph=True)
    with torch.set_grad_enabled(backward):
        y = compiled(x)
    if backward:
        y.sum().backward()
    assert len(counters["graph_break"]) == 0, dict(counters["graph_break"])
    stats = m.tokens_per_expert.clone(), m.overflow.clone()
    torch.testing.assert_close(y, m(x), **F32_TOL)
    assert torch.equal(stats[0], m.tokens_per_expert) and torch.equal(stats[1], m.overflow)


@pytest.mark.parametrize("routing", ["token_choice", "expert_choice"])
def test_tier3_compiles_fullgraph_eager_backend(routing):
    m = make_moe(seed=13, dtype=torch.float32, routing=routing, capacity_factor=1.0)
    compile_and_check(m, torch.randn(2, 6, D), backend="eager", backward=True)


@pytest.mark.parametrize("routing", ["token_choice", "expert_choice"])
def test_tier3_dynamic_batch_compiles_once(routing):
    # The compile policy marks the batch axis dynamic: capacity must not depend on it.
    m = make_moe(seed=16, dtype=torch.float32, routing=routing, capacity_factor=1.0)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(m, backend="eager", fullgraph=True)
    for b in (2, 3, 5):
        x = torch.randn(b, 6, D)
        if b == 2:
            torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x), m(x), **F32_TOL)
    assert counters["stats"]["unique_graphs"] == 1
    assert len(counters["graph_break"]) == 0


def test_tier3_compiles_fullgraph_inductor():
    # Forward only: a cold Inductor compile of forward+backward costs ~15 s on a 2-core CPU.
    m = make_moe(seed=14, dtype=torch.float32, capacity_factor=1.0)
    compile_and_check(m, torch.randn(2, 6, D), backend="inductor", backward=False)


# ---------------------------------------------------------------- grouped (dropless) dispatch

# Unit roundoff of fp32 (round to nearest).
U32 = 2.0**-24


def _exact_operands(shape: tuple[int, ...], gen: torch.Generator, high: int = 2) -> torch.Tensor:
    """Small integers in [-high, high]: products and sums of a few thousand of them are exact in fp32."""
    return torch.randint(-high, high + 1, shape, generator=gen).float()


def _routes(b: int, t: int, k: int, n_exp: int, gen: torch.Generator, unused: int | None = None) -> torch.Tensor:
    """(b, t, k) distinct experts per token, as top-k picks are; `unused` is an expert nobody picks."""
    pool = [e for e in range(n_exp) if e != unused]
    picks = torch.stack([torch.randperm(len(pool), generator=gen)[:k] for _ in range(b * t)])
    return torch.tensor(pool)[picks].view(b, t, k)


def test_tier1_permute_rows_is_a_gather_whose_gradient_is_the_inverse_gather():
    """permute_rows(x, perm, inverse) is x[perm]; its gradient, formed by gathering through the inverse
    permutation, equals autograd's scatter of x[perm]'s gradient, bitwise (a permutation moves values)."""
    gen = torch.Generator().manual_seed(3)
    x0, upstream = torch.randn(11, 5, generator=gen), torch.randn(11, 5, generator=gen)
    perm = torch.randperm(11, generator=gen)
    grads = []
    for permute in (lambda x: permute_rows(x, perm, torch.argsort(perm)), lambda x: x[perm]):
        x = x0.clone().requires_grad_()
        y = permute(x)
        (y * upstream).sum().backward()
        grads.append((y.detach(), x.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


@pytest.mark.parametrize(
    ("b", "m", "n_exp", "skew"), [(1, 1, 1, False), (3, 37, 5, False), (5, 257, 16, True), (2, 4096, 8, True)]
)
def test_tier1_expert_order_is_the_stable_argsort_and_its_inverse(b, m, n_exp, skew):
    """expert_order gives torch's stable argsort of the row-major expert ids, its inverse permutation
    and the per-expert counts; skewed: ids mostly from the lower half and the last expert with no rows."""
    gen = torch.Generator().manual_seed(b * m + n_exp)
    routed = torch.randint(0, n_exp, (b, m), generator=gen)
    if skew:
        routed = torch.where(torch.rand(b, m, generator=gen) < 0.9, routed % (n_exp // 2), routed)
        routed = torch.where(routed == n_exp - 1, 0, routed)
    order, position, counts = expert_order(routed, n_exp)
    flat = routed.flatten()
    assert not skew or int(counts[-1]) == 0
    assert torch.equal(order, torch.argsort(flat, stable=True))
    assert torch.equal(position[order], torch.arange(b * m))
    assert torch.equal(counts, torch.bincount(flat, minlength=n_exp))
    assert order.dtype == position.dtype == torch.int64


@pytest.mark.parametrize(("b", "t", "k", "n_exp", "unused"), [(2, 9, 2, 4, None), (3, 7, 3, 5, 2), (1, 13, 1, 6, 0)])
def test_tier1_grouped_rows_and_grads_equal_padded_with_exact_operands(b, t, k, n_exp, unused):
    """Every (token, slot) row and the gradients of x, w_up and w_down are bitwise those of the padded
    dispatch when nothing overflows (capacity t). Operands and the upstream gradient are small integers,
    so every GEMM product and partial sum (< 2^20 here) is exact in fp32 whatever the kernels' blocking:
    any difference is the dispatch's (sorting, group ends, un-permutation, an expert with no tokens)."""
    d, hidden = 16, 32
    gen = torch.Generator().manual_seed(b * 100 + n_exp)
    x0, up0, down0 = (_exact_operands(s, gen) for s in ((b, t, d), (n_exp, d, hidden), (n_exp, hidden, d)))
    expert_idx = _routes(b, t, k, n_exp, gen, unused)
    upstream = _exact_operands((b, t, k, d), gen)
    results = []
    for grouped in (False, True):
        x, up, down = (a.clone().requires_grad_() for a in (x0, up0, down0))
        if grouped:
            rows, counts = grouped_expert_rows(x, expert_idx, up, down, torch.float32)
        else:
            rows, keep, counts = padded_expert_rows(x, expert_idx, up, down, capacity=t)
            assert bool(keep.all())
        (rows * upstream).sum().backward()
        results.append((rows.detach(), counts, x.grad, up.grad, down.grad))
    for padded, grouped in zip(*results, strict=True):
        assert torch.equal(padded, grouped)
    if unused is not None:
        assert int(results[1][1][unused]) == 0


@pytest.mark.parametrize(("b", "t", "k", "n_exp"), [(2, 9, 2, 4), (3, 7, 3, 5), (1, 13, 1, 6)])
def test_tier1_grouped_rows_with_folded_weights_equal_padded_rows_times_weights(b, t, k, n_exp):
    """With the combine weights folded into the down projection's input, each row and the gradients of x,
    w_up, w_down and the weights are bitwise those of the padded rows times the weights. Operands are small
    integers and the weights powers of two, so every product and sum is exact in fp32 and the two
    placements of the weight (before the down projection, after it) agree exactly: any difference is the
    fold's (a weight on the wrong row, a missing gradient path)."""
    d, hidden = 16, 32
    gen = torch.Generator().manual_seed(b * 10 + k)
    x0, up0, down0 = (_exact_operands(s, gen) for s in ((b, t, d), (n_exp, d, hidden), (n_exp, hidden, d)))
    weights0 = 2.0 ** -torch.randint(0, 4, (b, t, k), generator=gen).float()
    expert_idx = _routes(b, t, k, n_exp, gen)
    upstream = _exact_operands((b, t, k, d), gen)
    results = []
    for grouped in (False, True):
        x, up, down, weights = (a.clone().requires_grad_() for a in (x0, up0, down0, weights0))
        if grouped:
            rows, _ = grouped_expert_rows(x, expert_idx, up, down, torch.float32, weights)
        else:
            rows, _, _ = padded_expert_rows(x, expert_idx, up, down, capacity=t)
            rows = rows * weights.unsqueeze(-1)
        (rows * upstream).sum().backward()
        results.append((rows.detach(), x.grad, up.grad, down.grad, weights.grad))
    for padded, grouped in zip(*results, strict=True):
        assert torch.equal(padded, grouped)


def test_tier1_grouped_moe_output_equals_padded_with_exact_expert_operands():
    """The whole block (router, dispatch, combine, shared expert) gives bitwise the padded output when
    nothing overflows. Expert weights and inputs are small integers and the gate is zero, so every score is
    0.5 and every combine weight 1 / top_k (a power of two): the expert rows are exact in both dispatches
    and so are the weights' products, before the down projection (grouped) or after it (padded). The
    selection bias picks the experts (the same pair for every token; the dispatch's own routes are the
    tests above)."""
    outputs, stats = [], []
    for dispatch in ("padded", "grouped"):
        m = make_moe(seed=21, dtype=torch.float32, n_experts=4, top_k=2, expert_hidden=16, dispatch=dispatch)
        m.cfg.capacity_factor = no_overflow_factor(m.cfg)
        with torch.no_grad():
            m.gate.weight.zero_()
            m.w_up.copy_(_exact_operands(m.w_up.shape, torch.Generator().manual_seed(1)))
            m.w_down.copy_(_exact_operands(m.w_down.shape, torch.Generator().manual_seed(2)))
        x = _exact_operands((2, 11, D), torch.Generator().manual_seed(3))
        outputs.append(m(x))
        stats.append((m.tokens_per_expert.clone(), m.overflow.clone()))
    assert torch.equal(outputs[0], outputs[1])
    assert torch.equal(stats[0][0], stats[1][0]) and int(stats[0][1]) == int(stats[1][1]) == 0
    assert int((stats[0][0] > 0).sum()) == 2  # the bias's pair took every token


def _expert_rows_error_bound(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """Elementwise bound (float64) on |fp32 output - exact output| of the routed experts' combined output,
    from the standard dot-product bound |fl(a.b) - a.b| <= gamma_K sum|a_i b_i|, gamma_K = K u / (1 - K u),
    carried through relu^2 and the down projection; plus one rounding per combine op (the weight's product,
    before the down projection in the grouped dispatch and after it in the padded one, and the sum over k)."""
    d, hidden = m.d_model, m.cfg.expert_hidden
    gamma = lambda n: n * U32 / (1 - n * U32)  # noqa: E731
    x64 = x.double().reshape(-1, d)
    scores = m.router_scores(x).reshape(-1, m.cfg.n_experts)
    idx, weights = token_choice_route(scores, m.expert_bias, m.cfg.top_k)
    bound = torch.zeros_like(x64)
    for slot in range(m.cfg.top_k):
        up, down = m.w_up.double()[idx[:, slot]], m.w_down.double()[idx[:, slot]]  # (n, d, h), (n, h, d)
        h_abs = torch.einsum("nd,ndh->nh", x64.abs(), up.abs())
        h_err = gamma(d) * h_abs
        a_abs = (h_abs + h_err).square()
        a_err = 2 * h_abs * h_err + h_err.square() + U32 * a_abs
        y_abs = torch.einsum("nh,nhd->nd", a_abs, down.abs())
        y_err = gamma(hidden) * y_abs + torch.einsum("nh,nhd->nd", a_err, down.abs())
        w = weights[:, slot : slot + 1].double()
        bound += w * (y_err + 2 * (m.cfg.top_k + 1) * U32 * y_abs)
    return bound.view_as(x)


def test_tier3_grouped_moe_matches_padded_within_derived_gemm_bound():
    """Random fp32 values, nothing overflowing: the two dispatches differ only in how their GEMMs block
    the sums (bmm over padded slots vs one mm per expert group), so each is within the derived forward
    error bound of the exact result and they are within twice that bound of each other."""
    x = torch.randn(3, 37, 16, generator=torch.Generator().manual_seed(4))
    outputs = {}
    for dispatch in ("padded", "grouped"):
        torch.manual_seed(5)
        m = MoE(16, MoEConfig(n_experts=16, top_k=2, expert_hidden=64, dispatch=dispatch), 0)
        m.cfg.capacity_factor = no_overflow_factor(m.cfg)
        with torch.no_grad():
            m.w_down.normal_(std=0.3)
        outputs[dispatch] = m(x)
        assert int(m.overflow) == 0
    bound = _expert_rows_error_bound(m, x)
    diff = (outputs["padded"] - outputs["grouped"]).double().abs()
    assert bool((diff <= 2 * bound).all()), (diff - 2 * bound).max()


def test_tier1_grouped_drops_nothing_and_ignores_capacity():
    """Where the padded dispatch overflows and drops, the grouped one keeps every assignment: overflow 0,
    the same tokens_per_expert, and an output that does not depend on capacity_factor at all."""
    x = torch.randn(2, 12, D, generator=torch.Generator().manual_seed(6))
    runs = {}
    for dispatch, factor in (("padded", 0.25), ("grouped", 0.25), ("grouped", 8.0)):
        m = make_moe(seed=7, dtype=torch.float32, dispatch=dispatch, capacity_factor=factor)
        runs[dispatch, factor] = (m(x), m.tokens_per_expert.clone(), int(m.overflow))
    assert runs["padded", 0.25][2] > 0
    assert runs["grouped", 0.25][2] == runs["grouped", 8.0][2] == 0
    assert torch.equal(runs["grouped", 0.25][1], runs["padded", 0.25][1])
    assert torch.equal(runs["grouped", 0.25][0], runs["grouped", 8.0][0])


@pytest.mark.parametrize("autocast", [False, True])
def test_tier2_grouped_rerun_identical_outputs_stats_and_grads(autocast):
    """Two runs of the grouped dispatch (fp32, and bf16 operands under autocast as on the GPU) give bitwise
    the same outputs, statistics and gradients: every row move is an index_copy to unique rows."""
    m = make_moe(seed=8, dtype=torch.float32, dispatch="grouped")
    x = torch.randn(3, 10, D, generator=torch.Generator().manual_seed(9))
    runs = []
    for _ in range(2):
        m.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = m(x)
        y.square().sum().backward()
        runs.append((y, m.tokens_per_expert.clone(), [p.grad.clone() for p in m.parameters()]))
    (y0, t0, g0), (y1, t1, g1) = runs
    assert torch.equal(y0, y1) and torch.equal(t0, t1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True))


def test_tier1_grouped_operands_stay_bf16_under_autocast():
    """Under bf16 autocast both grouped GEMMs get bf16 operands: the hidden activation is h * h in bf16
    (relu(h).square() would become pow, which autocast runs in fp32)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class GroupedOperands(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.dtypes: list[tuple[torch.dtype, torch.dtype]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._grouped_mm.default:
                self.dtypes.append((args[0].dtype, args[1].dtype))
            return func(*args, **(kwargs or {}))

    m = make_moe(seed=10, dtype=torch.float32, dispatch="grouped")
    with torch.autocast("cpu", dtype=torch.bfloat16), GroupedOperands() as seen:
        y = m(torch.randn(2, 5, D))
    assert seen.dtypes == [(torch.bfloat16, torch.bfloat16)] * 2
    assert y.dtype == torch.float32


def test_tier3_grouped_compiles_fullgraph_without_recompiles_as_routing_shifts():
    """bf16 autocast (the GPU configuration; grouped_mm's compile-time shape function takes bf16 only),
    aot_eager, fullgraph, batch axis dynamic: routing moves every call (bias) and the batch size changes,
    yet one graph serves all calls, with no break and no recompile. The statistics are exact; outputs
    match eager to 1e-2 relative: the same bf16 GEMMs, whose rows round to bf16 (eps 2^-8 = 3.9e-3),
    may accumulate in another order in the traced graph."""
    m = make_moe(seed=11, dtype=torch.float32, dispatch="grouped")
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    gen = torch.Generator().manual_seed(12)
    loads = []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i, b in enumerate((3, 2, 4, 3)):
            with torch.no_grad():
                m.expert_bias.copy_(torch.randn(4, generator=gen, dtype=torch.float64))
            x = torch.randn(b, 10, D, generator=gen, requires_grad=True)
            if i == 0:
                torch._dynamo.mark_dynamic(x, 0)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = compiled(x)
                stats = m.tokens_per_expert.clone()
                reference = m(x)
            y.square().sum().backward()
            assert torch.equal(stats, m.tokens_per_expert) and int(m.overflow) == 0
            torch.testing.assert_close(y, reference, atol=1e-2, rtol=1e-2)
            loads.append(stats)
    assert counters["stats"]["unique_graphs"] == 1
    assert len(counters["graph_break"]) == 0
    assert any(not torch.equal(loads[0], load) for load in loads[1:]), "routing never shifted"


def test_tier1_auto_dispatch_is_padded_on_cpu():
    """auto takes the grouped GEMMs only on CUDA under bf16 autocast: on CPU it is the padded reference
    (it overflows and drops), with or without autocast."""
    m = make_moe(seed=13, dtype=torch.float32, capacity_factor=0.25)
    assert m.cfg.dispatch == "auto" and m.grouped_possible
    x = torch.randn(2, 12, D)
    assert m.grouped_dtype(x) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert m.grouped_dtype(x) is None
    m(x)
    assert int(m.overflow) > 0


@pytest.mark.parametrize(("overrides", "why"), [
    ({"routing": "expert_choice"}, "token_choice"),
    ({"expert_hidden": 20}, "multiples of 8"),
    ({"dispatch": "dropless"}, "MoEConfig.dispatch: expected one of"),
])
def test_tier1_grouped_dispatch_refuses_what_it_cannot_serve(overrides, why):
    fields = {"n_experts": 4, "top_k": 2, "expert_hidden": 16, "dispatch": "grouped", **overrides}
    with pytest.raises(ValueError, match=why):
        MoE(16, MoEConfig(**fields), 0)
    if fields["dispatch"] == "grouped":  # auto falls back to padded instead
        assert not MoE(16, MoEConfig(**{**fields, "dispatch": "auto"}), 0).grouped_possible
