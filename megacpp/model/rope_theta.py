"""RoPE's base period by context length: the documented rule for long contexts (README "Long context").

The base period ``theta`` sets the slowest rotation (about once every 2 pi theta positions): positions
far apart in a context much longer than that rotation look alike to attention. The default 10,000 stays
the setting of every preset, which train at 256 to 4,096 tokens. Torch-free, so the configuration gate
(megacpp.validate) advises from it without loading torch; the tables are megacpp/model/rope.py.
"""
from __future__ import annotations

SHORT_CONTEXT_THETA = 10_000.0  # the original RoPE base, AttentionConfig's default
# (longest context, theta), from public long-context recipes: Llama 3 raised theta to 500,000 and cites
# Xiong et al. 2023 ("Effective Long-Context Scaling", arXiv 2309.16039) for its effectiveness up to
# 32,768 tokens; Code Llama (arXiv 2308.12950) trained at 16,384 tokens with theta 1,000,000 and stayed
# stable up to 100,000.
LONG_CONTEXT_THETAS = ((8192, SHORT_CONTEXT_THETA), (32768, 500_000.0), (65536, 1_000_000.0))


def rope_theta_for_length(seq_len: int) -> float:
    """The base period for rows of `seq_len` tokens: the first entry of LONG_CONTEXT_THETAS whose length
    covers it (10,000 up to 8,192, 500,000 up to 32,768, 1,000,000 up to 65,536)."""
    for longest, theta in LONG_CONTEXT_THETAS:
        if seq_len <= longest:
            return theta
    raise ValueError(f"no documented rope_theta for {seq_len} tokens (the rule covers up to "
                     f"{LONG_CONTEXT_THETAS[-1][0]:,})")
