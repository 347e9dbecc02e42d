"""Parameter counts per block kind (total and active) and FLOPs per token for MFU."""
from __future__ import annotations

from torch import nn

from megacpp.model.hybrid import HybridLM
from megacpp.model.registry import BLOCK_KINDS


def _numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


def _inactive(block) -> int:
    """Parameters a token does not touch: the mixer's optional `inactive_parameters` hook."""
    hook = getattr(block.mixer, "inactive_parameters", None)
    return hook() if hook is not None else 0


def parameter_rows(model: HybridLM) -> list[tuple[str, int, int, int]]:
    """(name, sublayers, total params, active params) per block kind, then the other parts."""
    rows = []
    for kind, info in BLOCK_KINDS.items():
        blocks = [b for b in model.blocks if b.kind == kind]
        if blocks:
            total = sum(_numel(b.mixer) + _numel(b.norm) for b in blocks)
            rows.append((f"{kind} {info.description}", len(blocks), total, total - sum(_inactive(b) for b in blocks)))
    engrams = [b.engram for b in model.blocks if b.engram is not None]
    if engrams:
        n = sum(_numel(e) for e in engrams)
        rows.append(("Engram branches", len(engrams), n, n))
    for label, module in (("token embedding", model.tok_embed), ("n-gram hash embedding", model.ngram_embed),
                          ("final norm + LM head", [model.norm_f, model.lm_head]), ("MTP heads", model.mtp)):
        modules = module if isinstance(module, list) else [module]
        n = sum(_numel(m) for m in modules if m is not None)
        if n:
            rows.append((label, 0, n, n))
    return rows


def parameter_parts(model: HybridLM) -> list[tuple[str, list[nn.Parameter]]]:
    """The model's parameters split into named parts, each parameter in exactly one: every block kind
    present (its mixers and their norms, named by the pattern letter), then "engram", "embedding" (token
    and n-gram hash), "head" (final norm + LM head) and "mtp", each only if the model has it."""
    parts = []
    for kind in BLOCK_KINDS:
        blocks = [b for b in model.blocks if b.kind == kind]
        if blocks:
            parts.append((kind, [p for b in blocks for m in (b.mixer, b.norm) for p in m.parameters()]))
    named_modules = (("engram", [b.engram for b in model.blocks]), ("embedding", [model.tok_embed, model.ngram_embed]),
                     ("head", [model.norm_f, model.lm_head]), ("mtp", [model.mtp]))
    for name, modules in named_modules:
        params = [p for m in modules if m is not None for p in m.parameters()]
        if params:
            parts.append((name, params))
    return parts


def parameter_table(model: HybridLM) -> str:
    rows = parameter_rows(model)
    total = sum(r[2] for r in rows)
    active = sum(r[3] for r in rows)
    lines = [f"{'part':<28}{'count':>6}{'total':>14}{'active':>14}"]
    lines += [f"{name:<28}{count or '':>6}{t:>14,}{a:>14,}" for name, count, t, a in rows]
    lines.append(f"{'all':<28}{len(model.blocks):>6}{total:>14,}{active:>14,}")
    return "\n".join(lines)


def active_params(model: HybridLM, include_embedding: bool = False) -> int:
    rows = parameter_rows(model)
    skip = () if include_embedding else ("token embedding", "n-gram hash embedding")
    return sum(a for name, _, _, a in rows if name not in skip)


def flops_per_token(model: HybridLM, seq_len: int) -> float:
    """Training FLOPs per token: 6 per active non-embedding parameter plus causal attention scores
    (6 * 2 * heads * head_dim * seq_len / 2 per A sublayer: QK^T and AV, forward and backward)."""
    cfg = model.cfg.attention
    n_attention = sum(1 for b in model.blocks if b.kind == "A")
    attention = 6 * n_attention * cfg.n_heads * cfg.head_dim * seq_len
    return 6.0 * active_params(model) + attention
