"""Muon on FSDP2 shards that is still Muon: every matrix is orthogonalized whole.

FSDP2 shards each parameter's dim 0 over the ranks. For stacked (E, A, B) parameters (experts, M2RNN
W) a shard is a set of whole matrices, so the single-device step runs on each rank's shard with no
communication. A 2-D matrix is split by rows, and orthogonalizing each rank's rows separately is a
different optimizer (on nam52's QKV over 8 ranks it is 44-46% off the true update), so for those:

1. momentum (and Nesterov) on the local rows, elementwise: as on one device;
2. each matrix's rows go to one owner rank (matrix i of a same-shape bucket to rank i mod W) with one
   ``all_to_all_single``, the owner orthogonalizes the whole matrix (split-QKV on the whole matrix)
   and applies variance reduction, and a second ``all_to_all_single`` brings the rows back;
3. cautious weight decay and the step on the local rows, elementwise.

Variance-reduction state stays in the parameter's layout, so a checkpoint reshards it: a tall
matrix's per-row second moment is row-sharded like the matrix and travels with the rows (one extra
column); a wide matrix's per-column second moment is replicated, updated by the owner and sent back
to every rank (one extra row). The arithmetic is the single-device arithmetic on the same values, so
on CPU the update is bit-identical to `Muon`'s (tests/test_dist_muon.py).

Under hsdp a parameter lives on a 2-D (replicas, shards) mesh with placements (Replicate(), Shard(0)):
every replica holds the same rows and, after FSDP2's all-reduce across replicas, the same gradients, so
each replica runs the exchange above within its own shard group (the mesh dimension of the Shard(0)
placement) and all replicas compute the same update. Replicated mesh dimensions never need a collective.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from megacpp.optim.hparams import StepCall, gradient_stand_in
from megacpp.optim.local import is_sharded, shard_dim
from megacpp.optim.muon import (
    Bucket,
    Muon,
    apply_update,
    momentum_update,
    orthogonal_update,
    second_moment_shape,
)


def shard_rows(rows: int, world: int) -> list[int]:
    """Rows each rank holds under dim-0 sharding (ceil-sized chunks; trailing ranks may hold none)."""
    chunk = -(-rows // world)
    return [max(0, min(rows, (r + 1) * chunk) - min(rows, r * chunk)) for r in range(world)]


def owned(n: int, rank: int, world: int) -> range:
    """Indices of the bucket's matrices that `rank` orthogonalizes."""
    return range(rank, n, world)


def to_owners(local: Tensor, rows: list[int], rank: int, group: Any = None) -> Tensor:
    """(n, rows[rank], w) local rows of n matrices -> (k, R, w) whole matrices this rank owns."""
    world, n, width = len(rows), local.shape[0], local.shape[-1]
    send = [local[d::world].reshape(-1) for d in range(world)]
    k = len(owned(n, rank, world))
    recv_sizes = [k * rows[s] * width for s in range(world)]
    recv = local.new_empty(sum(recv_sizes))
    dist.all_to_all_single(recv, torch.cat(send), recv_sizes, [t.numel() for t in send], group=group)
    parts = recv.split(recv_sizes)
    return torch.cat([part.view(k, rows[s], width) for s, part in enumerate(parts)], dim=1)


def from_owners(whole: Tensor, n: int, rows: list[int], rank: int, tail: Tensor | None = None,
                group: Any = None) -> Tensor:
    """(k, R, w) owned whole matrices -> (n, rows[rank] + t, w): this rank's rows of all n matrices,
    each followed by the owner's `tail` (k, t, w) rows, which every rank receives."""
    world, width = len(rows), whole.shape[-1]
    extra = 0 if tail is None else tail.shape[1]
    starts = [sum(rows[:d]) for d in range(world)]
    send = []
    for d in range(world):
        piece = whole[:, starts[d]:starts[d] + rows[d]]
        send.append((piece if tail is None else torch.cat([piece, tail], dim=1)).reshape(-1))
    mine = rows[rank] + extra
    recv_sizes = [len(owned(n, s, world)) * mine * width for s in range(world)]
    recv = whole.new_empty(sum(recv_sizes))
    dist.all_to_all_single(recv, torch.cat(send), recv_sizes, [t.numel() for t in send], group=group)
    out = whole.new_empty(n, mine, width)
    for s, part in enumerate(recv.split(recv_sizes)):
        out[s::world] = part.view(len(owned(n, s, world)), mine, width)
    return out


