"""OptimizerStack: step order, schedule, MuonClip after the step, grad clipping, bit-exact resume."""
from __future__ import annotations

import copy
import io
import math

import pytest
import torch

from megacpp.optim import OptimConfig, OptimizerStack, WarmupStableDecay, build_optimizers, find_attention_modules
from tests.test_optim_standins import TinyHybrid, batch

TAU = 100.0


def _model(seed: int = 0, explode_head: int | None = None) -> TinyHybrid:
    torch.manual_seed(seed)
    model = TinyHybrid()
    if explode_head is not None:
        with torch.no_grad():
            w = model.blocks[0].mixer.qkv.weight
            w[explode_head * 8:(explode_head + 1) * 8] *= 300.0
            w[32:48] *= 30.0  # key rows of both kv heads
    return model


def _train(model: TinyHybrid, stack: OptimizerStack, steps: int, first_batch: int = 0) -> None:
    for i in range(steps):
        idx, tgt = batch(seed=first_batch + i)
        stack.zero_grad()
        model(idx, tgt).backward()
        stack.step()



def _with_clip(model, mode: str, tau: float = TAU):
    """QK-clip is configured on the attention modules (model.attention.qk_clip in a real model)."""
    for attn in find_attention_modules(model):
        attn.qk_clip, attn.qk_clip_tau = mode, tau
    return model

def test_tier1_step_order_is_optimizers_then_clip_then_scheduler() -> None:
    model = _with_clip(_model(), "weight")
    cfg = OptimConfig(warmup_steps=3, decay_steps=4)
    stack = build_optimizers(model, cfg, total_steps=10, log=None)
    calls: list[tuple[str, float]] = []

    def record(name: str, fn):
        def wrapped(*args, **kwargs):
            calls.append((name, stack.by_name["muon"].param_groups[0]["lr"].item()))
            return fn(*args, **kwargs)
        return wrapped

    stack.by_name["muon"].step = record("muon", stack.by_name["muon"].step)
    stack.by_name["adamw"].step = record("adamw", stack.by_name["adamw"].step)
    stack.clip.apply = record("clip", stack.clip.apply)
    stack.scheduler.step = record("scheduler", stack.scheduler.step)
    _train(model, stack, steps=6)
    assert [name for name, _ in calls] == ["muon", "adamw", "clip", "scheduler"] * 6
    # The optimizer steps of step k run with the lr of position k; the scheduler moves only afterwards.
    schedule = WarmupStableDecay.from_config(cfg, total_steps=10)
    base = stack.by_name["muon"].param_groups[0]["base_lr"]
    muon_lrs = [lr for name, lr in calls if name == "muon"]
    assert muon_lrs == [torch.tensor(base * schedule.multiplier(k), dtype=torch.float64).item() for k in range(6)]


def test_tier1_schedule_values() -> None:
    s = WarmupStableDecay(total_steps=10, warmup_steps=2, decay_steps=4, final_frac=0.1)
    assert [s.multiplier(k) for k in range(10)] == pytest.approx(
        [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.1 + 0.9 * 4 / 4, 0.1 + 0.9 * 3 / 4, 0.1 + 0.9 * 2 / 4, 0.1 + 0.9 / 4],
        rel=1e-15, abs=0,
    )
    cos = WarmupStableDecay(total_steps=8, decay_steps=4, shape="cosine")
    assert cos.multiplier(4) == 1.0 and cos.multiplier(6) == pytest.approx(0.5, rel=1e-15, abs=0)
    assert WarmupStableDecay(total_steps=None, warmup_steps=2).multiplier(10**6) == 1.0


def test_tier1_schedule_from_config_fractions_and_errors() -> None:
    s = WarmupStableDecay.from_config(OptimConfig(warmup_frac=0.1, decay_frac=0.3), total_steps=100)
    assert (s.warmup_steps, s.decay_steps) == (10, 30)
    s = WarmupStableDecay.from_config(OptimConfig(warmup_frac=0.1, warmup_steps=7), total_steps=100)
    assert s.warmup_steps == 7
    assert WarmupStableDecay.from_config(OptimConfig(), total_steps=None).decay_steps == 0
    with pytest.raises(ValueError, match="exceed"):
        WarmupStableDecay(total_steps=5, warmup_steps=3, decay_steps=3)
    with pytest.raises(ValueError, match="total_steps"):
        WarmupStableDecay.from_config(OptimConfig(decay_steps=3), total_steps=None)


def test_tier3_clip_after_step_bounds_exploding_head() -> None:
    # Tolerance: the recomputed bound may exceed tau by fp32 rounding, 1e-5 relative.
    model = _with_clip(_model(explode_head=1), "weight")
    stack = build_optimizers(model, OptimConfig(), log=None)
    idx, tgt = batch(seed=0)
    stack.zero_grad()
    model(idx, tgt).backward()
    attn = model.blocks[0].mixer
    assert attn.logit_bound[1] > TAU
    stack.step()
    assert stack.metrics["muon_clip/n_clipped"].item() >= 1
    with torch.no_grad():
        x = model.blocks[0].norm(model.tok_embed(idx) + model.ngram_embed(idx))
        # weights are post-step and post-clip; the bound of this input is recomputed from them
        after = attn.bound(x)
    stepped_bound = stack.metrics["muon_clip/max_logit"]
    assert after.max() <= TAU * (1 + 1e-5) < stepped_bound


