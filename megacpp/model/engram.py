"""Engram branch (causal n-gram smoother over hidden states) and the n-gram hash embedding.

Both look back a few tokens and never across a document boundary. The look-back is written as a
fixed number of static shifts masked by the position inside the document, so shapes never depend on
the data and the modules compile with fullgraph=True.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megacpp.model.engram_config import EngramConfig
from megacpp.model.hints import ParamHint
from megacpp.model.segments import WHOLE_ROWS, Segments
from megacpp.rules import check_alone

WINDOWS = (2, 3, 4)  # Engram averages the current token with the previous 1, 2 and 3
_GOLDEN = 0x9E3779B1  # odd 32-bit golden-ratio constant; the seed of the fixed hash multipliers


def _shift(x: Tensor, lag: int, fill: float | int) -> Tensor:
    """x (b, t, ...) delayed by `lag` steps along time; the first `lag` entries are `fill`."""
    pad = [0, 0] * (x.dim() - 2) + [lag, 0]
    return F.pad(x, pad, value=fill)[:, : x.shape[1]]


def _window_means(current: Tensor, lagged: list[tuple[Tensor, Tensor]]) -> Tensor:
    """Means over the windows in WINDOWS, fp32, stacked to (len(WINDOWS), b, t, dim).

    lagged[j] = (vectors lag j+1 back, bool (.., t, 1) whether that lag is inside the document);
    each mean divides by the number of vectors its window actually covers.
    """
    total, count = current.float(), torch.ones_like(lagged[0][1], dtype=torch.float32)
    means = []
    for lag, (previous, valid) in enumerate(lagged, start=1):
        total = total + torch.where(valid, previous.float(), 0.0)
        count = count + valid.float()
        if lag + 1 in WINDOWS:
            means.append(total / count)
    return torch.stack(means)


class Engram(nn.Module):
    """Bottleneck -> causal window means (orders 2, 3, 4) -> learned per-order mix -> optional sigmoid
    context gate -> zero-initialised projection back to d_model."""

    param_hints = {"mix": ParamHint(optimizer="adamw")}  # per-order channel weights, not a hidden matrix

    def __init__(self, d_model: int, cfg: EngramConfig, layer_idx: int) -> None:
        super().__init__()
        check_alone(cfg)
        self.cfg, self.layer_idx, self.d_model = cfg, layer_idx, d_model
        self.down = nn.Linear(d_model, cfg.dim, bias=False)
        self.mix = nn.Parameter(torch.empty(len(WINDOWS), cfg.dim))
        self.gate = nn.Linear(d_model, cfg.dim, bias=False) if cfg.gate else None
        self.out = nn.Linear(cfg.dim, d_model, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """down/gate ~ N(0, 1/d_model); mix = 1/len(WINDOWS) (plain average of orders); out = 0."""
        nn.init.normal_(self.down.weight, std=self.d_model**-0.5)
        nn.init.constant_(self.mix, 1.0 / len(WINDOWS))
        if self.gate is not None:
            nn.init.normal_(self.gate.weight, std=self.d_model**-0.5)
        nn.init.zeros_(self.out.weight)

    def forward(self, x: Tensor, segments: Segments = WHOLE_ROWS) -> Tensor:
        return self._over_sequence(x, self.down(x), segments)

    def _over_sequence(self, x: Tensor, h: Tensor, segments: Segments) -> Tensor:
        pos = segments.document_positions(x.shape[1], x.device)[..., None]
        lagged = [(_shift(h, lag, 0.0), pos >= lag) for lag in range(1, max(WINDOWS))]
        return self._combine(x, h, _window_means(h, lagged))

    def init_cache(
        self, batch_size: int, max_len: int, device: torch.device | str, dtype: torch.dtype
    ) -> dict[str, Tensor]:
        """history: the last max(WINDOWS)-1 bottleneck vectors, oldest first; n_valid: how many are real."""
        return {
            "history": torch.zeros(batch_size, max(WINDOWS) - 1, self.cfg.dim, device=device, dtype=dtype),
            "n_valid": torch.zeros((), device=device, dtype=torch.int64),
        }

    def forward_step(self, x: Tensor, cache: dict[str, Tensor]) -> Tensor:
        history, n_valid = cache["history"], cache["n_valid"]
        h = self.down(x)
        span = history.shape[1]
        lagged = [(history[:, span - lag : span - lag + 1], n_valid >= lag) for lag in range(1, span + 1)]
        y = self._combine(x, h, _window_means(h, lagged))
        history.copy_(torch.cat([history[:, 1:], h.to(history.dtype)], dim=1))
        n_valid.copy_((n_valid + 1).clamp(max=span))
        return y

    def prefill(self, x: Tensor, cache: dict[str, Tensor]) -> Tensor:
        """The prompt x (b, t, d) into a fresh cache: its forward, and the prompt's last bottleneck
        vectors as the history (behind the cache's zeros when t is shorter than the history)."""
        history, n_valid = cache["history"], cache["n_valid"]
        h = self.down(x)
        history.copy_(torch.cat([history, h.to(history.dtype)], dim=1)[:, x.shape[1]:])
        n_valid.copy_((n_valid + x.shape[1]).clamp(max=history.shape[1]))
        return self._over_sequence(x, h, WHOLE_ROWS)

    def _combine(self, x: Tensor, h: Tensor, means: Tensor) -> Tensor:
        mixed = (self.mix.float()[:, None, None, :] * means).sum(dim=0)
        if self.gate is not None:
            mixed = mixed * torch.sigmoid(self.gate(x).float())
        return self.out(mixed.to(h.dtype)).to(x.dtype)


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    return all(n % p for p in range(2, int(n**0.5) + 1))


def next_prime(n: int) -> int:
    """Smallest prime >= n."""
    while not is_prime(n):
        n += 1
    return n


class NgramHashEmbedding(nn.Module):
    """Hashed embeddings of the n-grams ending at each token, summed and projected to d_model.

    One table per (order, head), each of a distinct prime size, all stored in one nn.Embedding at
    row offsets. Head j of order n hashes the last n token ids as XOR_i(id_i * c_i) mod P with fixed
    odd constants c_i < 2^31 (ids <= vocab < 2^31, so the int64 products never overflow). Tokens
    before the start of the document read as the reserved id `vocab_size`.
    """

    def __init__(self, vocab_size: int, d_model: int, cfg: EngramConfig) -> None:
        super().__init__()
        check_alone(dataclasses.replace(cfg, ngram_hash=True))  # this module is the hash, whatever the flag says
        if vocab_size + 1 >= 2**31:
            raise ValueError(f"vocab_size={vocab_size} too large for the overflow-free int64 hash")
        self.cfg, self.vocab_size, self.d_model = cfg, vocab_size, d_model
        self.none_id = vocab_size
        self.max_order = max(cfg.ngram_orders)
        self.table_orders = tuple(n for n in cfg.ngram_orders for _ in range(cfg.ngram_heads))
        self.table_sizes = _prime_table_sizes(cfg.ngram_table_size or 2 * vocab_size, len(self.table_orders))
        self.embed = nn.Embedding(sum(self.table_sizes), cfg.ngram_dim)
        self.proj = nn.Linear(cfg.ngram_dim, d_model, bias=False)
        n_tables = len(self.table_orders)
        # Hash constants as buffers: they follow .to(device) and cost no host-to-device copy per call.
        multipliers = torch.zeros(n_tables, self.max_order, dtype=torch.long)
        self.register_buffer("multipliers", multipliers, persistent=False)
        self.register_buffer("moduli", torch.zeros(n_tables, dtype=torch.long), persistent=False)
        self.register_buffer("offsets", torch.zeros(n_tables, dtype=torch.long), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Tables ~ N(0, 1/n_tables) so their sum has unit scale; proj = 0; hash constants refilled
        here as well so a meta-device model initialises completely."""
        nn.init.normal_(self.embed.weight, std=len(self.table_orders) ** -0.5)
        nn.init.zeros_(self.proj.weight)
        self.multipliers.copy_(torch.tensor(_hash_multipliers(self.table_orders, self.max_order)))
        self.moduli.copy_(torch.tensor(self.table_sizes))
        self.offsets.copy_(torch.tensor([0, *self.table_sizes[:-1]]).cumsum(0))

    def hash_ids(self, idx: Tensor, segments: Segments = WHOLE_ROWS) -> Tensor:
        """(b, t, n_tables) int64 rows of `embed` for the n-grams ending at each position."""
        pos = segments.document_positions(idx.shape[1], idx.device)
        columns = [
            torch.where(pos >= lag, _shift(idx, lag, self.none_id), self.none_id)
            for lag in range(self.max_order - 1, 0, -1)
        ]
        return self._rows(torch.stack([*columns, idx], dim=-1))

    def forward(self, idx: Tensor, segments: Segments = WHOLE_ROWS) -> Tensor:
        return self.proj(self.embed(self.hash_ids(idx, segments)).sum(dim=2))

    def init_cache(self, batch_size: int, device: torch.device | str) -> dict[str, Tensor]:
        """previous: the last max_order-1 token ids, oldest first ("none" before the first token)."""
        shape = (batch_size, self.max_order - 1)
        return {"previous": torch.full(shape, self.none_id, device=device, dtype=torch.int64)}

    def forward_step(self, tokens: Tensor, cache: dict[str, Tensor]) -> Tensor:
        window = torch.cat([cache["previous"], tokens.long()], dim=1)
        cache["previous"].copy_(window[:, 1:])
        return self.proj(self.embed(self._rows(window[:, None])).sum(dim=2))

    def prefill(self, tokens: Tensor, cache: dict[str, Tensor]) -> Tensor:
        """The prompt tokens (b, t) into a fresh cache: its forward, and its last max_order-1 ids as the
        previous ones ("none" ids before the first, as the steps leave them)."""
        previous = cache["previous"]
        previous.copy_(torch.cat([previous, tokens.long()], dim=1)[:, tokens.shape[1]:])
        return self.forward(tokens)

    def _rows(self, window: Tensor) -> Tensor:
        """window (b, t, max_order) token ids, oldest first -> (b, t, n_tables) table rows."""
        products = window.long()[:, :, None, :] * self.multipliers  # zero multipliers drop unused lags
        hashed = products[..., 0]
        for i in range(1, self.max_order):
            hashed = hashed ^ products[..., i]
        return hashed % self.moduli + self.offsets


def _prime_table_sizes(base: int, n_tables: int) -> tuple[int, ...]:
    """Distinct primes, the first >= base, so no two tables share a modulus."""
    sizes = [next_prime(base)]
    while len(sizes) < n_tables:
        sizes.append(next_prime(sizes[-1] + 1))
    return tuple(sizes)


def _hash_multipliers(table_orders: tuple[int, ...], max_order: int) -> list[list[int]]:
    """Fixed odd constants < 2^31 per (table, window column); columns older than the table's order
    get 0, which is the identity of the XOR reduction."""
    rows = []
    for table, order in enumerate(table_orders):
        row = [0] * (max_order - order)
        row += [(_GOLDEN * (1 + table * max_order + col)) % 2**31 | 1 for col in range(order)]
        rows.append(row)
    return rows
