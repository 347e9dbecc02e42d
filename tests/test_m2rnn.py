"""Tests for the R block (megacpp.model.m2rnn, megacpp.ops.m2rnn_scan). Tier in each name."""
from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from megacpp.model.hints import collect_param_hints
from megacpp.model.m2rnn import M2RNN
from megacpp.model.m2rnn_config import M2RNNConfig
from megacpp.model.segments import document_segments
from megacpp.ops.m2rnn_scan import m2rnn_scan, m2rnn_step

B, T, H, DK, DV, D = 2, 7, 2, 3, 4, 8
# float64: the recurrence is contractive (tanh, f < 1), so errors stay at a few ulps of ~1e-16.
F64_TOL = {"atol": 1e-12, "rtol": 1e-12}
# float32 compiled-vs-eager: same ops, possibly reordered; eps(fp32) ~1.2e-7 with a margin of ~10.
F32_TOL = {"atol": 1e-6, "rtol": 1e-6}


def scan_inputs(seed: int = 0, b: int = B, t: int = T) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, H, DK, generator=g, dtype=torch.float64)
    k = torch.randn(b, t, H, DK, generator=g, dtype=torch.float64)
    v = torch.randn(b, t, H, DV, generator=g, dtype=torch.float64)
    f = torch.rand(b, t, H, generator=g, dtype=torch.float64)
    W = torch.randn(H, DV, DV, generator=g, dtype=torch.float64) * 0.5
    return q, k, v, f, W


def naive_scan(q, k, v, f, W, doc_ids=None, state=None):
    """Per (batch, head, time) loop with explicit matrices; independent of the op."""
    b, t = q.shape[:2]
    y = torch.zeros(b, t, H, DV, dtype=q.dtype)
    final = torch.zeros(b, H, DK, DV, dtype=q.dtype)
    for i in range(b):
        for j in range(H):
            h = torch.zeros(DK, DV, dtype=q.dtype) if state is None else state[i, j].clone()
            for s in range(t):
                if doc_ids is not None and s > 0 and doc_ids[i, s] != doc_ids[i, s - 1]:
                    h = torch.zeros_like(h)
                h = torch.tanh(f[i, s, j] * (h @ W[j]) + torch.outer(k[i, s, j], v[i, s, j]))
                y[i, s, j] = q[i, s, j] @ h
            final[i, j] = h
    return y, final


def test_tier3_scan_matches_naive_loop():
    q, k, v, f, W = scan_inputs(0)
    y, final = m2rnn_scan(q, k, v, f, W, return_final_state=True)
    y_ref, final_ref = naive_scan(q, k, v, f, W)
    torch.testing.assert_close(y, y_ref, **F64_TOL)
    torch.testing.assert_close(final, final_ref, **F64_TOL)


def test_tier3_scan_with_initial_state_matches_naive_loop():
    q, k, v, f, W = scan_inputs(1)
    h0 = torch.rand(B, H, DK, DV, dtype=torch.float64) - 0.5
    torch.testing.assert_close(m2rnn_scan(q, k, v, f, W, initial_state=h0), naive_scan(q, k, v, f, W, state=h0)[0],
                               **F64_TOL)


def test_tier3_doc_ids_reset_equals_per_document_runs():
    q, k, v, f, W = scan_inputs(2)
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2], [5, 5, 5, 5, 5, 5, 9]])
    y = m2rnn_scan(q, k, v, f, W, doc_ids=doc_ids)
    for row, bounds in ((0, [(0, 3), (3, 5), (5, 7)]), (1, [(0, 6), (6, 7)])):
        for lo, hi in bounds:
            sl = (slice(row, row + 1), slice(lo, hi))
            alone = m2rnn_scan(q[sl], k[sl], v[sl], f[sl], W)
            torch.testing.assert_close(y[sl], alone, **F64_TOL)
    torch.testing.assert_close(y, naive_scan(q, k, v, f, W, doc_ids=doc_ids)[0], **F64_TOL)


def test_tier3_split_and_continue_with_state():
    q, k, v, f, W = scan_inputs(3)
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 3, 3]])
    full, final = m2rnn_scan(q, k, v, f, W, doc_ids=doc_ids, return_final_state=True)
    a, b = slice(0, 4), slice(4, T)
    y1, h1 = m2rnn_scan(q[:, a], k[:, a], v[:, a], f[:, a], W, doc_ids=doc_ids[:, a], return_final_state=True)
    y2, h2 = m2rnn_scan(q[:, b], k[:, b], v[:, b], f[:, b], W, initial_state=h1, doc_ids=doc_ids[:, b],
                        return_final_state=True)
    torch.testing.assert_close(torch.cat([y1, y2], dim=1), full, **F64_TOL)
    torch.testing.assert_close(h2, final, **F64_TOL)


