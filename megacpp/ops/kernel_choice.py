"""`KernelChoice`: the setting that picks the implementation of an op with a Triton fast path.

`auto` takes the Triton path for CUDA tensors the kernels support and the pure-PyTorch reference
elsewhere; `reference` and `triton` force one (`triton` is an error where the kernels cannot serve the
call). Its own torch-free module: the config sections that hold the setting load without torch
(`megacpp config`); where Triton can run is `megacpp.ops.triton_choice`.
"""
from __future__ import annotations

from typing import Literal

KernelChoice = Literal["auto", "reference", "triton"]
