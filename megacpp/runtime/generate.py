"""Autoregressive generation with the model's decode caches (KV for A, states for M and R): the prompt
read in one prefill, then one decode step per new token."""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterator

import torch
from torch import Tensor

from megacpp.model.hybrid import HybridLM
from megacpp.ops import kernel_prewarm


def sample_next(logits: Tensor, temperature: float, top_k: int, generator: torch.Generator) -> Tensor:
    """Sample one token per row from logits (b, V); temperature 0 is greedy, and so is a temperature so
    small that logits / temperature overflows (its limit): softmax of inf is NaN, which multinomial refuses."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    scaled = logits.float() / temperature
    if not torch.isfinite(scaled).all() and torch.isfinite(logits).all():
        return logits.argmax(dim=-1, keepdim=True)
    logits = scaled
    if 0 < top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


@torch.no_grad()
def generate_tokens(
    model: HybridLM,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
    stop_id: int | Collection[int] | None = None,
    agree: Callable[[Tensor], Tensor] | None = None,
    stop: Callable[[], bool] | None = None,
) -> Iterator[int]:
    """Yield new token ids one at a time; the same prompt, seed and settings give the same tokens.

    Generation ends before any token in ``stop_id`` (one id or several), which is not yielded, and
    when ``stop()`` (asked before every new token: Ctrl-C during training's sample) says so.

    ``agree`` makes every process of a sharded model take the same token (e.g. rank 0's, broadcast):
    a sharded forward is collective, so all processes must stop at the same step (and ``stop`` must
    give every process the same answer).
    """
    if not prompt:
        raise ValueError("generation needs a non-empty prompt (at least the BOS token)")
    stops = {stop_id} if isinstance(stop_id, int) else set(stop_id or ())
    device = model.tok_embed.weight.device
    generator = torch.Generator(device=device).manual_seed(seed)
    cache = model.init_cache(batch_size=1, max_len=len(prompt) + max_new_tokens)
    # The whole prompt in one pass per block, then one step per new token: a 2,048-token prompt on the
    # `tiny` preset took 13.5 s against 104.7 s token by token (2 shared CPU cores; M2RNN's sequential
    # scan is most of what is left).
    with kernel_prewarm.no_backward_follows():  # set around each call, never across a yield
        logits = model.prefill(torch.tensor([prompt], device=device), cache)
    for _ in range(max_new_tokens):
        if stop is not None and stop():
            return
        nxt = sample_next(logits[:, -1], temperature, top_k, generator)
        if agree is not None:
            nxt = agree(nxt)
        token = int(nxt.item())
        if token in stops:
            return
        yield token
        with kernel_prewarm.no_backward_follows():
            logits = model.forward_step(nxt.view(1, 1), cache)


def stream_text(tokenizer, token_ids: Iterator[int]) -> Iterator[str]:
    """Turn a token stream into text pieces; decoding the whole prefix keeps multi-byte characters whole.
    Special tokens (BOS, EOS, PAD) stand for no text and are never printed."""
    ids: list[int] = []
    emitted = ""
    for token in token_ids:
        ids.append(token)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an unfinished UTF-8 sequence: wait for the next byte
            continue
        yield text[len(emitted):]
        emitted = text
