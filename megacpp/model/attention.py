"""A block mixer: grouped-query causal attention with RoPE, QK-norm, document masking and a KV cache.

The attention mask comes precomputed in the `Segments` the model builds once per forward, in the kind
`mask_kind` asks for: none (SDPA's causal kernels), a dense boolean keep-mask (SDPA, or an
explicit softmax when a logit soft-cap is on) or FlexAttention's block layout (a soft-cap score_mod).
q is (b, H, t, hd); k and v are (b, Hkv, t, hd) with H a multiple of Hkv (query head h reads kv head
h // (H / Hkv)).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from megacpp.model.attention_config import AttentionConfig
from megacpp.model.hints import ParamHint
from megacpp.model.rope import apply_rope, rope_table
from megacpp.model.segments import WHOLE_ROWS, MaskKind, Segments, block_mask, segments_of
from megacpp.rules import check_alone

QK_NORM_EPS = 1e-6  # fixed so bf16 inputs do not get finfo(bf16).eps = 7.8e-3 added to mean(x^2)


def mask_kind(cfg: AttentionConfig, device: torch.device, has_documents: bool) -> MaskKind:
    """The mask attention under `cfg` needs on `device`. FlexAttention only on CUDA: it has no CPU
    backward, so CPU always takes the SDPA paths. "auto" also needs a dense mask to replace and
    torch.compile around it (eager flex materialises the full score matrix, no better than SDPA's
    masked kernels); the model asks from the region it builds its segments in, which runs compiled
    exactly when the attention layers do."""
    needs_mask = has_documents or cfg.softcap > 0
    if device.type == "cuda" and cfg.backend != "sdpa":
        if cfg.backend == "flex" or (needs_mask and torch.compiler.is_compiling()):
            return "flex"
    return "dense" if needs_mask else "none"


def _attend_explicit(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, softcap: float) -> Tensor:
    """Softmax attention with fp32 scores; the path for soft-capped logits, which SDPA cannot do."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return probs.to(v.dtype) @ v


