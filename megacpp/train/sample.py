"""The end-of-run sample: a few tokens from the prompt ``train.sample_prompt``, printed and written to
``sample.txt``, decoded by every rank together."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from megacpp.data.tokenizer import CodeTokenizer
from megacpp.distributed.context import DistContext
from megacpp.runtime.generate import generate_tokens, stream_text
from megacpp.train.config import TrainConfig


def end_of_run_sample(model: nn.Module, tokenizer: CodeTokenizer, tc: TrainConfig, ctx: DistContext, out_dir: Path,
                      log: Callable[[str], None], stop: Callable[[], bool] | None = None) -> str | None:
    """Every rank decodes (a sharded model gathers weights collectively); rank 0's token choice is
    broadcast each step so ranks never disagree on when to stop. Rank 0 writes the text. ``stop`` is
    asked before every token (every rank must get the same answer); when it ends the sample, nothing is
    written or printed and the result is None."""
    prompt = [tokenizer.bos_id, *tokenizer.encode(tc.sample_prompt)]
    stopped = False

    def stop_here() -> bool:
        nonlocal stopped
        stopped = stop is not None and stop()
        return stopped

    model.eval()
    with torch.compiler.set_stance("force_eager"):
        tokens = generate_tokens(model, prompt, tc.sample_tokens, tc.sample_temperature, tc.sample_top_k, tc.seed,
                                 stop_id={tokenizer.bos_id, tokenizer.eos_id}, agree=ctx.broadcast_, stop=stop_here)
        pieces = list(stream_text(tokenizer, tokens))
    model.train()
    if stopped:
        return None
    text = tc.sample_prompt + "".join(pieces)
    if ctx.is_main:
        (out_dir / "sample.txt").write_text(text)
    log(f"--- sample ({tc.sample_tokens} tokens, temperature {tc.sample_temperature}, "
        f"top-k {tc.sample_top_k}) ---\n{text}\n---")
    return text