class ShardedMuon(Muon):
    """`Muon` for FSDP2-sharded parameters, on a 1-D (shards) or 2-D (replicas, shards) mesh (see the
    module docstring); same arguments."""

    def _check_layout(self, p: Tensor) -> None:
        if not is_sharded(p):
            return
        shards = [pl for pl in p.placements if pl.is_shard()]
        if len(shards) > 1 or any(pl.dim != 0 for pl in shards):
            raise ValueError(f"ShardedMuon needs dim-0 shards over one mesh dimension; got {p.placements} for "
                             f"{tuple(p.shape)}")

    def _new_second_moment(self, p: Tensor) -> Tensor:
        if not is_sharded(p):
            return super()._new_second_moment(p)
        from torch.distributed.tensor import DTensor, Replicate

        shape = second_moment_shape(p.shape)
        per_column_2d = p.ndim == 2 and shape[0] == 1  # one row for all of the matrix's rows
        # Split by rows like p (a per-row moment travels with its rows), or whole on every rank.
        placements = [Replicate() if per_column_2d else pl for pl in p.placements]
        local_rows = shape[0] if per_column_2d else p.to_local().shape[0]
        local = torch.zeros((local_rows, *shape[1:]), dtype=torch.float32, device=p.device)
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, p.device_mesh, placements, run_check=False, shape=shape, stride=stride)

    def _row_sharded(self, bucket: Bucket) -> bool:
        p = bucket.params[0]
        dim = shard_dim(p)
        return p.ndim == 2 and dim is not None and p.device_mesh.size(dim) > 1

    def first_step_calls(self) -> list[StepCall]:
        """`step_buckets`'s calls: the whole matrices' step, then each row-sharded bucket's three."""
        buckets = self.buckets(gradient_stand_in) if self.compile_step else []
        calls = self._whole_matrix_calls([b for b in buckets if not self._row_sharded(b)])
        for bucket in buckets:
            if self._row_sharded(bucket):
                calls += self._row_sharded_calls(bucket)
        return calls

    def _row_sharded_calls(self, bucket: Bucket) -> list[StepCall]:
        """`_step_row_sharded`'s compiled calls, with meta tensors of the layouts its exchanges return
        (`to_owners`: (k, R, w) contiguous; `from_owners`: (n, rows + t, w) contiguous)."""
        params, grads, buffers, second_moments, lr, weight_decay, momentum, beta2, grad_scale = \
            self.bucket_work(bucket, gradient_stand_in)
        plan, backend = bucket.plan, self.compile_backend
        mesh, dim = bucket.params[0].device_mesh, shard_dim(bucket.params[0])
        rank, world = mesh.get_local_rank(dim), mesh.size(dim)
        n, (total_rows, cols) = len(params), bucket.params[0].shape
        rows = shard_rows(total_rows, world)
        tall_vr = plan.variance_reduction and total_rows > cols
        wide_vr = plan.variance_reduction and not tall_vr
        calls = [StepCall(momentum_update, (grads, buffers, momentum, plan.nesterov, grad_scale), backend)]
        mine = list(owned(n, rank, world))
        width = cols + 1 if tall_vr else cols
        whole = torch.empty((len(mine), total_rows, width), dtype=torch.float32, device="meta")
        if mine:
            if tall_vr:
                moments = list(whole[..., cols:].unbind(0))
            else:
                moments = [second_moments[i] for i in mine] if wide_vr else []
            calls.append(StepCall(orthogonal_update, (whole[..., :cols].contiguous(), moments, beta2, plan), backend))
        local = torch.empty((n, rows[rank] + (1 if wide_vr else 0), width), dtype=torch.float32, device="meta")
        calls.append(StepCall(apply_update, (params, local[:, :rows[rank], :cols], lr, weight_decay, plan), backend))
        return calls

    def step_buckets(self, buckets: list[Bucket]) -> None:
        """Stacked parameters (whole matrices on each rank) as on one device; row-sharded ones through
        their owners."""
        super().step_buckets([b for b in buckets if not self._row_sharded(b)])
        for bucket in buckets:
            if self._row_sharded(bucket):
                self._step_row_sharded(bucket)

    def _step_row_sharded(self, bucket: Bucket) -> None:
        params, grads, buffers, second_moments, lr, weight_decay, momentum, beta2, grad_scale = self.bucket_work(bucket)
        plan = bucket.plan
        mesh, dim = bucket.params[0].device_mesh, shard_dim(bucket.params[0])
        rank, world, group = mesh.get_local_rank(dim), mesh.size(dim), mesh.get_group(dim)
        n, (total_rows, cols) = len(params), bucket.params[0].shape
        rows = shard_rows(total_rows, world)
        tall_vr = plan.variance_reduction and total_rows > cols
        wide_vr = plan.variance_reduction and not tall_vr

        update = self._run(momentum_update, grads, buffers, momentum, plan.nesterov, grad_scale)
        payload = torch.cat([update, torch.stack(second_moments)], dim=-1) if tall_vr else update
        whole = to_owners(payload.contiguous(), rows, rank, group)
        mine = list(owned(n, rank, world))
        if tall_vr:
            moments = list(whole[..., cols:].unbind(0))  # views: updated in place, sent back with the rows
        elif wide_vr:
            moments = [second_moments[i] for i in mine]  # replicated: the owner's copy is current
        else:
            moments = []
        if mine:
            ortho = self._run(orthogonal_update, whole[..., :cols].contiguous(), moments, beta2, plan)
        else:  # more ranks than matrices of this shape: this rank only sends and receives rows
            ortho = whole.new_empty(0, total_rows, cols)
        if tall_vr:
            back, tail = torch.cat([ortho, whole[..., cols:]], dim=-1), None
        elif wide_vr:
            back, tail = ortho, (torch.stack(moments) if mine else ortho.new_empty(0, 1, cols))
        else:
            back, tail = ortho, None
        local = from_owners(back, n, rows, rank, tail, group)
        if tall_vr:
            torch._foreach_copy_(second_moments, list(local[..., cols:].unbind(0)))
        elif wide_vr:
            torch._foreach_copy_(second_moments, list(local[:, rows[rank]:].unbind(0)))
        self._run(apply_update, params, local[:, :rows[rank], :cols], lr, weight_decay, plan)
