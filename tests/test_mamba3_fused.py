"""The fused Mamba-3 scan (megacpp/ops/mamba3_fused.py, Triton kernels in megacpp/ops/mamba3_triton.py)
against its references. Tier in each name.

The kernels run under Triton's CPU interpreter, which only takes effect when TRITON_INTERPRET=1 is set
before triton is imported; so one subprocess (`errors_by_case`) runs every kernel case, the rerun, the
compile check and torch.library.opcheck, and the tests assert on its JSON report.

Reference: the per-head biases and rotation (`biased_heads`, `rotate_pairs`) followed by
`mamba3_scan_sequential`, the per-token loop, all in float64; the kernels get the same values in
float32 (x and z in bfloat16 in one case). Forward outputs, the final state and the gradients of every
input (x, z, B, C, both biases, theta, adt, dt, lam, D and the three parts of the initial state) of
the loss sum(y * gy) + sum(H_final * gH) + sum(B_prev_final * gB) are compared.

Tolerance (float32, unit roundoff u = 2^-24): every compared value is a sum of products whose longest
rounding chain is a dot of at most 64 terms, a row sum and a reverse cumulation over a chunk (<= 64
each), the state passing over at most 5 chunks and the decays' exp2 of a difference of cumulative
sums (|A| <= 64 * max|adt| ~ 70, absolute error ~70 u in the exponent): under 300 roundings, so
|error| <= 300 u * sum|terms|. The inputs (unit-scale x, B, C, z; decays <= 1) keep sum|terms| within
~5 max|reference|, so the bound is TOL = 1e-4 * max|reference|. Observed: below 8e-7 (a margin of
over 100x), while a dropped or misplaced term is off by O(max|reference|): mutating the kernels gave
0.71 (σ instead of γ on the diagonal), 0.47 (a decay term dropped from d adt), 1.75 (resets ignored)
and 1.28 (C's part of d theta dropped) times max|reference|. Values stored in bfloat16 (y, dx, dz in
the bf16 case) add one bf16 unit in the last place, 2^-7 relative (the interpreter truncates where
the GPU rounds); y's cotangent is given in bfloat16 there, as autograd hands it to the kernels. dz
carries two: it is computed from y before the gate, which the forward stores in x's dtype for the
backward (as mamba_ssm's kernels do), and is stored in z's.
"""
from __future__ import annotations

import json

import pytest
import torch

from megacpp.config import Config, ConfigError, apply_overrides
from megacpp.model.mamba3 import Mamba3
from megacpp.model.mamba3_config import Mamba3Config
from megacpp.model.segments import document_segments
from megacpp.ops import mamba3_fused, triton_choice
from megacpp.ops.mamba3_fused import (
    ScanKernelError,
    biased_heads,
    mamba3_fused_scan,
    mamba3_fused_scan_reference,
    rotate_pairs,
)
from megacpp.ops.mamba3_limits import triton_size_reason
from megacpp.ops.mamba3_scan import mamba3_scan, mamba3_scan_sequential
from megacpp.presets import preset
from megacpp.validate import validate_config
from tests.helpers import interpreted_report

TOL = 1e-4
BF16_STORE = 2.0**-7
# (b, t, h, g, p, n, n_angles, chunk, doc resets, initial state, x/z dtype): odd lengths and lengths
# that do not divide the chunk, chunk sizes 16/32/64, g = 1 and 2, head_dim and d_state / 2 below the
# 16-wide tiles (masked padding), full and partial rotation, t = 1, d_state 256, which every kernel
# walks or spreads over the grid in several column blocks, and head_dim and d_state whose rows are not
# a multiple of 16 bytes.
CASES = [
    (2, 37, 2, 1, 16, 32, 8, 16, True, True, "float32"),
    (1, 50, 4, 2, 8, 32, 16, 32, True, False, "float32"),
    (3, 16, 2, 2, 32, 16, 4, 16, False, True, "float32"),
    (2, 1, 2, 2, 16, 32, 8, 16, False, True, "float32"),
    (1, 70, 2, 1, 16, 32, 8, 64, True, True, "float32"),
    (2, 23, 2, 1, 16, 32, 8, 16, True, True, "bfloat16"),
    (1, 40, 2, 1, 16, 256, 16, 16, True, True, "float32"),
    (1, 19, 2, 1, 16, 32, 0, 16, True, False, "float32"),  # no rotated pairs: the op takes zero angles
    # Rows of 40 and 72 bytes: TMA cannot read them, so the descriptors read padded copies (`_descriptor`).
    (2, 21, 2, 1, 10, 18, 4, 16, True, True, "float32"),
]
BF16_STORED = {"y", "x", "z"}  # the output and the gradients of x and z (their inputs are bf16)
# Operands of the products in float16 (matmul_dtype; the interpreter's bf16 tl.dot is broken, fp16's is
# not): the chain then writes every chunk's entering state and state gradient in float16 to a buffer of
# its own, which the three readout kernels read. Bound: each product term carries at most two fp16
# roundings of its operands, 2 u16 (u16 = 2^-11) relative, the entering states' storage being the same
# rounding the products make anyway; with sum|terms| <= ~5 max|reference| (as for TOL) that is
# 10 u16 = 4.9e-3 of max|reference|. Observed below 1e-3; a chain that wrote nothing there gives O(1).
FP16_CASE = (2, 37, 2, 1, 16, 32, 8, 16, True, True, "float32")
FP16_TOL = 10 * 2.0**-11


