"""Segments: how the rows of one packed batch split into documents, computed once per forward.

`HybridLM` derives them from ``doc_ids`` (b, t) at the start of its forward (`segments_of`) and hands
the same value to the embeddings, every mixer, every Engram branch and the MTP loss; no layer
re-derives the document structure. A document starts at t = 0 and wherever the id changes, so an id
reused by a later, non-adjacent document still starts a new document.

The attention mask depends only on (t, doc_ids), so it is the same for every attention layer of one
forward and is built here too, once, in the form the attention layers will use (`MaskKind`): a dense
boolean keep-mask for SDPA, or FlexAttention's block layout. The layout travels as plain tensors
(`FlexBlocks`), not as a ``BlockMask``: a ``BlockMask`` is no pytree on torch 2.13, so a compiled
region could neither mark its batch axis dynamic nor take it without guarding on its closure, while
a NamedTuple of tensors is an ordinary compiled-region input. Each attention layer wraps the tensors
in a ``BlockMask`` (`block_mask`), which copies no data.

Every field is a tensor or None; a None document field means each row is one document, so the empty
``Segments()`` (`WHOLE_ROWS`) is the value for a call without doc_ids and nothing precomputed.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

MaskKind = Literal["none", "dense", "flex"]  # the attention mask a forward needs: plain causal needs none
FLEX_BLOCK_SIZE = 128  # FlexAttention's default sparse block; the layout and the BlockMask must agree


class FlexBlocks(NamedTuple):
    """The tensors of a FlexAttention ``BlockMask`` (its names), for key blocks and query blocks of
    FLEX_BLOCK_SIZE tokens: partially masked blocks (``kv_*``, ``q_*``) and fully visible ones
    (``full_*``). Leading dims (b or 1, 1)."""

    kv_num_blocks: Tensor
    kv_indices: Tensor
    full_kv_num_blocks: Tensor | None
    full_kv_indices: Tensor | None
    q_num_blocks: Tensor | None
    q_indices: Tensor | None
    full_q_num_blocks: Tensor | None
    full_q_indices: Tensor | None


class Segments(NamedTuple):
    """The document structure of a (b, t) batch and the attention mask that follows from it."""

    doc_ids: Tensor | None = None  # (b, t) as given: the scan ops take document ids natively
    index: Tensor | None = None  # (b, t) int64 running document number, from 1 in each row
    positions: Tensor | None = None  # (b, t) int64 offset of each token from its document's first token
    start_offsets: Tensor | None = None  # (b, t) int64 time index of the first token of each token's document
    attention_mask: Tensor | None = None  # (b or 1, 1, t, t) bool keep-mask (MaskKind "dense")
    flex_blocks: FlexBlocks | None = None  # FlexAttention's block layout (MaskKind "flex")

    def document_positions(self, t: int, device: torch.device) -> Tensor:
        """(b, t) offsets inside the document, or (1, t) 0..t-1 when each row is one document."""
        if self.positions is None:
            return torch.arange(t, device=device)[None]
        return self.positions


WHOLE_ROWS = Segments()


def segments_of(doc_ids: Tensor | None, t: int, device: torch.device, mask: MaskKind = "none") -> Segments:
    """The segments of a (b, t) batch with document ids `doc_ids` (None: each row is one document),
    with the attention mask of kind `mask` built once for every attention layer."""
    documents = document_segments(doc_ids)
    attention_mask = flex_blocks = None
    if mask == "dense":
        attention_mask = causal_document_mask(documents.index, t, device)
    elif mask == "flex":
        flex_blocks = _flex_blocks(documents.index, t, device)
    return Segments(documents.doc_ids, documents.index, documents.positions, documents.start_offsets,
                    attention_mask, flex_blocks)


def document_segments(doc_ids: Tensor | None) -> Segments:
    """The document fields of `Segments` for doc_ids (b, t), no attention mask; WHOLE_ROWS for None."""
    if doc_ids is None:
        return WHOLE_ROWS
    t = doc_ids.shape[1]
    first = torch.ones_like(doc_ids[:, :1], dtype=torch.bool)
    starts = torch.cat([first, doc_ids[:, 1:] != doc_ids[:, :-1]], dim=1)
    time = torch.arange(t, device=doc_ids.device)
    start_offsets = torch.where(starts, time, 0).cummax(dim=1).values
    return Segments(doc_ids, starts.long().cumsum(dim=1), time - start_offsets, start_offsets)


def causal_document_mask(index: Tensor | None, t: int, device: torch.device) -> Tensor:
    """Boolean keep-mask (b or 1, 1, t, t): causal, and within one document when `index` is given."""
    time = torch.arange(t, device=device)
    mask = (time[:, None] >= time[None, :])[None, None]
    if index is None:
        return mask
    return mask & (index[:, None, :, None] == index[:, None, None, :])


def causal_document_mask_mod(index: Tensor | None) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """FlexAttention's mask_mod of `causal_document_mask`."""
    if index is None:
        return lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
    return lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (index[b, q_idx] == index[b, kv_idx])


def _flex_blocks(index: Tensor | None, t: int, device: torch.device) -> FlexBlocks:
    batch = None if index is None else index.shape[0]
    mask = create_block_mask(causal_document_mask_mod(index), B=batch, H=None, Q_LEN=t, KV_LEN=t, device=device,
                             BLOCK_SIZE=FLEX_BLOCK_SIZE)
    return FlexBlocks(mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices,
                      mask.q_num_blocks, mask.q_indices, mask.full_q_num_blocks, mask.full_q_indices)


def block_mask(segments: Segments, t: int) -> BlockMask:
    """The ``BlockMask`` of `segments.flex_blocks` (which must be set) with its mask_mod, for t tokens."""
    blocks = segments.flex_blocks
    return BlockMask(
        seq_lengths=(t, t),
        kv_num_blocks=blocks.kv_num_blocks, kv_indices=blocks.kv_indices,
        full_kv_num_blocks=blocks.full_kv_num_blocks, full_kv_indices=blocks.full_kv_indices,
        q_num_blocks=blocks.q_num_blocks, q_indices=blocks.q_indices,
        full_q_num_blocks=blocks.full_q_num_blocks, full_q_indices=blocks.full_q_indices,
        BLOCK_SIZE=(FLEX_BLOCK_SIZE, FLEX_BLOCK_SIZE),
        mask_mod=causal_document_mask_mod(segments.index),
    )
