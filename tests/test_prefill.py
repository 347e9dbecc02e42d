"""Prefill (issue 36): a prompt read in one pass per block leaves every decode cache as reading it token by
token through ``forward_step`` leaves it, and the logits before and after agree, for every block kind, the
Engram branch, the n-gram hash and the `tiny` hybrid; generation reads its prompt so.

Tier 3 throughout, fp32. Both paths compute the same sums in a different order: the chunked Mamba-3 scan
sums each chunk as matrix products and passes states between chunks where the step adds one token at a
time, the causal attention's softmax runs over the prompt's rows at once, and Mamba-3's angle is one cumsum
reduced mod 2 pi at the end, not reduced at every step. Each output is bounded relative to the largest
output of the reference (`assert_close_scaled`); the bounds are stated beside the tests.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import Tensor, nn

from megacpp.model.engram import Engram, NgramHashEmbedding
from megacpp.model.hybrid import HybridLM
from megacpp.model.prefill import module_prefill, prefill_by_steps
from megacpp.model.registry import BLOCK_KINDS
from megacpp.runtime.generate import generate_tokens
from tests.helpers import assert_close_scaled
from tests.test_hybrid import LOGIT_ATOL, randomize, shrunk

D_MODEL = 64
# 1, odd lengths inside a Mamba-3 chunk (shrunk: chunk_size 8) and one past a chunk boundary, and 67 = 8 * 8 + 3.
LENGTHS = (1, 7, 9, 67)
NEW_TOKENS = 5
# Relative to the reference's largest output (or cache entry): fp32 rounds each operation by u = 6e-8, and
# a sum of up to 72 terms in another order differs by at most 72 u = 4.3e-6 of its terms' scale; through
# the projections around it a few times that. Measured at most 4.3e-6 (Mamba-3's state at 67 tokens); a
# wrong slot, a lost term or an off-by-one position moves these outputs by more than 1e-2.
TOL = 2e-5


def mixer(kind: str, seed: int = 0, **overrides) -> nn.Module:
    """A mixer of `kind` ("A", "M", "R", "E", "F" or "engram") at the sizes of tests/test_hybrid.py."""
    cfg = shrunk("tiny")
    if kind == "engram":
        module = Engram(D_MODEL, dataclasses.replace(cfg.engram, **overrides), 0)
    else:
        block_kind = BLOCK_KINDS[kind]
        sub = dataclasses.replace(getattr(cfg, block_kind.config_field), **overrides)
        module = block_kind.mixer_class()(D_MODEL, sub, 0)
    return randomize(module, seed).eval()


def step_by_step(module: nn.Module, x: Tensor, cache) -> Tensor:
    """The reference: `forward_step` on each position in turn."""
    return torch.cat([module.forward_step(x[:, i : i + 1], cache) for i in range(x.shape[1])], dim=1)


def entries(cache, name: str = "") -> Iterator[tuple[str, Tensor]]:
    """Every tensor of a (nested) cache with its path."""
    if isinstance(cache, dict):
        for key, value in cache.items():
            yield from entries(value, f"{name}/{key}")
    elif isinstance(cache, list):
        for i, value in enumerate(cache):
            yield from entries(value, f"{name}/{i}")
    else:
        yield name, cache


def wrapped(angle: Tensor) -> Tensor:
    """An angle difference brought into [-pi, pi): caches keep angles mod 2 pi, so 2 pi - eps and 0 agree."""
    return torch.remainder(angle + math.pi, 2 * math.pi) - math.pi


def assert_same_caches(actual, expected, tol: float) -> None:
    """Integer entries (positions, counts, token ids) equal; float entries within tol of their scale."""
    for (name, got), (name_ref, want) in zip(entries(actual), entries(expected), strict=True):
        assert name == name_ref and got.shape == want.shape and got.dtype == want.dtype, name
        if not want.is_floating_point():
            assert torch.equal(got, want), name
        elif name.endswith("/angle"):
            err = wrapped(got.double() - want.double()).abs().max().item()
            assert err <= tol * 2 * math.pi, f"{name}: {err:.3e}"
        else:
            try:
                assert_close_scaled(got, want, tol)
            except AssertionError as e:
                raise AssertionError(f"{name}: {e}") from None


def read_then_step(module: nn.Module, x: Tensor, prompt: int, read: Callable) -> tuple[Tensor, dict, dict]:
    """x's first `prompt` positions read by `read(module, x, cache)`, the rest stepped: every output, the
    cache's entries after the prompt and the cache at the end."""
    cache = module.init_cache(x.shape[0], x.shape[1], x.device, x.dtype)
    head = read(module, x[:, :prompt], cache)
    after_prompt = {name: t.clone() for name, t in entries(cache)}
    tail = step_by_step(module, x[:, prompt:], cache)
    return torch.cat([head, tail], dim=1), after_prompt, cache


