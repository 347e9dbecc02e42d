"""Which fast paths load on this machine: one line each, for `megacpp doctor` and for the ranks of a job,
which compare these lines at start (megacpp.distributed.parity): ranks must run the same kernels.

Each fast path has a pure-PyTorch reference it falls back to.
"""
from __future__ import annotations

import torch

from megacpp.ops import m2rnn_scan, mamba3_angles, mamba3_fused, softcap_xent
from megacpp.versions import package_version, supports


def kernel_report() -> list[str]:
    """One line per fast path: whether it runs here, and what runs instead."""
    flex = "available on CUDA" if supports("flex_attention") else "fallback: SDPA with a dense mask"
    rows = [f"FlexAttention (document masks, soft-cap): {flex}; CPU always uses SDPA with a mask"]
    triton = package_version("triton")
    rows.append(f"Triton {triton}: " + ("usable" if torch.cuda.is_available() and triton != "not installed"
                                         else "not used (CPU or not installed)"))
    fused = m2rnn_scan.m2rnn_triton is not None and torch.cuda.is_available()
    rows.append("m2rnn_scan: " + ("fused Triton kernels on CUDA (reference for unsupported sizes)" if fused
                                  else "pure-PyTorch reference (custom op; no CUDA or no triton)"))
    fused = mamba3_fused.mamba3_triton is not None and torch.cuda.is_available()
    rows.append("mamba3 scan: pure-PyTorch chunked reference by default; " + (
        "fused Triton kernels available on CUDA (model.mamba.scan_kernel = auto or triton)" if fused
        else "no fused kernels here (no CUDA or no triton)"))
    fused = mamba3_angles.triton is not None and torch.cuda.is_available()
    rows.append("mamba3 angles: " + ("fused Triton kernels on CUDA (reference for unsupported inputs)" if fused
                                     else "pure-PyTorch reference (custom op; no CUDA or no triton)"))
    fused = softcap_xent.softcap_xent_triton is not None and torch.cuda.is_available()
    rows.append("loss head: F.cross_entropy on the soft-capped logits by default; " + (
        "fused Triton loss available on CUDA (model.loss_kernel = auto or triton)" if fused
        else "no fused loss here (no CUDA or no triton)"))
    rows.append("Muon's Gram products: " + (
        "Triton kernel of upper tiles for the large stacks (the experts'), cuBLAS for the rest "
        "(optim.muon_gram_kernel = auto; reference: cuBLAS for all)"
        if torch.cuda.is_available() else "matmuls (no CUDA)"))
    return rows