def _case_id(case: tuple) -> str:
    return "b{}_t{}_h{}_g{}_p{}_n{}_a{}_L{}_docs{}_init{}_{}".format(*case)


def _doc_ids(b: int, t: int, chunk: int) -> torch.Tensor:
    """Row 0: starts at 3, 4 (a one-token document), at a chunk start and inside the next chunk; other
    rows: every 7 tokens, shifted per row."""
    ids = torch.zeros(b, t, dtype=torch.long)
    for row in range(b):
        starts = [3, 4, chunk, chunk + 5] if row == 0 else list(range(row, t, 7))
        for s in starts:
            if 0 < s < t:
                ids[row, s:] += 1
    return ids


def _inputs(case: tuple, seed: int) -> tuple[dict, tuple | None, torch.Tensor | None, dict]:
    """Scan inputs (float32; x, z in the case's dtype), initial state, doc ids and cotangents."""
    b, t, h, g, p, n, na, _, docs, init, dtype = case
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=gen)

    dt = 0.02 + 0.5 * rand(b, t, h)
    inp = {
        "x": randn(b, t, h, p).to(getattr(torch, dtype)), "z": randn(b, t, h, p).to(getattr(torch, dtype)),
        "B": randn(b, t, g, n), "C": randn(b, t, g, n),
        "B_bias": 1.0 + 0.3 * randn(h, n), "C_bias": 1.0 + 0.3 * randn(h, n),
        "theta": (0.5 * randn(b, t, h, na)).cumsum(1),
        "adt": -(0.05 + 2.0 * rand(b, t, h)) * dt, "dt": dt, "lam": rand(b, t, h), "D": randn(h),
    }
    state = (randn(b, h, p, n), randn(b, h, n), randn(b, h, p)) if init else None
    # y's cotangent reaches the kernels in y's dtype (autograd casts it back): give the reference those values.
    cot = {"y": randn(b, t, h, p).to(getattr(torch, dtype)).float(), "H": randn(b, h, p, n), "B_prev": randn(b, h, n)}
    return inp, state, _doc_ids(b, t, case[7]) if docs else None, cot


def _sequential_reference(inp: dict, state, doc_ids, chunk: int):
    B = rotate_pairs(biased_heads(inp["B"], inp["B_bias"]), inp["theta"])
    C = rotate_pairs(biased_heads(inp["C"], inp["C_bias"]), inp["theta"])
    return mamba3_scan_sequential(inp["x"], B, C, inp["adt"], inp["dt"], inp["lam"], D=inp["D"], z=inp["z"],
                                  initial_state=state, doc_ids=doc_ids, return_final_state=True)


def _triton(inp: dict, state, doc_ids, chunk: int, matmul_dtype=None):
    return mamba3_fused_scan(**inp, initial_state=state, doc_ids=doc_ids, chunk_size=chunk, return_final_state=True,
                             matmul_dtype=matmul_dtype, kernel="triton")


def _leaves(inp: dict, state, dtype=None) -> tuple[dict, tuple | None]:
    """Fresh leaf tensors requiring grad, cast to dtype when given."""
    leaves = {k: v.detach().to(dtype or v.dtype).requires_grad_() for k, v in inp.items()}
    init = None if state is None else tuple(s.detach().to(dtype or s.dtype).requires_grad_() for s in state)
    return leaves, init


