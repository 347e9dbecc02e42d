"""HybridLM: token (+ n-gram hash) embeddings, a pattern of residual sublayers, norm, head, MTP heads.

Initialisation, per parameter kind:
- token embedding: normal(0, 1) (every sublayer pre-normalises, so the residual stream's scale is free);
- LM head: normal(0, 0.001), nanochat's choice, so the first logits are near uniform;
- norms: ones; MTP projections and every mixer's output projection: zeros, so each residual branch
  starts as the identity and depth does not blow up the initial activations;
- mixers: their own ``reset_parameters`` (documented in each module).
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megacpp.model.config import ModelConfig
from megacpp.model.engram import Engram, NgramHashEmbedding
from megacpp.model.pattern import expand_pattern
from megacpp.model.prefill import module_prefill
from megacpp.model.registry import BLOCK_KINDS
from megacpp.model.segments import WHOLE_ROWS, MaskKind, Segments, segments_of
from megacpp.ops.softcap_xent import linear_softcap_cross_entropy, softcap
from megacpp.rules import check_alone

IGNORE_INDEX = -1

class Block(nn.Module):
    """One residual sublayer ``x + mixer(norm(x))``, plus an optional Engram branch on the same input."""

    def __init__(self, kind: str, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        block_kind = BLOCK_KINDS[kind]
        self.kind = kind
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mixer = block_kind.mixer_class()(cfg.d_model, getattr(cfg, block_kind.config_field), layer_idx)
        self.engram = Engram(cfg.d_model, cfg.engram, layer_idx) if layer_idx in cfg.engram.layers else None

    def forward(self, x: Tensor, segments: Segments = WHOLE_ROWS) -> Tensor:
        h = self.norm(x)
        out = x + self.mixer(h, segments)
        if self.engram is not None:
            out = out + self.engram(h, segments)
        return out

    def init_cache(self, batch_size: int, max_len: int, device: torch.device, dtype: torch.dtype) -> dict:
        cache = {"mixer": self.mixer.init_cache(batch_size, max_len, device, dtype)}
        if self.engram is not None:
            cache["engram"] = self.engram.init_cache(batch_size, max_len, device, dtype)
        return cache

    def forward_step(self, x: Tensor, cache: dict) -> Tensor:
        h = self.norm(x)
        out = x + self.mixer.forward_step(h, cache["mixer"])
        if self.engram is not None:
            out = out + self.engram.forward_step(h, cache["engram"])
        return out

    def prefill(self, x: Tensor, cache: dict) -> Tensor:
        """The prompt x (b, t, d) through the sublayer, its fresh caches filled as t `forward_step` calls fill them."""
        h = self.norm(x)
        out = x + module_prefill(self.mixer, h, cache["mixer"])
        if self.engram is not None:
            out = out + module_prefill(self.engram, h, cache["engram"])
        return out


class MTPHead(nn.Module):
    """Multi-token prediction: ``h_k = h_{k-1} + proj(norm(h_{k-1}))`` read out by the shared LM head."""

    def __init__(self, d_model: int, eps: float) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(d_model, eps=eps)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        nn.init.zeros_(self.proj.weight)

    def forward(self, h: Tensor) -> Tensor:
        return h + self.proj(self.norm(h))


class HybridLM(nn.Module):
    # Methods that `blocks` compile mode compiles as regions of their own besides the blocks
    # (megacpp.compile.regions). `segments`: the attention mask is built compiled exactly when the
    # attention blocks run compiled, so it takes the kind they would pick (`Attention.attention_mask_kind`)
    # and FlexAttention's block layout fuses; `loss`: the head's large (b, t, vocab) intermediates fuse.
    method_regions: ClassVar[tuple[str, ...]] = ("segments", "loss")

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        check_alone(cfg)  # the rules the gate holds a whole config to, for a ModelConfig built in Python
        self.cfg = cfg
        self.layout = expand_pattern(cfg.pattern, cfg.depth)
        self.tok_embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.ngram_embed = (
            NgramHashEmbedding(cfg.vocab_size, cfg.d_model, cfg.engram) if cfg.engram.ngram_hash else None
        )
        self.blocks = nn.ModuleList(Block(kind, cfg, i) for i, kind in enumerate(self.layout))
        # The first mixer with the `attention_mask_kind` hook names the mask of the forward (all attention
        # layers share one config); None: no layer reads a mask, none is built.
        self._mask_block = next(
            (i for i, block in enumerate(self.blocks) if hasattr(block.mixer, "attention_mask_kind")), None
        )
        self.norm_f = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTPHead(cfg.d_model, cfg.norm_eps) for _ in range(cfg.mtp_depth))
        self._init_own_parameters()

    def _init_own_parameters(self) -> None:
        nn.init.normal_(self.tok_embed.weight, mean=0.0, std=1.0)
        nn.init.normal_(self.lm_head.weight, mean=0.0, std=0.001)
        for head in self.mtp:
            nn.init.zeros_(head.proj.weight)

    def reset_parameters(self) -> None:
        """Re-initialise everything (e.g. after building on the meta device and ``to_empty``).
        Construction already initialises: each mixer initialises itself when built."""
        for module in self.modules():
            if isinstance(module, nn.RMSNorm):
                module.reset_parameters()
        for block in self.blocks:
            block.mixer.reset_parameters()
            if block.engram is not None:
                block.engram.reset_parameters()
        if self.ngram_embed is not None:
            self.ngram_embed.reset_parameters()
        self._init_own_parameters()

    # ------------------------------------------------------------------ training forward

    def segments(self, idx: Tensor, doc_ids: Tensor | None = None) -> Segments:
        """The batch's document structure and its attention mask, computed once per forward and read by
        every layer. A compiled region of its own in ``blocks`` mode (`method_regions`)."""
        return segments_of(doc_ids, idx.shape[1], idx.device, self._mask_kind(idx.device, doc_ids is not None))

    def _mask_kind(self, device: torch.device, has_documents: bool) -> MaskKind:
        if self._mask_block is None:
            return "none"
        return self.blocks[self._mask_block].mixer.attention_mask_kind(device, has_documents)

    def embed(self, idx: Tensor, segments: Segments = WHOLE_ROWS) -> Tensor:
        x = self.tok_embed(idx)
        if self.ngram_embed is not None:
            x = x + self.ngram_embed(idx, segments)
        return x

    def logits(self, h: Tensor) -> Tensor:
        return softcap(self.lm_head(self.norm_f(h)), self.cfg.logit_softcap)

    def hidden(self, idx: Tensor, segments: Segments = WHOLE_ROWS) -> Tensor:
        x = self.embed(idx, segments)
        for block in self.blocks:
            x = block(x, segments)
        return x

    def forward(self, idx: Tensor, targets: Tensor | None = None, doc_ids: Tensor | None = None) -> Tensor:
        """Logits (b, t, V) in fp32, or the mean next-token loss (plus weighted MTP loss) with targets.

        Targets equal to -1 are ignored.
        """
        segments = self.segments(idx, doc_ids)
        h = self.hidden(idx, segments)
        if targets is None:
            return self.logits(h)
        return self.loss(h, targets, segments)

    def loss(self, h: Tensor, targets: Tensor, segments: Segments = WHOLE_ROWS) -> Tensor:
        """The training loss from the last hidden state: final norm, LM head, soft-cap, cross-entropy,
        plus the weighted loss of the MTP heads. One compiled region in ``blocks`` mode (`method_regions`)."""
        loss = self._head_loss(h, targets)
        if len(self.mtp) > 0:
            loss = loss + self.cfg.mtp_loss_weight * self._mtp_loss(h, targets, segments.index)
        return loss

    def _mtp_loss(self, h: Tensor, targets: Tensor, document_index: Tensor | None) -> Tensor:
        """Head k (1-based) at position t predicts targets[t + k]; never across a document boundary."""
        losses = []
        for k, head in enumerate(self.mtp, start=1):
            h = head(h)
            shifted = F.pad(targets[:, k:], (0, k), value=IGNORE_INDEX)
            if document_index is not None:
                same_doc = F.pad(document_index[:, k:] == document_index[:, :-k], (0, k), value=False)
                shifted = torch.where(same_doc, shifted, torch.full_like(shifted, IGNORE_INDEX))
            losses.append(self._head_loss(h, shifted))
        return torch.stack(losses).mean()

    def _head_loss(self, h: Tensor, targets: Tensor) -> Tensor:
        """Mean cross-entropy of the soft-capped `logits(h)` against targets, through the implementation
        `cfg.loss_kernel` picks (megacpp/ops/softcap_xent.py)."""
        return linear_softcap_cross_entropy(self.norm_f(h).flatten(0, 1), self.lm_head.weight, targets.flatten(),
                                            self.cfg.logit_softcap, IGNORE_INDEX, kernel=self.cfg.loss_kernel)

    # ------------------------------------------------------------------ decoding

    def init_cache(self, batch_size: int, max_len: int) -> dict[str, Any]:
        """Per-layer decode caches: KV for A, (angle, H, B_prev, x_prev) for M, state for R,
        recent tokens for Engram and the n-gram hash."""
        ref = self.tok_embed.weight
        cache: dict[str, Any] = {
            "blocks": [b.init_cache(batch_size, max_len, ref.device, ref.dtype) for b in self.blocks]
        }
        if self.ngram_embed is not None:
            cache["ngram"] = self.ngram_embed.init_cache(batch_size, ref.device)
        return cache

    def forward_step(self, tokens: Tensor, cache: dict[str, Any]) -> Tensor:
        """Advance every layer's cache by one token per row: tokens (b, 1) -> logits (b, 1, V)."""
        x = self.tok_embed(tokens)
        if self.ngram_embed is not None:
            x = x + self.ngram_embed.forward_step(tokens, cache["ngram"])
        for block, block_cache in zip(self.blocks, cache["blocks"], strict=True):
            x = block.forward_step(x, block_cache)
        return self.logits(x)

    def prefill(self, tokens: Tensor, cache: dict[str, Any]) -> Tensor:
        """Read a prompt into a fresh cache in one pass per block: tokens (b, t) -> the last position's
        logits (b, 1, V). The caches end as t calls of `forward_step` leave them (up to floating point:
        the scans' parallel forms sum in another order); a block kind without a ``prefill`` of its own
        steps through the prompt (`megacpp.model.prefill.module_prefill`)."""
        x = self.tok_embed(tokens)
        if self.ngram_embed is not None:
            x = x + self.ngram_embed.prefill(tokens, cache["ngram"])
        for block, block_cache in zip(self.blocks, cache["blocks"], strict=True):
            x = block.prefill(x, block_cache)
        return self.logits(x[:, -1:])
