"""The end of a gloo test script: its process group closed only once nothing holds collective work."""
from __future__ import annotations

import gc

import torch.distributed as dist


def close_group() -> None:
    """Collect what the script dropped (its caller `del`s its DTensors and optimizers first), meet the other
    ranks, then destroy the group: gloo work still held by an object alive at interpreter exit aborts the
    process ('terminate called without an active exception')."""
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
