"""What the fused loss kernel supports: the implementation setting and the largest soft-cap.

Torch-free, so the configuration (`megacpp config`) holds `model.loss_kernel` and `model.logit_softcap`
to it without loading torch; the op is megacpp/ops/softcap_xent.py.
"""
from __future__ import annotations

from megacpp.ops.kernel_choice import KernelChoice

LossKernel = KernelChoice
# The kernel's largest soft-cap: it sums exp(z - cap) without a running maximum, and its smallest term
# e^(-2 cap) must stay a normal fp32 number (megacpp/ops/softcap_xent_triton.py).
MAX_CAP = 40.0