def _inputs(b: int, t: int, seed: int) -> Tensor:
    return torch.randn(b, t, D_MODEL, generator=torch.Generator().manual_seed(seed))


def _assert_prefill_matches_steps(module: nn.Module, x: Tensor, prompt: int) -> None:
    with torch.no_grad():
        y, after_prompt, end = read_then_step(module, x, prompt, module_prefill)
        y_ref, after_prompt_ref, end_ref = read_then_step(module, x, prompt, step_by_step)
    assert torch.isfinite(y_ref).all()
    assert_close_scaled(y, y_ref, TOL)
    assert_same_caches(after_prompt, after_prompt_ref, TOL)
    assert_same_caches(end, end_ref, TOL)


@pytest.mark.parametrize("batch", (1, 2))
@pytest.mark.parametrize("prompt", LENGTHS)
@pytest.mark.parametrize("kind", ("A", "M", "R", "E", "F", "engram"))
def test_tier3_rel_2e5_each_kind_prefill_then_steps_equals_steps(kind, prompt, batch):
    """Each block kind and the Engram branch: the prompt's outputs, the cache after it and the outputs
    and cache of NEW_TOKENS further steps, prefill against forward_step token by token."""
    module = mixer(kind, seed=prompt)
    _assert_prefill_matches_steps(module, _inputs(batch, prompt + NEW_TOKENS, seed=10 * prompt + batch), prompt)


@pytest.mark.parametrize(("kind", "overrides"), [
    ("A", {"softcap": 5.0}),
    ("A", {"qk_clip": "activation", "qk_norm": False, "qk_clip_tau": 0.5}),
    ("A", {"n_kv_heads": 4}),
    ("M", {"n_groups": 2, "chunk_size": 16}),
    ("E", {"capacity_factor": 0.25}),
    ("E", {"routing": "expert_choice", "capacity_factor": 0.5}),
    ("E", {"shared_expert": False}),
    ("F", {"activation": "swiglu"}),
    ("engram", {"gate": False}),
])
def test_tier3_rel_2e5_kind_variants_prefill_then_steps_equals_steps(kind, overrides):
    """The settings with a path of their own: the soft-capped softmax (dense mask), the activation QK-clip
    (each query's bound against the keys so far), plain multi-head attention, grouped Mamba-3 B/C, MoE
    where the training forward drops tokens (capacity) or looks ahead (expert choice): the prefill follows
    the steps, where each token is a sequence of its own."""
    module = mixer(kind, seed=3, **overrides)
    _assert_prefill_matches_steps(module, _inputs(2, 67 + NEW_TOKENS, seed=5), 67)


@pytest.mark.parametrize("overrides", [{"capacity_factor": 0.25}, {"routing": "expert_choice", "capacity_factor": 0.5}])
def test_tier3_moe_forward_differs_from_the_steps_where_it_drops_or_looks_ahead(overrides):
    """Guards the MoE variants above: there the training forward on the whole prompt is not what the steps
    compute (else following the steps would prove nothing)."""
    module = mixer("E", seed=3, **overrides)
    x = _inputs(2, 67, seed=5)
    with torch.no_grad():
        steps = step_by_step(module, x, module.init_cache(2, 67, x.device, x.dtype))
        assert (module(x) - steps).abs().max() > 1e-3


def test_tier3_activation_qk_clip_scales_the_prefill():
    """Guards the QK-clip variant above: at tau 0.5 the clip changes the output (else matching the steps
    would not test the per-query bound)."""
    clipped = mixer("A", seed=3, qk_clip="activation", qk_norm=False, qk_clip_tau=0.5)
    plain = mixer("A", seed=3, qk_norm=False)
    x = _inputs(2, 9, seed=5)
    with torch.no_grad():
        difference = (clipped.prefill(x, clipped.init_cache(2, 9, "cpu", x.dtype))
                      - plain.prefill(x, plain.init_cache(2, 9, "cpu", x.dtype)))
    assert difference.abs().max() > 1e-3


