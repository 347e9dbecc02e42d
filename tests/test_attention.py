"""Attention mixer (A): against an independent float64 reference, document masking, FlexAttention vs
the SDPA mask path, KV-cache decode, MuonClip hooks and torch.compile."""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch._dynamo.utils import counters

from megacpp.model.attention import Attention, attend
from megacpp.model.attention_config import AttentionConfig
from megacpp.model.hints import collect_param_hints
from megacpp.model.rope import rope_table
from megacpp.model.segments import Segments, document_segments, segments_of

D_MODEL = 32
FP32_TOL = 200 * torch.finfo(torch.float32).eps  # fp32 module vs float64 reference, O(1) outputs
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# Module-level FlexAttention runs on CUDA only (no CPU backward); the SDPA paths run everywhere.
BACKENDS = [("sdpa", "cpu")] + [(b, "cuda") for b in ("sdpa", "flex") if torch.cuda.is_available()]
FLEX_EAGER_WARNING = ".*flex_attention called without torch.compile.*"
GQA = [(4, 4), (4, 2), (4, 1)]  # (n_heads, n_kv_heads): ratios 1, 2, 4
DOC_IDS = [5, 5, 5, 7, 7, 7, 7, 5, 5, 9, 9, 9, 9]  # id 5 reused by a later, separate document


def make(seed: int, n_heads: int = 4, n_kv_heads: int = 2, **overrides) -> Attention:
    """Attention with a random (not zero) output projection so outputs are informative."""
    torch.manual_seed(seed)
    cfg = AttentionConfig(n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=8, **overrides)
    module = Attention(D_MODEL, cfg, layer_idx=0)
    nn.init.normal_(module.proj.weight, std=module.proj.in_features**-0.5)
    return module