def attend_masked(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, softcap: float) -> Tensor:
    """Attention under an explicit boolean keep-mask broadcastable to (b, H, tq, tk)."""
    if softcap > 0:
        return _attend_explicit(q, k, v, mask, softcap)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def attend_flex(q: Tensor, k: Tensor, v: Tensor, mask: BlockMask, softcap: float) -> Tensor:
    """Attention through FlexAttention under a block mask, with the soft-cap as a score_mod."""
    score_mod = None
    if softcap > 0:
        def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return softcap * torch.tanh(score / softcap)
    return flex_attention(q, k, v, score_mod=score_mod, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def attend(q: Tensor, k: Tensor, v: Tensor, segments: Segments, softcap: float) -> Tensor:
    """Causal attention within each document of `segments`, through the mask they carry: flex block
    layout, dense keep-mask, or none (SDPA's mask-free causal kernels, flash included)."""
    if segments.flex_blocks is not None:
        return attend_flex(q, k, v, block_mask(segments, q.shape[2]), softcap)
    if segments.attention_mask is not None:
        return attend_masked(q, k, v, segments.attention_mask, softcap)
    if segments.doc_ids is not None or softcap > 0:
        raise ValueError("attend: documents or a soft-cap need the attention mask in segments (segments_of)")
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


class Attention(nn.Module):
    """Grouped-query causal self-attention mixer (pattern symbol A)."""

    reduced_buffers = {"logit_bound": "max"}  # MuonClip bounds the largest logit of any rank's batch

    def __init__(self, d_model: int, cfg: AttentionConfig, layer_idx: int) -> None:
        super().__init__()
        check_alone(cfg)
        self.cfg, self.layer_idx, self.d_model = cfg, layer_idx, d_model
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q_rows, kv_rows = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.qkv = nn.Linear(d_model, q_rows + 2 * kv_rows, bias=False)
        self.param_hints = {"qkv.weight": ParamHint(qkv_split=(q_rows, kv_rows, kv_rows))}  # Muon: per slice
        self.proj = nn.Linear(q_rows, d_model, bias=False)
        half = cfg.head_dim // 2
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, half), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, half), persistent=False)
        # MuonClip (megacpp.optim.clip) reads its settings from here: one owner for QK-clip.
        self.qk_clip, self.qk_clip_tau = cfg.qk_clip, cfg.qk_clip_tau
        if cfg.qk_clip != "off":
            # Read by MuonClip after the step; only exists when a clip mode asks for it.
            self.register_buffer("logit_bound", torch.zeros(cfg.n_heads), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """qkv ~ N(0, 1/d_model) so q, k, v start at unit scale; proj = 0 so the block starts as identity.
        Also fills the RoPE tables, so a model built on the meta device initialises completely."""
        nn.init.normal_(self.qkv.weight, std=self.d_model**-0.5)
        nn.init.zeros_(self.proj.weight)
        cos, sin = rope_table(self.cfg.max_seq_len, self.head_dim, self.cfg.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        if self.cfg.qk_clip != "off":
            self.logit_bound.zero_()

    def attention_mask_kind(self, device: torch.device, has_documents: bool) -> MaskKind:
        """Mixer hook: the mask the model builds once per forward for its attention layers."""
        return mask_kind(self.cfg, device, has_documents)

    def forward(self, x: Tensor, segments: Segments = WHOLE_ROWS) -> Tensor:
        b, t, _ = x.shape
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {t} > AttentionConfig.max_seq_len={self.cfg.max_seq_len}")
        if segments.attention_mask is None and segments.flex_blocks is None:
            # Called on its own, without a mask: build this call's (HybridLM passes the forward's).
            kind = self.attention_mask_kind(x.device, segments.doc_ids is not None)
            segments = segments_of(segments.doc_ids, t, x.device, kind) if kind != "none" else segments
        # Each document starts at RoPE position 0.
        q, k, v = self._project(x, segments.document_positions(t, x.device), self.rope_cos, self.rope_sin)
        if self.cfg.qk_clip != "off":
            q = self._record_and_clip(q, k)
        y = attend(q, k, v, segments, self.cfg.softcap)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1)).to(x.dtype)

    def init_cache(
        self, batch_size: int, max_len: int, device: torch.device | str, dtype: torch.dtype
    ) -> dict[str, Tensor]:
        """KV cache for `max_len` positions, with the RoPE tables it reads: the module's own when they
        are long enough, else those rows followed by the missing ones (a prompt past max_seq_len). The
        module is never changed, so a compiled training forward keeps its graphs."""
        shape = (batch_size, self.n_kv_heads, max_len, self.head_dim)
        rope_cos, rope_sin = self._rope_tables(max_len)
        return {
            "k": torch.zeros(shape, device=device, dtype=dtype),
            "v": torch.zeros(shape, device=device, dtype=dtype),
            "pos": torch.zeros((), device=device, dtype=torch.int64),
            "rope_cos": rope_cos,
            "rope_sin": rope_sin,
        }

    def _rope_tables(self, length: int) -> tuple[Tensor, Tensor]:
        """cos, sin tables of at least `length` rows; rows past the module's tables are computed here."""
        rows = self.rope_cos.shape[0]
        if length <= rows:
            return self.rope_cos, self.rope_sin
        cos, sin = rope_table(length, self.head_dim, self.cfg.rope_theta, start=rows)
        device = self.rope_cos.device
        return torch.cat([self.rope_cos, cos.to(device)]), torch.cat([self.rope_sin, sin.to(device)])

    def forward_step(self, x: Tensor, cache: dict[str, Tensor]) -> Tensor:
        """One token per row at position cache["pos"]; writes k/v there, attends over 0..pos, advances."""
        b = x.shape[0]
        pos = cache["pos"]
        q, k, v = self._project(x, pos.view(1, 1), cache["rope_cos"], cache["rope_sin"])
        keys, values = cache["k"], cache["v"]
        keys.index_copy_(2, pos.view(1), k.to(keys.dtype))
        values.index_copy_(2, pos.view(1), v.to(values.dtype))
        if self.cfg.qk_clip == "activation":
            # Unwritten cache slots are zero, so the max key norm covers positions 0..pos only.
            q = q * self._clip_factor(self._row_bounds(q, keys)).to(q.dtype)
        visible = (torch.arange(keys.shape[2], device=x.device) <= pos).view(1, 1, 1, -1)
        y = attend_masked(q.to(keys.dtype), keys, values, visible, self.cfg.softcap)
        cache["pos"].add_(1)
        return self.proj(y.transpose(1, 2).reshape(b, 1, -1).to(q.dtype)).to(x.dtype)

    def prefill(self, x: Tensor, cache: dict[str, Tensor]) -> Tensor:
        """The prompt x (b, t, d) into a fresh cache (`init_cache`'s, at least t long) in one causal pass:
        k/v written to slots 0..t-1 as `forward_step` writes them, pos advanced by t. Positions read the
        cache's RoPE tables, so a prompt may be longer than max_seq_len. The activation QK-clip scales each
        query by its bound against the keys up to it, as decoding does (the training forward's bound spans
        the whole sequence, so there the two differ; docs/blocks_attention_engram.md)."""
        b, t, _ = x.shape
        if t > cache["k"].shape[2]:
            raise ValueError(f"prefill: a prompt of {t} tokens does not fit a cache of {cache['k'].shape[2]}")
        q, k, v = self._project(x, torch.arange(t, device=x.device)[None], cache["rope_cos"], cache["rope_sin"])
        cache["k"][:, :, :t].copy_(k)
        cache["v"][:, :, :t].copy_(v)
        cache["pos"].add_(t)
        if self.cfg.qk_clip == "activation":
            q = q * self._causal_clip_factor(q, k).to(q.dtype)
        segments = segments_of(None, t, x.device, self.attention_mask_kind(x.device, has_documents=False))
        y = attend(q, k, v, segments, self.cfg.softcap)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1)).to(x.dtype)

    def _project(self, x: Tensor, positions: Tensor, rope_cos: Tensor, rope_sin: Tensor
                 ) -> tuple[Tensor, Tensor, Tensor]:
        """q (b, H, t, hd), k and v (b, Hkv, t, hd); QK-norm before RoPE, rotated by the tables' rows at
        `positions`. Norm and RoPE run on the joint q|k slice (both are per-head ops) so they compile to
        one kernel, not two."""
        b, t, _ = x.shape
        qkv = self.qkv(x).view(b, t, self.n_heads + 2 * self.n_kv_heads, self.head_dim).transpose(1, 2)
        qk, v = qkv.split([self.n_heads + self.n_kv_heads, self.n_kv_heads], dim=1)
        if self.cfg.qk_norm:
            qk = F.rms_norm(qk, (self.head_dim,), eps=QK_NORM_EPS)
        cos, sin = rope_cos[positions][:, None], rope_sin[positions][:, None]
        q, k = apply_rope(qk, cos, sin).to(v.dtype).split([self.n_heads, self.n_kv_heads], dim=1)
        return q, k, v

    def _row_bounds(self, q: Tensor, k: Tensor) -> Tensor:
        """(b, H) per row and head: max_t |q_t| * max_s |k_s| / sqrt(hd) in fp32 (no sync). A row's queries
        meet only its own keys, so the largest of the rows' bounds bounds the batch's logits, and it is
        the same however the batch is split into micro-batches or over ranks (a max of maxes)."""
        q_max = q.float().norm(dim=-1).amax(dim=2)
        k_max = k.float().norm(dim=-1).amax(dim=2)
        return q_max * k_max.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1) * self.head_dim**-0.5

    def _clip_factor(self, row_bounds: Tensor) -> Tensor:
        """(b, H, 1, 1) detached min(1, tau / bound), each row by its own bound; a zero bound gives inf,
        clamped to 1."""
        return (self.cfg.qk_clip_tau / row_bounds).clamp(max=1.0).detach()[:, :, None, None]

    def _causal_clip_factor(self, q: Tensor, k: Tensor) -> Tensor:
        """(b, H, t, 1) detached min(1, tau / bound), query t's bound |q_t| * max_{s <= t} |k_s| / sqrt(hd):
        what `forward_step` computes for each query against the keys cached so far."""
        k_max = k.float().norm(dim=-1).cummax(dim=2).values.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
        bounds = q.float().norm(dim=-1) * k_max * self.head_dim**-0.5
        return (self.cfg.qk_clip_tau / bounds).clamp(max=1.0).detach()[..., None]

    def _record_and_clip(self, q: Tensor, k: Tensor) -> Tensor:
        rows = self._row_bounds(q, k)
        self.logit_bound.copy_(rows.amax(dim=0).detach())
        if self.cfg.qk_clip == "activation":
            q = q * self._clip_factor(rows).to(q.dtype)
        return q