def test_tier3_step_matches_scan():
    q, k, v, f, W = scan_inputs(4)
    y_scan, final = m2rnn_scan(q, k, v, f, W, return_final_state=True)
    state = torch.zeros(B, H, DK, DV, dtype=torch.float64)
    for s in range(T):
        y, state = m2rnn_step(q[:, s], k[:, s], v[:, s], f[:, s], W, state)
        torch.testing.assert_close(y, y_scan[:, s], **F64_TOL)
    torch.testing.assert_close(state, final, **F64_TOL)


def test_tier3_gradients_match_autograd_through_naive_loop():
    inputs = [t.requires_grad_() for t in scan_inputs(6)]
    h0 = (torch.rand(B, H, DK, DV, dtype=torch.float64) - 0.5).requires_grad_()
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 2]])
    cot_y = torch.randn(B, T, H, DV, dtype=torch.float64)
    cot_h = torch.randn(B, H, DK, DV, dtype=torch.float64)

    def grads(fn):
        y, final = fn(*inputs, doc_ids=doc_ids, state=h0)
        return torch.autograd.grad((y * cot_y).sum() + (final * cot_h).sum(), [*inputs, h0])

    def op(q, k, v, f, W, doc_ids, state):
        return m2rnn_scan(q, k, v, f, W, initial_state=state, doc_ids=doc_ids, return_final_state=True)

    for got, want in zip(grads(op), grads(naive_scan), strict=True):
        torch.testing.assert_close(got, want, **F64_TOL)


def test_tier3_gradcheck_scan():
    q, k, v, f, W = scan_inputs(7, b=1, t=4)
    h0 = torch.rand(1, H, DK, DV, dtype=torch.float64) - 0.5
    doc_ids = torch.tensor([[0, 0, 1, 1]])

    def fn(q, k, v, f, W, h0):
        return m2rnn_scan(q, k, v, f, W, initial_state=h0, doc_ids=doc_ids, return_final_state=True)

    inputs = [t.requires_grad_() for t in (q, k, v, f, W, h0)]
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


def test_tier1_custom_op_opcheck():
    g = torch.Generator().manual_seed(8)
    shapes = [(2, 3, H, DK), (2, 3, H, DK), (2, 3, H, DV), (2, 3, H), (H, DV, DV), (H, 2, DK, DV)]
    args = [torch.randn(*s, dtype=torch.float64, generator=g).requires_grad_() for s in shapes]
    results = torch.library.opcheck(torch.ops.megacpp.m2rnn_scan_fwd.default, args)
    assert all(r == "SUCCESS" for r in results.values()), results


def test_tier1_compiled_graph_size_independent_of_length():
    # The scan is one opaque node: an unrolled loop would make compile time grow with t.
    m = make_mixer(9, dtype=torch.float32)
    sizes = []

    def count_nodes(gm, example_inputs):
        sizes.append(len(gm.graph.nodes))
        return gm.forward

    for t in (2, 16):
        torch._dynamo.reset()
        torch.compile(m, backend=count_nodes, fullgraph=True)(torch.randn(B, t, D))
    assert sizes[0] == sizes[1]


def test_tier1_scan_fp32_compute_for_bf16_inputs():
    q, k, v, f, W = (t.to(torch.bfloat16) for t in scan_inputs(5))
    y, final = m2rnn_scan(q, k, v, f, W, return_final_state=True)
    assert y.dtype == torch.bfloat16 and final.dtype == torch.float32
    y32 = m2rnn_scan(q.float(), k.float(), v.float(), f.float(), W.float())
    assert torch.equal(y, y32.to(torch.bfloat16))


def make_mixer(seed: int = 0, dtype: torch.dtype = torch.float64) -> M2RNN:
    """Tiny mixer with a non-zero out_proj (house init zeroes it) and a non-identity W."""
    torch.manual_seed(seed)
    m = M2RNN(D, M2RNNConfig(n_heads=H, key_dim=DK, value_dim=DV), layer_idx=0)
    with torch.no_grad():
        m.out_proj.weight.normal_(std=0.3)
        m.W.add_(0.2 * torch.randn_like(m.W))
    return m.to(dtype)