def rand(seed: int, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def segments(doc_ids: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each document: a new one wherever the id changes."""
    starts = [i for i in range(len(doc_ids)) if i == 0 or doc_ids[i] != doc_ids[i - 1]]
    return list(zip(starts, starts[1:] + [len(doc_ids)], strict=True))


def reference_qkv(module: Attention, x: Tensor, doc_ids: list[int] | None) -> tuple[Tensor, Tensor, Tensor]:
    """float64 q, k, v (b, heads, t, hd): per-head projections, RMS QK-norm, RoPE as complex rotation."""
    cfg, (b, t, _) = module.cfg, x.shape
    hd = cfg.head_dim
    qkv = (x.double() @ module.qkv.weight.double().T).view(b, t, -1, hd).transpose(1, 2)
    q, k, v = qkv.split([cfg.n_heads, cfg.n_kv_heads, cfg.n_kv_heads], dim=1)
    if cfg.qk_norm:
        q, k = (z / torch.sqrt(z.pow(2).mean(-1, keepdim=True) + 1e-6) for z in (q, k))
    bounds = segments(doc_ids) if doc_ids is not None else [(0, t)]
    pos = torch.cat([torch.arange(end - start) for start, end in bounds]).double()
    freqs = cfg.rope_theta ** (-torch.arange(0, hd, 2).double() / hd)
    rot = torch.polar(torch.ones(t, hd // 2, dtype=torch.float64), pos[:, None] * freqs)

    def rope(z: Tensor) -> Tensor:
        zc = torch.complex(z[..., : hd // 2], z[..., hd // 2 :]) * rot
        return torch.cat([zc.real, zc.imag], dim=-1)

    return rope(q), rope(k), v


def reference_row_bounds(module: Attention, q: Tensor, k: Tensor) -> Tensor:
    """(b, H): each row's max |q_t| times its max |k_s| over the head's kv head, / sqrt(hd)."""
    kv_head = [h * module.n_kv_heads // module.n_heads for h in range(module.n_heads)]
    q_max = q.norm(dim=-1).amax(dim=2)
    k_max = k.norm(dim=-1).amax(dim=2)[:, kv_head]
    return q_max * k_max / math.sqrt(module.head_dim)


def reference_bound(module: Attention, q: Tensor, k: Tensor) -> Tensor:
    return reference_row_bounds(module, q, k).amax(dim=0)


def reference_logits(module: Attention, q: Tensor, k: Tensor) -> Tensor:
    kv_head = [h * module.n_kv_heads // module.n_heads for h in range(module.n_heads)]
    return q @ k[:, kv_head].transpose(-1, -2) / math.sqrt(module.head_dim)


def reference_attention(module: Attention, x: Tensor, doc_ids: list[int] | None = None) -> Tensor:
    """Explicit softmax over a causal (+ same-document) mask with kv heads repeated, in float64."""
    cfg, (b, t, _) = module.cfg, x.shape
    q, k, v = reference_qkv(module, x, doc_ids)
    if cfg.qk_clip == "activation":
        q = q * (cfg.qk_clip_tau / reference_row_bounds(module, q, k)).clamp(max=1.0)[:, :, None, None]
    logits = reference_logits(module, q, k)
    if cfg.softcap > 0:
        logits = cfg.softcap * torch.tanh(logits / cfg.softcap)
    allowed = torch.zeros(t, t, dtype=torch.bool)
    for start, end in segments(doc_ids) if doc_ids is not None else [(0, t)]:
        allowed[start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.bool).tril()
    kv_head = [h * module.n_kv_heads // module.n_heads for h in range(module.n_heads)]
    y = logits.masked_fill(~allowed, -math.inf).softmax(-1) @ v[:, kv_head]
    return y.transpose(1, 2).reshape(b, t, -1) @ module.proj.weight.double().T


def assert_fp32_close(actual: Tensor, expected: Tensor) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), atol=FP32_TOL, rtol=FP32_TOL)


@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("heads", GQA)
@pytest.mark.parametrize("t", [7, 13])
def test_tier3_matches_naive_reference(heads: tuple[int, int], softcap: float, qk_norm: bool, t: int) -> None:
    module = make(1, *heads, softcap=softcap, qk_norm=qk_norm, backend="sdpa")
    x = rand(100 + t, 2, t, D_MODEL)
    assert_fp32_close(module(x), reference_attention(module, x))


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("heads", GQA)
def test_tier3_documents_equal_running_them_alone(
    heads: tuple[int, int], softcap: float, backend: str, device: str
) -> None:
    """Breaks when the forward ignores doc_ids (plain causal mask): later documents attend to earlier ones."""
    module = make(2, *heads, softcap=softcap, backend=backend).to(device)
    x = rand(3, 2, len(DOC_IDS), D_MODEL).to(device)
    doc_ids = torch.tensor([DOC_IDS, DOC_IDS], device=device)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=FLEX_EAGER_WARNING)
        packed = module(x, document_segments(doc_ids))
        for start, end in segments(DOC_IDS):
            assert_fp32_close(packed[:, start:end], module(x[:, start:end]))
    assert_fp32_close(packed.cpu(), reference_attention(module.cpu(), x.cpu(), DOC_IDS))


@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("device", DEVICES)
def test_tier3_flex_path_matches_sdpa_mask_path(device: str, softcap: float) -> None:
    b, t, hd = 2, len(DOC_IDS), 16
    q, k, v = rand(4, b, 4, t, hd), rand(5, b, 2, t, hd), rand(6, b, 2, t, hd)
    q, k, v = q.to(device), k.to(device), v.to(device)
    doc_ids = torch.tensor([DOC_IDS, sorted(DOC_IDS)], device=device)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=FLEX_EAGER_WARNING)
        for docs in (None, doc_ids):
            flex = attend(q, k, v, segments_of(docs, t, q.device, "flex"), softcap)
            assert_fp32_close(flex, attend(q, k, v, segments_of(docs, t, q.device, "dense"), softcap))


@pytest.mark.parametrize("qk_clip", ["off", "weight"])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("heads", GQA)
def test_tier3_kv_cache_decode_equals_forward(heads: tuple[int, int], softcap: float, qk_clip: str) -> None:
    module = make(7, *heads, softcap=softcap, qk_clip=qk_clip)
    x = rand(8, 2, 9, D_MODEL)
    full = module(x)
    cache = module.init_cache(2, max_len=12, device="cpu", dtype=torch.float32)
    steps = [module.forward_step(x[:, i : i + 1], cache) for i in range(x.shape[1])]
    assert_fp32_close(torch.cat(steps, dim=1), full)
    assert cache["pos"].item() == x.shape[1]


@pytest.mark.parametrize("heads", GQA)
def test_tier3_logit_bound_is_brute_force_bound_and_above_true_max(heads: tuple[int, int]) -> None:
    module = make(9, *heads, qk_norm=False, qk_clip="weight")
    x = rand(10, 3, 11, D_MODEL)
    module(x)
    q, k, _ = reference_qkv(module, x, None)
    expected = reference_bound(module, q, k)
    assert module.logit_bound.dtype == torch.float32 and module.logit_bound.shape == (module.n_heads,)
    assert_fp32_close(module.logit_bound, expected)
    true_max = reference_logits(module, q, k).amax(dim=(0, 2, 3))  # every (q, k) pair of a row, causal or not
    assert torch.all(module.logit_bound.double() >= true_max)
    # The batch's bound is the largest of its rows': any split of the rows gives the same (tier 1).
    halves = [make(9, *heads, qk_norm=False, qk_clip="weight") for _ in range(2)]
    for half, rows in zip(halves, (x[:1], x[1:]), strict=True):
        half(rows)
    assert torch.equal(torch.maximum(halves[0].logit_bound, halves[1].logit_bound), module.logit_bound)


def test_tier3_activation_clip_caps_effective_logits() -> None:
    tau = 3.0
    module = make(11, 4, 2, qk_norm=False, qk_clip="activation", qk_clip_tau=tau)
    with torch.no_grad():
        module.qkv.weight.mul_(4.0)  # push raw logits well above tau
    x = rand(12, 2, 11, D_MODEL)
    out = module(x)
    q, k, _ = reference_qkv(module, x, None)
    raw_bound = reference_bound(module, q, k)
    assert torch.all(raw_bound > tau) and reference_logits(module, q, k).max() > tau
    clipped_q = q * (tau / reference_row_bounds(module, q, k)).clamp(max=1.0)[:, :, None, None]
    assert reference_logits(module, clipped_q, k).max() <= tau * (1 + FP32_TOL)
    assert_fp32_close(module.logit_bound, raw_bound)  # the recorded bound is the pre-clip one
    assert_fp32_close(out, reference_attention(module, x))


def test_tier1_qk_clip_weight_mode_leaves_forward_unchanged() -> None:
    off, weight = make(13, qk_norm=False), make(13, qk_norm=False, qk_clip="weight")
    x = rand(14, 2, 9, D_MODEL)
    assert torch.equal(off(x), weight(x))
    assert not hasattr(off, "logit_bound") and torch.all(weight.logit_bound > 0)
    assert "logit_bound" not in weight.state_dict()  # non-persistent


def test_qkv_split_sizes_hint_and_init() -> None:
    module = Attention(D_MODEL, AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=8), layer_idx=0)
    sizes = collect_param_hints(module)["qkv.weight"].qkv_split
    assert sizes == (32, 16, 16) and sum(sizes) == module.qkv.weight.shape[0]
    assert (module.n_heads, module.n_kv_heads, module.head_dim) == (4, 2, 8)
    assert torch.equal(module(rand(15, 1, 5, D_MODEL)), torch.zeros(1, 5, D_MODEL))  # zero out proj


def test_max_seq_len_is_enforced_for_the_forward() -> None:
    module = make(21, max_seq_len=8)
    with pytest.raises(ValueError, match="max_seq_len"):
        module(rand(22, 1, 9, D_MODEL))


@pytest.mark.parametrize("heads", GQA)
def test_tier3_decode_past_the_rope_tables_equals_the_reference(heads: tuple[int, int]) -> None:
    """A decode cache longer than max_seq_len carries longer tables: 13 steps through tables of 5 rows
    against the float64 reference (which has no tables), and the module's own tables are left alone."""
    module = make(25, *heads, max_seq_len=5)
    x = rand(26, 2, 13, D_MODEL)
    cache = module.init_cache(2, max_len=13, device="cpu", dtype=torch.float32)
    steps = torch.cat([module.forward_step(x[:, i : i + 1], cache) for i in range(13)], dim=1)
    assert_fp32_close(steps, reference_attention(module, x))
    assert module.rope_cos.shape == (5, 4) and cache["rope_cos"].shape == (13, 4)
    assert torch.equal(cache["rope_cos"][:5], module.rope_cos) and torch.equal(cache["rope_sin"][:5], module.rope_sin)
    short = module.init_cache(2, max_len=5, device="cpu", dtype=torch.float32)
    assert short["rope_cos"] is module.rope_cos  # no copy when the module's tables are long enough


def test_tier1_meta_device_build_then_reset_equals_eager_build() -> None:
    """reset_parameters also refills the non-persistent RoPE tables, which to_empty leaves garbage."""
    cfg = AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=8, qk_norm=False, qk_clip="weight")
    with torch.device("meta"):
        meta_built = Attention(D_MODEL, cfg, layer_idx=0)
    meta_built.to_empty(device="cpu")
    torch.manual_seed(23)
    meta_built.reset_parameters()
    eager_built = Attention(D_MODEL, cfg, layer_idx=0)
    torch.manual_seed(23)
    eager_built.reset_parameters()
    for module in (meta_built, eager_built):
        nn.init.constant_(module.proj.weight, 0.01)
    x = rand(24, 2, 7, D_MODEL)
    assert torch.equal(meta_built(x), eager_built(x))
    cos, sin = rope_table(cfg.max_seq_len, cfg.head_dim, cfg.rope_theta)
    assert torch.equal(meta_built.rope_cos, cos) and torch.equal(meta_built.rope_sin, sin)
    assert torch.equal(meta_built.logit_bound, eager_built.logit_bound)


def compile_without_breaks(fn: Callable[..., Tensor], backend: str, *args: Tensor | Segments) -> Tensor:
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    assert not counters["graph_break"], dict(counters["graph_break"])
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_tier1_attend_flex_compiles_fullgraph(device: str) -> None:
    """The flex block layout built by create_block_mask with a document mask_mod, inside the compiled
    function (as in compile mode "model") or outside it (a region input, as in "blocks"), and the
    soft-cap score_mod trace without breaks."""
    t = len(DOC_IDS)
    q, k, v = (rand(20 + i, 2, h, t, 16).to(device) for i, h in enumerate((4, 2, 2)))
    doc_ids = torch.tensor([DOC_IDS, sorted(DOC_IDS)], device=device)

    def attend_built_inside(q: Tensor, k: Tensor, v: Tensor, doc_ids: Tensor) -> Tensor:
        return attend(q, k, v, segments_of(doc_ids, t, q.device, "flex"), 2.0)

    def attend_given(q: Tensor, k: Tensor, v: Tensor, segments: Segments) -> Tensor:
        return attend(q, k, v, segments, 2.0)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=FLEX_EAGER_WARNING)
        expected = attend_built_inside(q, k, v, doc_ids)
    assert torch.equal(compile_without_breaks(attend_built_inside, "eager", q, k, v, doc_ids), expected)
    segments = segments_of(doc_ids, t, q.device, "flex")
    assert torch.equal(compile_without_breaks(attend_given, "eager", q, k, v, segments), expected)


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
@pytest.mark.parametrize("overrides", [
    {},
    {"softcap": 2.0, "qk_norm": False, "qk_clip": "activation", "qk_clip_tau": 1.0},
])
def test_tier1_compile_fullgraph_eager_backend_matches_eager(
    overrides: dict, backend: str, device: str
) -> None:
    module = make(16, backend=backend, **overrides).to(device)
    x = rand(17, 2, len(DOC_IDS), D_MODEL).to(device)
    doc_ids = torch.tensor([DOC_IDS, sorted(DOC_IDS)], device=device)
    segments = document_segments(doc_ids)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=FLEX_EAGER_WARNING)
        expected = module(x, segments)
    assert torch.equal(compile_without_breaks(module, "eager", x, segments), expected)


def test_tier3_compile_fullgraph_inductor() -> None:
    module = make(18, backend="sdpa", qk_clip="weight")
    x, doc_ids = rand(19, 2, len(DOC_IDS), D_MODEL), torch.tensor([DOC_IDS, sorted(DOC_IDS)])
    segments = document_segments(doc_ids)
    expected = module(x, segments)
    assert_fp32_close(compile_without_breaks(module, "inductor", x, segments), expected)