@pytest.mark.parametrize("prompt", (1, 3, 67))
def test_tier3_ngram_hash_prefill_then_steps_equals_steps(prompt):
    """The n-gram hash embedding: its output and its recent ids (tier 1: ids are exact) after the prompt
    and after further steps; outputs within TOL (the projection's matmul runs over other shapes)."""
    cfg = shrunk("tiny").engram
    module = randomize(NgramHashEmbedding(97, D_MODEL, cfg), seed=prompt).eval()
    tokens = torch.randint(0, 97, (2, prompt + NEW_TOKENS), generator=torch.Generator().manual_seed(prompt))
    with torch.no_grad():
        cache = module.init_cache(2, "cpu")
        head = module.prefill(tokens[:, :prompt], cache)
        after_prompt = cache["previous"].clone()
        y = torch.cat([head, step_by_step(module, tokens[:, prompt:], cache)], dim=1)
        ref_cache = module.init_cache(2, "cpu")
        y_ref = step_by_step(module, tokens[:, :prompt], ref_cache)
        assert torch.equal(after_prompt, ref_cache["previous"])
        y_ref = torch.cat([y_ref, step_by_step(module, tokens[:, prompt:], ref_cache)], dim=1)
    assert torch.equal(cache["previous"], ref_cache["previous"])
    assert_close_scaled(y, y_ref, TOL)


def _tiny(seed: int, **attention) -> HybridLM:
    """The `tiny` preset's pattern (every kind, Engram, the n-gram hash) at test width, every weight filled."""
    cfg = shrunk("tiny", depth=5)
    assert set(cfg.pattern) == set("AEMFR") and cfg.engram.layers and cfg.engram.ngram_hash
    cfg.attention = dataclasses.replace(cfg.attention, **attention)
    return randomize(HybridLM(cfg), seed=seed).eval()