def _outputs_and_grads(outputs, leaves: dict, init, cot: dict) -> dict[str, torch.Tensor]:
    """y, the final state and the gradients of every leaf for the loss in the module docstring."""
    y, (H, B_prev, _) = outputs
    work = torch.promote_types(H.dtype, torch.float32)
    loss = sum((out.to(work) * cot[k].to(work)).sum() for k, out in (("y", y), ("H", H), ("B_prev", B_prev)))
    names = [*leaves, *(("H0", "B_prev0", "x_prev") if init else ())]
    grads = torch.autograd.grad(loss, [*leaves.values(), *(init or ())])
    return {"y": y.detach(), "H": H.detach(), "B_prev": B_prev.detach(), **dict(zip(names, grads, strict=True))}


def _triton_results(inp: dict, state, doc_ids, cot: dict, chunk: int, matmul_dtype=None) -> dict[str, torch.Tensor]:
    leaves, init = _leaves(inp, state)
    return _outputs_and_grads(_triton(leaves, init, doc_ids, chunk, matmul_dtype), leaves, init, cot)


def _case_errors(case: tuple, seed: int, matmul_dtype=None) -> dict[str, tuple[float, float]]:
    inp, state, doc_ids, cot = _inputs(case, seed)
    chunk = case[7]
    got = _triton_results(inp, state, doc_ids, cot, chunk, matmul_dtype)
    leaves, init = _leaves(inp, state, torch.float64)
    ref = _outputs_and_grads(_sequential_reference(leaves, init, doc_ids, chunk), leaves, init, cot)
    errors = {}
    for name, want in ref.items():
        have = got[name]
        assert have.shape == want.shape, name
        if not want.numel():  # theta's gradient where no pair rotates: the shapes agreeing is all there is
            errors[name] = (0.0, 0.0, str(have.dtype))
            continue
        errors[name] = ((have.double() - want).abs().max().item(), want.abs().max().item(), str(have.dtype))
    return errors


# The rerun and compile checks use a case with resets, an initial state and one chunk: cheap to interpret.
CHECK_CASE = CASES[4]


def _rerun_equal() -> bool:
    inp, state, doc_ids, cot = _inputs(CHECK_CASE, seed=11)
    first = _triton_results(inp, state, doc_ids, cot, CHECK_CASE[7])
    second = _triton_results(inp, state, doc_ids, cot, CHECK_CASE[7])
    return all(torch.equal(first[k], second[k]) for k in first)


def _compile_report() -> dict:
    """torch.compile(fullgraph=True) of the Triton path, forward and backward (aot_eager runs the real
    kernels): graph breaks, and whether the results equal the eager Triton path's."""
    from torch._dynamo.utils import counters

    inp, state, doc_ids, cot = _inputs(CHECK_CASE, seed=12)
    chunk = CHECK_CASE[7]

    def scan(leaves: dict, init, doc_ids):
        return _triton(leaves, init, doc_ids, chunk)

    torch._dynamo.reset()
    counters.clear()
    leaves, init = _leaves(inp, state)
    compiled_scan = torch.compile(scan, fullgraph=True, backend="aot_eager")
    compiled = _outputs_and_grads(compiled_scan(leaves, init, doc_ids), leaves, init, cot)
    eager = _triton_results(inp, state, doc_ids, cot, chunk)
    return {"graph_breaks": sum(counters["graph_break"].values()),
            "equal": all(torch.equal(compiled[k], eager[k]) for k in eager)}


