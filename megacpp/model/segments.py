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
from torch.nn.attention.flex_attention import BlockMask

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
    partial, full = document_block_layout(index, t, device)
    return FlexBlocks(*_ordered(partial), *_ordered(full), *_ordered(partial.transpose(-2, -1)),
                      *_ordered(full.transpose(-2, -1)))


def document_block_layout(index: Tensor | None, t: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Which (query block, key block) pairs of `causal_document_mask` are partly and which fully
    visible, (b or 1, 1, blocks, blocks) bool each: what ``create_block_mask`` finds by evaluating the
    mask at every token pair, read here from each block's first and last document number. Document
    numbers never fall along a row, so a key block left of the query block shares a document with it
    exactly when its last number is the query block's first, and sees it whole exactly when its first
    number is the query block's last; the diagonal block is partial (causal) and a block cut by t is
    never whole. Built with ``create_block_mask`` (a t x t evaluation and a sort), the ``HybridLM.segments``
    region compiled in 11.8-13.1 s on an H100, against 5.2-5.7 s so (docs/decisions.md)."""
    blocks = -(-t // FLEX_BLOCK_SIZE)
    if index is None:
        index = torch.zeros(1, t, dtype=torch.long, device=device)
    starts = torch.arange(blocks, device=device) * FLEX_BLOCK_SIZE
    first, last = index[:, starts], index[:, (starts + FLEX_BLOCK_SIZE - 1).clamp(max=t - 1)]
    column = torch.arange(blocks, device=device)
    left = column[None, :] < column[:, None]  # (query block, key block): the key block lies left
    whole = starts + FLEX_BLOCK_SIZE <= t
    any_visible = (left & (last[:, None, :] == first[:, :, None])) | (column[None, :] == column[:, None])
    full = left & (first[:, None, :] == last[:, :, None]) & whole[None, :] & whole[:, None]
    return (any_visible & ~full)[:, None], full[:, None]


@torch.library.custom_op("megacpp::ordered_block_layout", mutates_args=())
def _ordered(dense: Tensor) -> tuple[Tensor, Tensor]:
    """A block layout as FlexAttention orders it: each row's count of set blocks, and the block indices
    with the set ones first, each group in ascending order (int32). A stable partition, placed by running
    counts rather than sorted: compiled on torch 2.11, ``argsort`` (create_block_mask's way) lowers to
    Triton sorts whose cold compile took 8-11.5 s and 4-5.3 s on an H100 (pytorch/pytorch#182060).

    An opaque op, run eagerly inside compiled regions: Inductor 2.11's Triton code generation of the
    scatter failed at 512 blocks (65,536 tokens) on an H100 ("list indices must be integers or slices,
    not NoneType" in ``get_block_shape``), and the layout is a few small kernels either way. Its outputs
    are contiguous whatever the input's strides (the q-side layouts come in transposed), as the fake says."""
    dense = dense.to(torch.int32).contiguous()
    count = dense.sum(dim=-1, dtype=torch.int32)
    place = torch.where(dense.bool(), dense.cumsum(dim=-1) - 1, count[..., None] + (1 - dense).cumsum(dim=-1) - 1)
    column = torch.arange(dense.shape[-1], dtype=torch.int32, device=dense.device).expand_as(dense)
    return count, torch.empty_like(dense).scatter_(-1, place.long(), column)


@_ordered.register_fake
def _(dense: Tensor) -> tuple[Tensor, Tensor]:
    return dense.new_empty(dense.shape[:-1], dtype=torch.int32), dense.new_empty(dense.shape, dtype=torch.int32)


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
