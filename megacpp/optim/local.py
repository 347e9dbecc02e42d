"""Each rank's own part of a possibly sharded tensor.

Under FSDP2 parameters, gradients and optimizer states are DTensors sharded on dim 0. Elementwise
optimizer math is the same on each rank's rows as on the whole tensor, so optimizers unwrap to the
local shard (a view: in-place writes land in the DTensor) and compute on plain tensors, which also
keeps the compiled optimizer step free of DTensor dispatch.
"""
from __future__ import annotations

import sys

from torch import Tensor


def is_sharded(t: Tensor) -> bool:
    # A DTensor exists only once torch.distributed.tensor was imported: looking the class up here
    # instead of importing it with this module keeps `import megacpp.config` (and with it every CLI
    # command) from loading DTensor and sympy, about a second.
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def local_tensor(t: Tensor) -> Tensor:
    """The shard this rank holds (the tensor itself when it is not a DTensor)."""
    return t.to_local() if is_sharded(t) else t


def full_value(t: Tensor) -> Tensor:
    """A replicated or partial DTensor's full value (e.g. a global gradient norm); plain tensors as is."""
    return t.full_tensor() if is_sharded(t) else t


def shard_dim(t: Tensor) -> int | None:
    """The mesh dimension a DTensor's rows are split over (its Shard(0) placement); None when none is."""
    return next((d for d, p in enumerate(t.placements) if p.is_shard(0)), None) if is_sharded(t) else None


def row_range(t: Tensor) -> tuple[int, int]:
    """[start, stop) of the dim-0 rows this rank holds: the whole range for a plain or replicated tensor.

    FSDP2 shards dim 0 in ceil(n / W) chunks (torch.chunk's rule; trailing ranks may hold none), W the
    ranks of the mesh dimension it shards over (every rank under fsdp; a shard group under hsdp, whose
    replicas hold the same rows).
    """
    rows = t.shape[0]
    dim = shard_dim(t)
    if dim is None:
        return 0, rows
    mesh = t.device_mesh
    world, rank = mesh.size(dim), mesh.get_local_rank(dim)
    chunk = -(-rows // world)
    start, stop = min(rank * chunk, rows), min((rank + 1) * chunk, rows)
    if t.to_local().shape[0] != stop - start:
        raise RuntimeError(f"shard of rows {start}:{stop} expected, rank {rank} holds "
                           f"{t.to_local().shape[0]} rows of {tuple(t.shape)}")
    return start, stop