def _opcheck() -> str:
    """torch.library.opcheck of the forward op on a small case: schema, fake tensors, autograd registration."""
    from megacpp.ops.mamba3_fused import _fused_fwd

    inp, state, _, _ = _inputs((1, 21, 2, 1, 16, 32, 8, 16, False, True, "float32"), seed=13)
    f = torch.float32
    log_decay = inp["adt"].clone()
    log_decay[:, 5] = float("-inf")  # a document starts at t = 5
    args = (inp["x"], inp["z"], inp["B"], inp["C"], inp["B_bias"], inp["C_bias"], inp["theta"], log_decay,
            inp["dt"], inp["lam"] * inp["dt"], inp["D"], state[0], 16, f)
    args = tuple(a.requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    results = torch.library.opcheck(_fused_fwd, args)
    failed = {k: v for k, v in results.items() if v != "SUCCESS"}
    return "ok" if not failed else json.dumps(failed)


def _mixer_errors() -> dict[str, tuple[float, float]]:
    """The M mixer with scan_kernel "triton" against "reference" (both float32), output and parameter
    gradients: the kernels read x, z, B and C as strided views of the in_proj output there."""
    results = []
    for kernel in ("reference", "triton"):
        cfg = Mamba3Config(d_state=32, head_dim=16, n_groups=2, chunk_size=16, scan_kernel=kernel)
        torch.manual_seed(30)
        mixer = Mamba3(32, cfg, layer_idx=0)
        with torch.no_grad():
            for param in mixer.parameters():
                param.add_(0.3 * torch.randn_like(param))
        u = torch.randn(2, 41, 32, generator=torch.Generator().manual_seed(31))
        y = mixer(u, document_segments(_doc_ids(2, 41, 16)))
        grads = torch.autograd.grad(y.square().sum(), list(mixer.parameters()))
        results.append({"y": y.detach(), **dict(zip([n for n, _ in mixer.named_parameters()], grads, strict=True))})
    ref, got = results
    return {k: ((got[k] - ref[k]).abs().max().item(), ref[k].abs().max().item()) for k in ref}


def _report() -> None:
    """Subprocess entry point: prints every result as one JSON line."""
    report = {"cases": {_case_id(c): _case_errors(c, seed) for seed, c in enumerate(CASES)},
              "fp16_operands": _case_errors(FP16_CASE, seed=14, matmul_dtype=torch.float16), "mixer": _mixer_errors(),
              "rerun_equal": _rerun_equal(), "compile": _compile_report(), "opcheck": _opcheck()}
    print(json.dumps(report))


@pytest.fixture(scope="module")
def report() -> dict:
    return interpreted_report("tests.test_mamba3_fused", timeout=600)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_tier3_triton_matches_sequential_reference_interpreted(report, case):
    errors = report["cases"][_case_id(case)]
    assert set(errors) == {"y", "H", "B_prev", "x", "z", "B", "C", "B_bias", "C_bias", "theta", "adt", "dt", "lam",
                           "D", *(("H0", "B_prev0", "x_prev") if case[9] else ())}
    for name, (err, scale, dtype) in errors.items():
        stores = (2 if name == "z" else 1) if dtype == "torch.bfloat16" else 0
        bound = (TOL + stores * BF16_STORE) * max(scale, 1e-30)
        assert err <= bound, f"{name}: max abs diff {err:.3g} > {bound:.3g} (max |ref| {scale:.3g}, {dtype})"
    if case[10] == "bfloat16":
        stored = {name for name, (_, _, dtype) in errors.items() if dtype == "torch.bfloat16"}
        assert stored == BF16_STORED  # the gradients come back in their inputs' dtypes


def test_tier3_fp16_operands_match_sequential_reference_interpreted(report):
    errors = report["fp16_operands"]
    assert {"y", "H", "x", "B", "C", "theta", "adt", "H0"} <= set(errors)
    for name, (err, scale, dtype) in errors.items():
        bound = FP16_TOL * max(scale, 1e-30)
        assert err <= bound, f"{name}: max abs diff {err:.3g} > {bound:.3g} (max |ref| {scale:.3g}, {dtype})"


def test_tier3_mixer_with_triton_kernel_matches_reference_interpreted(report):
    errors = report["mixer"]
    assert {"y", "in_proj.weight", "B_bias", "C_bias", "D", "dt_bias", "out_proj.weight"} <= set(errors)
    for name, (err, scale) in errors.items():
        assert err <= TOL * scale, f"{name}: max abs diff {err:.3g} > {TOL * scale:.3g}"


def test_tier2_triton_rerun_bitwise_identical(report):
    assert report["rerun_equal"]


def test_tier2_triton_compiled_fullgraph_no_breaks_equals_eager(report):
    assert report["compile"] == {"graph_breaks": 0, "equal": True}


def test_tier1_triton_ops_pass_opcheck(report):
    assert report["opcheck"] == "ok"


# ---------------------------------------------------------------- CPU, in process (no Triton launch)


def _mixer_inputs(b: int, t: int, h: int, g: int, p: int, n: int, na: int, seed: int, dtype=torch.float32) -> dict:
    inp, _, _, _ = _inputs((b, t, h, g, p, n, na, 16, False, False, "float32"), seed)
    inp["x"], inp["z"] = inp["x"].to(dtype), inp["z"].to(dtype)
    return inp


def _before_fused_op(inp: dict, doc_ids, chunk: int, matmul_dtype) -> torch.Tensor:
    """The mixer's scan as it was written before the fused op (repeat to heads, bias, rotate, scan)."""
    rep = inp["B_bias"].shape[0] // inp["B"].shape[2]
    B = rotate_pairs(inp["B"].repeat_interleave(rep, dim=2) + inp["B_bias"], inp["theta"])
    C = rotate_pairs(inp["C"].repeat_interleave(rep, dim=2) + inp["C_bias"], inp["theta"])
    if matmul_dtype is not None:
        B, C = B.to(matmul_dtype), C.to(matmul_dtype)
    return mamba3_scan(inp["x"], B, C, inp["adt"], inp["dt"], inp["lam"], D=inp["D"], z=inp["z"], doc_ids=doc_ids,
                       chunk_size=chunk, matmul_dtype=matmul_dtype)


@pytest.mark.parametrize("g,dtype,matmul_dtype", [(1, torch.float32, None), (2, torch.float32, None),
                                                  (2, torch.bfloat16, torch.bfloat16)])
def test_tier1_reference_equals_the_mixer_scan_before_the_op(g, dtype, matmul_dtype):
    inp = _mixer_inputs(2, 29, 4, g, 8, 16, 4, seed=20, dtype=dtype)
    doc_ids = _doc_ids(2, 29, 8)
    got = mamba3_fused_scan_reference(**inp, doc_ids=doc_ids, chunk_size=8, matmul_dtype=matmul_dtype)
    assert torch.equal(got, _before_fused_op(inp, doc_ids, 8, matmul_dtype))


def test_tier1_auto_on_cpu_is_the_reference(monkeypatch):
    def no_triton(*args, **kwargs):
        raise AssertionError("the Triton path was taken on CPU")

    monkeypatch.setattr(mamba3_fused, "_triton_scan", no_triton)
    monkeypatch.setattr(triton_choice, "INTERPRETED", True)  # not even under the interpreter
    inp = _mixer_inputs(2, 19, 2, 1, 8, 16, 4, seed=21)
    doc_ids = _doc_ids(2, 19, 8)
    for kernel in ("auto", "reference"):
        got = mamba3_fused_scan(**inp, doc_ids=doc_ids, chunk_size=8, kernel=kernel)
        assert torch.equal(got, mamba3_fused_scan_reference(**inp, doc_ids=doc_ids, chunk_size=8))


def _old_mixer_forward(mixer: Mamba3, u: torch.Tensor, doc_ids) -> torch.Tensor:
    """Mamba3.forward as written before the fused op (per-head B/C built in the projection)."""
    b, t, _ = u.shape
    h, p, g, n = mixer.n_heads, mixer.cfg.head_dim, mixer.cfg.n_groups, mixer.cfg.d_state
    z, x, B, C, dd_dt, dd_A, trap, theta = mixer.in_proj(u).split(mixer.split_sizes, dim=-1)
    dt = torch.nn.functional.softplus(dd_dt.float() + mixer.dt_bias)
    A = torch.clamp(-torch.nn.functional.softplus(dd_A.float()), max=-mixer.cfg.A_floor)
    angle_step = torch.pi * torch.tanh(theta.float())[:, :, None, :] * dt[..., None]
    B = mixer.B_norm(B.float().view(b, t, g, n)).repeat_interleave(h // g, dim=2) + mixer.B_bias
    C = mixer.C_norm(C.float().view(b, t, g, n)).repeat_interleave(h // g, dim=2) + mixer.C_bias
    # The angles' document-restarting cumsum as the mixer wrote it then (dim 1, autograd).
    total = angle_step.cumsum(dim=1)
    starts = document_segments(doc_ids).start_offsets
    angles = total - (total - angle_step).gather(1, starts[:, :, None, None].expand_as(angle_step))
    y = mamba3_scan(x.view(b, t, h, p), rotate_pairs(B, angles), rotate_pairs(C, angles), A * dt, dt,
                    torch.sigmoid(trap.float()), D=mixer.D, z=z.view(b, t, h, p), doc_ids=doc_ids,
                    chunk_size=mixer.cfg.chunk_size)
    return mixer.out_proj(y.flatten(2))


@pytest.mark.parametrize("n_groups", [1, 2])
def test_tier1_mixer_on_cpu_unchanged_by_the_fused_op(n_groups):
    cfg = Mamba3Config(d_state=8, head_dim=4, n_groups=n_groups, chunk_size=8)
    torch.manual_seed(22)
    mixer = Mamba3(16, cfg, layer_idx=0)
    with torch.no_grad():
        for param in mixer.parameters():
            param.add_(0.3 * torch.randn_like(param))
    u = torch.randn(2, 21, 16, generator=torch.Generator().manual_seed(23))
    doc_ids = _doc_ids(2, 21, 8)
    new = mixer(u, document_segments(doc_ids))
    old = _old_mixer_forward(mixer, u, doc_ids)
    assert torch.equal(new, old)
    params = list(mixer.parameters())
    new_grads = torch.autograd.grad(new.square().sum(), params)
    old_grads = torch.autograd.grad(old.square().sum(), params)
    assert all(torch.equal(got, want) for got, want in zip(new_grads, old_grads, strict=True))


def test_tier1_triton_refused_where_it_cannot_run(monkeypatch):
    monkeypatch.setattr(triton_choice, "INTERPRETED", False)
    inp = _mixer_inputs(1, 5, 2, 1, 8, 16, 4, seed=24)
    with pytest.raises(ScanKernelError, match="need CUDA tensors, got cpu"):
        mamba3_fused_scan(**inp, kernel="triton")
    with pytest.raises(ScanKernelError, match="kernel must be one of"):
        mamba3_fused_scan(**inp, kernel="cuda")


def test_tier1_triton_support_rules():
    assert triton_size_reason(64, 128, 32, 64) is None  # `small`
    assert triton_size_reason(32, 16, 4, 16) is None  # `tiny`'s sizes with a supported chunk
    assert "d_state must be even" in triton_size_reason(64, 15, 3, 64)
    assert "d_state must be even" in triton_size_reason(64, 512, 8, 64)
    assert "head_dim must be at most" in triton_size_reason(256, 128, 32, 64)
    assert "n_angles" in triton_size_reason(64, 16, 9, 64)
    assert "chunk_size must be one of" in triton_size_reason(64, 128, 32, 48)


def test_tier1_scan_kernel_setting_is_checked():
    with pytest.raises(ConfigError, match=r"scan_kernel.*expected one of 'auto', 'reference', 'triton'"):
        apply_overrides(Config(), [("model.mamba.scan_kernel", "cuda")])
    with pytest.raises(ValueError, match="Mamba3Config.scan_kernel: expected one of"):
        Mamba3(16, Mamba3Config(d_state=8, head_dim=4, scan_kernel="cuda"), layer_idx=0)
    cfg = apply_overrides(preset("small"), [("model.mamba.scan_kernel", "triton")])
    validate_config(cfg)
    cfg = apply_overrides(cfg, [("model.mamba.chunk_size", "48")])
    with pytest.raises(ConfigError, match="chunk_size must be one of"):
        validate_config(cfg)


def test_tier1_a_descriptor_copies_only_layouts_that_tma_cannot_read():
    """`mamba3_triton._descriptor`: TMA needs a 16-byte aligned base and 16-byte aligned strides (all but the
    last). An aligned view is described in place; a view at an odd offset or with odd row strides is
    described over an aligned copy holding the same values, with the view's shape."""
    from megacpp.ops import mamba3_triton

    aligned = torch.randn(2, 5, 3, 16)
    desc = mamba3_triton._descriptor(aligned, [1, 4, 1, 16])
    assert desc.base.data_ptr() == aligned.data_ptr() and list(desc.strides) == list(aligned.stride())
    at_offset = torch.randn(1 + 2 * 5 * 3 * 16)[1:].view(2, 5, 3, 16)
    narrow_rows = torch.randn(2, 7, 13, dtype=torch.bfloat16)[..., :12]  # rows of 26 bytes
    for view, block in ((at_offset, [1, 4, 1, 16]), (narrow_rows, [1, 4, 8])):
        desc = mamba3_triton._descriptor(view, block)
        size = view.element_size()
        assert desc.base.data_ptr() != view.data_ptr() and desc.base.data_ptr() % 16 == 0
        assert all(step * size % 16 == 0 for step in desc.strides[:-1]) and desc.strides[-1] == 1
        assert list(desc.shape) == list(view.shape) and torch.equal(desc.base, view)