def test_tier3_mixer_matches_formula():
    m = make_mixer(6)
    x = torch.randn(B, T, D, dtype=torch.float64)
    q, k, v = (x @ m.qkv.weight.T).split([H * DK, H * DK, H * DV], dim=-1)
    q, k = (t.reshape(B, T, H, DK) for t in (q, k))
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    a = x @ m.a_proj.weight.T
    f = torch.exp(-m.A_log.exp() * torch.log1p(torch.exp(a + m.dt_bias)))
    y, _ = naive_scan(q, k, v.reshape(B, T, H, DV), f, m.W)
    gate = x @ m.gate.weight.T
    expected = (gate * torch.sigmoid(gate) * y.reshape(B, T, H * DV)) @ m.out_proj.weight.T
    torch.testing.assert_close(m(x), expected, **F64_TOL)


def test_tier3_forward_step_equals_forward():
    m = make_mixer(1)
    x = torch.randn(B, 5, D, dtype=torch.float64)
    cache = m.init_cache(B, 5, device="cpu", dtype=torch.float64)
    assert cache["h"].shape == (B, H, DK, DV)
    steps = torch.cat([m.forward_step(x[:, s : s + 1], cache) for s in range(5)], dim=1)
    torch.testing.assert_close(steps, m(x), **F64_TOL)


def test_tier3_mixer_doc_ids_isolate_documents():
    """Breaks when _keep_mask keeps every step (f never zeroed at a start): the second document sees the first."""
    m = make_mixer(2)
    x = torch.randn(1, 6, D, dtype=torch.float64)
    y = m(x, document_segments(torch.tensor([[0, 0, 0, 1, 1, 1]])))
    torch.testing.assert_close(y[:, 3:], m(x[:, 3:]), **F64_TOL)
    torch.testing.assert_close(y[:, :3], m(x[:, :3]), **F64_TOL)


def test_tier1_init_and_hints():
    torch.manual_seed(0)
    m = M2RNN(D, M2RNNConfig(n_heads=H, key_dim=DK, value_dim=DV), layer_idx=0)
    assert not m.out_proj.weight.any() and not m(torch.randn(1, 3, D)).any()
    assert torch.equal(m.W, torch.eye(DV).expand(H, DV, DV))
    hints = collect_param_hints(m)
    assert hints["qkv.weight"].qkv_split == (H * DK, H * DK, H * DV)
    assert hints["a_proj.weight"].optimizer == "adamw"
    assert m.A_log.ndim == 1 and m.dt_bias.ndim == 1 and m.W.ndim == 3
    A = m.A_log.exp()
    assert bool(((A >= 1.0) & (A <= 16.0)).all())
    dt = torch.nn.functional.softplus(m.dt_bias)
    assert bool(((dt >= 0.001 * (1 - 1e-5)) & (dt <= 0.1 * (1 + 1e-5))).all())  # fp32 round trip


def test_tier3_gradients_finite_and_reach_every_parameter():
    m = make_mixer(3, dtype=torch.float32)
    x = torch.randn(B, T, D, requires_grad=True)
    m(x, document_segments(torch.tensor([[0, 0, 0, 1, 1, 1, 1]] * B))).square().sum().backward()
    for name, p in [("x", x), *m.named_parameters()]:
        assert bool(torch.isfinite(p.grad).all()), name
        assert bool(p.grad.abs().sum() > 0), name


def test_tier2_rerun_identical():
    m = make_mixer(4, dtype=torch.float32)
    x = torch.randn(B, T, D)
    runs = []
    for _ in range(2):
        m.zero_grad()
        y = m(x)
        y.sum().backward()
        runs.append((y, [p.grad.clone() for p in m.parameters()]))
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1], strict=True))


def test_tier3_compiles_fullgraph_eager_backend_zero_breaks():
    m = make_mixer(5, dtype=torch.float32)
    x = torch.randn(B, T, D)
    segments = document_segments(torch.tensor([[0, 0, 1, 1, 1, 1, 1]] * B))
    torch._dynamo.reset()
    counters.clear()
    y = torch.compile(m, backend="eager", fullgraph=True)(x, segments)
    y.sum().backward()
    assert len(counters["graph_break"]) == 0, dict(counters["graph_break"])
    torch.testing.assert_close(y, m(x, segments), **F32_TOL)


def test_tier3_dynamic_batch_compiles_once():
    # The compile policy marks the batch axis dynamic: one graph for every batch size.
    m = make_mixer(6, dtype=torch.float32)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(m, backend="eager", fullgraph=True)
    for b in (2, 3, 5):
        x = torch.randn(b, T, D)
        if b == 2:
            torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x), m(x), **F32_TOL)
    assert counters["stats"]["unique_graphs"] == 1
    assert len(counters["graph_break"]) == 0