def test_tier2_clip_leaves_other_kv_group_as_unclipped_twin() -> None:
    runs = {}
    for mode in ("weight", "off"):
        model = _with_clip(_model(explode_head=1), mode)
        stack = build_optimizers(model, OptimConfig(), log=None)
        _train(model, stack, steps=1)
        runs[mode] = model.blocks[0].mixer.qkv.weight.detach()
    clipped, twin = runs["weight"], runs["off"]
    # query heads 2, 3 (rows 16:32), their kv head's key rows (40:48) and all value rows (48:) are equal
    assert torch.equal(clipped[16:32], twin[16:32]) and torch.equal(clipped[40:], twin[40:])
    assert not torch.equal(clipped[8:16], twin[8:16])  # the exploding query head was scaled


def test_tier3_grad_clip_norm() -> None:
    """The clip reports the global norm (1e-5 relative: fp32 norms of a few thousand values) and steps
    exactly as an unclipped stack does on gradients multiplied by torch's clip_grad_norm_ coefficient,
    bit for bit (the optimizers apply the coefficient as they read the gradients); the gradients
    themselves are left as the backward produced them."""
    model = _model()
    twin = copy.deepcopy(model)
    stack = build_optimizers(model, OptimConfig(grad_clip_norm=0.05), log=None)
    unclipped = build_optimizers(twin, OptimConfig(grad_clip_norm=0.0), log=None)
    idx, tgt = batch(seed=0)
    model(idx, tgt).backward()
    twin(idx, tgt).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    assert norm > 0.05
    stack.step()
    assert math.isclose(stack.metrics["grad_norm"].item(), norm.item(), rel_tol=1e-5)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    torch.nn.utils.clip_grad_norm_(list(twin.parameters()), 0.05, foreach=True)
    unclipped.step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
    assert all(opt.grad_scale is None for opt in stack.optimizers)
    stack.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_tier1_resume_is_bitwise() -> None:
    cfg = OptimConfig(weight_decay=0.05, warmup_steps=2, decay_steps=3)
    model = _with_clip(_model(explode_head=2), "weight")
    stack = build_optimizers(model, cfg, total_steps=8, log=None)
    _train(model, stack, steps=3)
    saved_model = copy.deepcopy(model.state_dict())
    buffer = io.BytesIO()
    torch.save((stack.state_dict(), stack.moments()), buffer)  # the checkpoint's parts: weights_only-loadable
    buffer.seek(0)
    saved_stack, saved_moments = torch.load(buffer, weights_only=True)
    _train(model, stack, steps=4, first_batch=3)

    model2 = _with_clip(_model(seed=1), "weight")  # different init: everything must come from the checkpoint
    model2.load_state_dict(saved_model)
    stack2 = build_optimizers(model2, cfg, total_steps=8, log=None)
    stack2.load_state_dict(saved_stack)
    live = stack2.moments()
    assert live.keys() == saved_moments.keys()
    for key, value in saved_moments.items():
        live[key].copy_(value)
    assert stack2.scheduler.position == 3
    saved_max = saved_stack["clip"]["metrics"]["muon_clip/max_logit"]
    assert torch.equal(stack2.clip.metrics["muon_clip/max_logit"], saved_max)
    _train(model2, stack2, steps=4, first_batch=3)
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert stack.by_name["muon"].param_groups[0]["lr"].item() == stack2.by_name["muon"].param_groups[0]["lr"].item()


def test_schedule_without_decay_steps_stays_stable_to_the_end() -> None:
    """decay_frac 0.2 of a 2-step run rounds to 0 decay steps: no division by zero, multiplier 1."""
    sched = WarmupStableDecay.from_config(OptimConfig(decay_frac=0.2), total_steps=2)
    assert sched.decay_steps == 0
    assert [sched.multiplier(step) for step in range(4)] == [1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize(("setting", "device", "model_compiled", "by_auto", "compiled"), [
    ("auto", "cpu", True, True, False), ("auto", "cuda", True, True, True), ("auto", "cuda", False, True, False),
    ("auto", "cuda", True, False, False), (True, "cpu", False, True, True), (True, "cuda", True, False, True),
    (False, "cuda", True, True, False),
])
def test_tier1_compile_step_auto_compiles_on_cuda_only(setting, device, model_compiled, by_auto, compiled) -> None:
    """optim.compile_step = "auto" (the default) compiles an optimizer's step where the parameters are on
    CUDA, the model is compiled and the optimizer's spec asks for it (AdamW does not: its eager CUDA step
    is torch's fused kernel), and keeps the eager reference step elsewhere; true and false are obeyed as
    given."""
    from megacpp.optim.registry import OPTIMIZERS
    from megacpp.optim.stack import resolve_compile_step

    assert OptimConfig().compile_step == "auto"
    assert (OPTIMIZERS["muon"].compiled_by_auto, OPTIMIZERS["adamw"].compiled_by_auto) == (True, False)
    assert resolve_compile_step(setting, torch.device(device), model_compiled, by_auto) is compiled
    if device == "cpu":
        stack = build_optimizers(_model(), OptimConfig(compile_step=setting), total_steps=10, log=None)
        assert all(opt.compile_step is compiled for opt in stack.optimizers)
        state = "compiled" if compiled else "eager"
        assert stack.describe_steps() == f"optimizer steps: muon {state}, adamw {state}"