def _tokens(batch: int, length: int, seed: int) -> Tensor:
    return torch.randint(0, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


def _steps(model: HybridLM, tokens: Tensor, cache) -> list[Tensor]:
    return [model.forward_step(tokens[:, i : i + 1], cache) for i in range(tokens.shape[1])]


@pytest.mark.parametrize("batch", (1, 2))
@pytest.mark.parametrize("prompt", LENGTHS)
def test_tier3_atol_1e4_tiny_hybrid_prefill_then_steps_equals_steps(prompt, batch):
    """The whole model: the prompt's last logits (also against the forward's), NEW_TOKENS decode steps after
    it and every cache entry after the prompt. Logits within test_hybrid's LOGIT_ATOL (its reasoning); cache
    entries within TOL (measured at most 1.8e-6 through the five sublayers)."""
    model = _tiny(seed=prompt)
    tokens = _tokens(batch, prompt + NEW_TOKENS, seed=prompt + batch)
    with torch.no_grad():
        cache = model.init_cache(batch, prompt + NEW_TOKENS)
        last = model.prefill(tokens[:, :prompt], cache)
        after_prompt = {name: t.clone() for name, t in entries(cache)}
        later = _steps(model, tokens[:, prompt:], cache)
        ref_cache = model.init_cache(batch, prompt + NEW_TOKENS)
        ref = _steps(model, tokens[:, :prompt], ref_cache)
        after_prompt_ref = {name: t.clone() for name, t in entries(ref_cache)}
        ref += _steps(model, tokens[:, prompt:], ref_cache)
        forward = model(tokens[:, :prompt])[:, -1:]
    assert last.shape == (batch, 1, 97)
    assert len(after_prompt) == 13  # A: k, v, pos, 2 tables; M: 4; R: h; Engram: 2; n-gram: 1
    assert (last - ref[prompt - 1]).abs().max().item() <= LOGIT_ATOL
    assert (last - forward).abs().max().item() <= LOGIT_ATOL
    for got, want in zip(later, ref[prompt:], strict=True):
        assert (got - want).abs().max().item() <= LOGIT_ATOL
    assert_same_caches(after_prompt, after_prompt_ref, TOL)
    assert_same_caches(cache, ref_cache, TOL)


def test_tier3_atol_1e4_a_prompt_longer_than_max_seq_len():
    """A 40-token prompt on a model whose attention tables stop at 16 (the forward refuses it): the prefill
    reads the rows the cache computed past them, as the steps do, and equals the forward of the same
    weights with 45-row tables; the module's own tables stay as they were."""
    prompt = 40
    model = _tiny(seed=4, max_seq_len=16)
    longer = _tiny(seed=4, max_seq_len=prompt + NEW_TOKENS)
    longer.load_state_dict(model.state_dict())
    tokens = _tokens(1, prompt + NEW_TOKENS, seed=4)
    with torch.no_grad():
        with pytest.raises(ValueError, match="max_seq_len=16"):
            model(tokens[:, :prompt])
        cache = model.init_cache(1, prompt + NEW_TOKENS)
        last = model.prefill(tokens[:, :prompt], cache)
        later = _steps(model, tokens[:, prompt:], cache)
        ref = _steps(model, tokens, model.init_cache(1, prompt + NEW_TOKENS))
        full = longer(tokens)
    assert (last - ref[prompt - 1]).abs().max().item() <= LOGIT_ATOL
    assert (last[:, 0] - full[:, prompt - 1]).abs().max().item() <= LOGIT_ATOL
    for i, got in enumerate(later, start=prompt):
        assert (got - ref[i]).abs().max().item() <= LOGIT_ATOL
        assert (got[:, 0] - full[:, i]).abs().max().item() <= LOGIT_ATOL
    assert model.blocks[0].mixer.rope_cos.shape[0] == 16


def test_a_prompt_longer_than_the_cache_is_refused():
    module = mixer("A")
    x = _inputs(1, 9, seed=0)
    with pytest.raises(ValueError, match="a prompt of 9 tokens does not fit a cache of 5"):
        module.prefill(x, module.init_cache(1, 5, "cpu", x.dtype))


def greedy_by_steps(model: HybridLM, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding with the prompt read token by token (generation before prefill existed)."""
    cache = model.init_cache(1, len(prompt) + max_new_tokens)
    logits = _steps(model, torch.tensor([prompt]), cache)[-1]
    tokens = []
    for _ in range(max_new_tokens):
        token = int(logits[0, -1].argmax())
        tokens.append(token)
        logits = model.forward_step(torch.tensor([[token]]), cache)
    return tokens


@pytest.mark.parametrize("length", (1, 70))
def test_tier3_greedy_generation_gives_the_tokens_of_the_token_by_token_prompt(length):
    """generate_tokens reads its prompt with one prefill: greedy decoding picks the same 16 tokens as with
    the prompt read step by step (the logits agree within LOGIT_ATOL, far below these models' gaps)."""
    model = _tiny(seed=11)
    prompt = _tokens(1, length, seed=length)[0].tolist()
    with torch.no_grad():
        expected = greedy_by_steps(model, prompt, 16)
    assert list(generate_tokens(model, prompt, 16, temperature=0.0, top_k=0)) == expected


class StepsOnly(nn.Module):
    """A mixer with a decode cache and no prefill of its own: what a new block kind may be."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def init_cache(self, batch_size: int, max_len: int, device, dtype) -> dict[str, Tensor]:
        return self.inner.init_cache(batch_size, max_len, device, dtype)

    def forward_step(self, x: Tensor, cache: dict[str, Tensor]) -> Tensor:
        return self.inner.forward_step(x, cache)


def test_tier1_a_mixer_without_prefill_steps_through_the_prompt():
    """The fallback calls the mixer's forward_step position by position: the same operations in the same
    order as the reference loop, so outputs and cache are bitwise equal."""
    module = StepsOnly(mixer("M", seed=2))
    assert not hasattr(module, "prefill")
    x = _inputs(2, 9, seed=2)
    with torch.no_grad():
        cache, ref_cache = (module.init_cache(2, 9, "cpu", x.dtype) for _ in range(2))
        y = module_prefill(module, x, cache)
        y_ref = step_by_step(module, x, ref_cache)
    assert torch.equal(y, y_ref)
    assert torch.equal(prefill_by_steps(module, x, module.init_cache(2, 9, "cpu", x.dtype)), y_ref)
    for (name, got), (_, want) in zip(entries(cache), entries(ref_cache), strict=True):
        assert torch.equal(got, want), name


def test_tier3_atol_1e4_a_model_with_a_block_kind_without_prefill(monkeypatch):
    """tests/test_extending.py's toy kind (no prefill, no cache) between attention and Mamba-3: the model's
    prefill steps through the prompt for it and reads it in one pass elsewhere."""
    from tests.test_extending import ToyModelConfig
    from tests.toy_block import ToyMixer

    monkeypatch.setitem(BLOCK_KINDS, "T", BLOCK_KINDS["F"].__class__("T", "toy", "toy", "tests.toy_block:ToyMixer"))
    cfg = ToyModelConfig(vocab_size=97, d_model=D_MODEL, pattern="ATM", depth=3)
    cfg.attention.n_heads, cfg.attention.n_kv_heads, cfg.attention.head_dim = 4, 2, 16
    cfg.mamba.d_state, cfg.mamba.head_dim, cfg.mamba.chunk_size = 8, 16, 8
    model = randomize(HybridLM(cfg), seed=6).eval()
    assert isinstance(model.blocks[1].mixer, ToyMixer) and not hasattr(model.blocks[1].mixer, "prefill")
    tokens = _tokens(2, 11, seed=6)
    with torch.no_grad():
        last = model.prefill(tokens, model.init_cache(2, 11))
        ref = _steps(model, tokens, model.init_cache(2, 11))[-1]
    assert (last - ref).abs().max().item() <= LOGIT_ATOL
