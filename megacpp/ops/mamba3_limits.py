"""What the Mamba-3 scan's Triton kernels support, as sizes: the config gate's rule and the op's check.

Torch-free, so the configuration (`megacpp config`) holds `model.mamba` to it without loading torch; the
kernels themselves are megacpp/ops/mamba3_triton.py, the op megacpp/ops/mamba3_fused.py.
"""
from __future__ import annotations

from megacpp.ops.kernel_choice import KernelChoice

ScanKernel = KernelChoice
# The kernels' limits: tl.dot tiles need powers of two >= 16 (smaller sizes are padded with masks), and
# the register budget of one program bounds the (head_dim, d_state / 2) state halves.
TRITON_CHUNK_SIZES = (16, 32, 64, 128)
TRITON_MAX_HEAD_DIM = 128
TRITON_MAX_D_STATE = 256


def triton_size_reason(head_dim: int, d_state: int, n_angles: int, chunk_size: int) -> str | None:
    """None when the Triton kernels support these sizes, else why not (also the config gate's rule)."""
    if d_state % 2 or d_state > TRITON_MAX_D_STATE:
        return f"d_state must be even and at most {TRITON_MAX_D_STATE}, got {d_state}"
    if head_dim > TRITON_MAX_HEAD_DIM:
        return f"head_dim must be at most {TRITON_MAX_HEAD_DIM}, got {head_dim}"
    if n_angles > d_state // 2:
        return f"n_angles must be at most d_state / 2 = {d_state // 2}, got {n_angles}"
    if chunk_size not in TRITON_CHUNK_SIZES:
        return f"chunk_size must be one of {TRITON_CHUNK_SIZES}, got {chunk_size}"
    return None
