"""Replicated data parallelism: every rank holds the whole model, gradients are reduced once per
optimizer step, and the optimizer step is sharded by parameter ownership.

- Gradients accumulate locally over a step's micro-batches: no collective per micro-batch. During
  the last micro-batch's backward (`arm`), each bucket of parameters (in backward order, about
  `BUCKET_BYTES` each) is copied into one flat buffer and all-reduced asynchronously as soon as every
  gradient in it is final (a post-accumulate-grad hook per parameter), so the reduction overlaps the rest
  of the backward; `finish` waits for the last bucket and points each ``.grad`` at its piece of the reduced
  buffer: every rank holds the mean gradient after one copy of the gradients, not three.
- Each parameter has one owner rank (`assign_owners`, balanced by an estimate of its optimizer work):
  only the owner holds its optimizer state and steps it, on the whole parameter (Muon orthogonalizes
  whole matrices: exact). `OwnedUpdates` then all-gathers the owners' new values into every replica:
  some at once, the blocks' as the next forward reaches them.

Compared with FSDP2 nothing is gathered for the backward and no DTensor reaches the step: the traffic
per step is one all-reduce of the gradients and one all-gather of the weights (in groups), both of fp32
values, and the step's optimizer work is divided by the number of ranks. It needs the whole model, its
gradients and 1/W of the optimizer state on each card (`dist.strategy = "auto"` picks it when that fits;
megacpp.distributed.strategy).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megacpp.distributed.context import DistContext
from megacpp.versions import supports

# DDP's default bucket is 25 MiB; larger buckets mean fewer launches (a `small` step has ~350 M fp32
# gradients, 1.4 GB) and still leave all but the last bucket overlapped with the backward.
BUCKET_BYTES = 64 * 2**20
# Each gradient's piece of a bucket starts a multiple of this many elements in (64 bytes for fp32), so the
# compiled optimizer step reads it as aligned as a gradient of its own (Inductor's kernels assume 16 bytes).
GRADIENT_ALIGN = 16


@dataclass(frozen=True)
class OptimizerWork:
    """What a parameter costs its owner per step: ``flops`` of orthogonalization (Muon) and ``bytes``
    of elementwise state traffic (every optimizer). Compared as seconds on a device that does
    `FLOPS_PER_BYTE` of the one in the time of the other (an H100: ~400 TFLOP/s in bf16 GEMMs against
    ~3 TB/s, so ~130)."""
    flops: float
    bytes: float

    FLOPS_PER_BYTE = 130.0

    @property
    def cost(self) -> float:
        return self.flops / self.FLOPS_PER_BYTE + self.bytes


def optimizer_work(shape: torch.Size, orthogonalized: bool, ns_steps: int = 5) -> OptimizerWork:
    """An estimate for a parameter of ``shape``: ``ns_steps`` Newton-Schulz iterations of about
    6 m^2 n FLOPs per (m x n) matrix (m the smaller side) when ``orthogonalized``, and ~8 fp32 reads and
    writes per element (gradient, momentum, weight, update) either way."""
    numel = shape.numel()
    flops = 0.0
    if orthogonalized and len(shape) >= 2:
        m, n = sorted(shape[-2:])
        flops = ns_steps * 6.0 * m * m * n * (numel // (m * n))
    return OptimizerWork(flops, 32.0 * numel)


def assign_owners(costs: Sequence[float], world: int, load: list[float] | None = None) -> list[int]:
    """The owner rank of each item: longest-processing-time-first onto the least loaded rank, ties to
    the lower rank and the earlier item, so every rank computes the same assignment. ``load`` (updated in
    place): each rank's work from earlier assignments, which this one continues to balance."""
    load = [0.0] * world if load is None else load
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[index] = rank
        load[rank] += costs[index]
    return owners


class ReplicatedGradients:
    """The gradient all-reduce of one replicated model: buckets in backward order, launched in order.

    A bucket's gradients are copied into one flat buffer (each at an aligned offset), reduced to their
    mean in place, and each ``.grad`` then becomes a view of its piece: the reduced values are not copied
    back. On `small` (1.4 GB of fp32 gradients) the mean's separate scaling pass and the copy back were
    two passes of 2.8 GB each per step on 2 H200s (BENCHMARKS.md, V14)."""

    def __init__(self, params: Sequence[nn.Parameter], ctx: DistContext, bucket_bytes: int = BUCKET_BYTES) -> None:
        self.ctx = ctx
        # Parameters are registered in forward order; their gradients become final in about the reverse.
        ordered = [p for p in reversed(params) if p.requires_grad]
        self.buckets: list[list[nn.Parameter]] = []
        size = 0
        for p in ordered:
            nbytes = p.numel() * p.element_size()
            if not self.buckets or size + nbytes > bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += nbytes
        self.offsets = [gradient_offsets(bucket) for bucket in self.buckets]
        self._bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self._armed = False
        self._ready = [0] * len(self.buckets)
        self._launched = 0
        self._pending: list[tuple[dist.Work, Tensor, int]] = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in ordered]

    def arm(self) -> None:
        """The next backward is the step's last: reduce each bucket as soon as its gradients are final."""
        self._armed = True
        self._ready = [0] * len(self.buckets)
        self._launched = 0
        self._pending = []

    def finish(self) -> None:
        """Launch what the backward left (unused parameters), wait for every bucket and point each ``.grad``
        at the mean gradient over ranks (None stays None: the same parameters on every rank)."""
        self._launch_up_to(len(self.buckets))
        self._armed = False
        for work, flat, index in self._pending:
            work.wait()
            if not _averages(flat):
                flat.mul_(1.0 / self.ctx.world_size)
            for p, offset in zip(self.buckets[index], self.offsets[index], strict=True):
                if p.grad is not None:
                    p.grad = flat[offset:offset + p.numel()].view_as(p)
        self._pending = []

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self._armed:
            return
        index = self._bucket_of[p]
        self._ready[index] += 1
        # In order, like DDP: every rank must issue the same collectives in the same order.
        while self._launched < len(self.buckets) and self._ready[self._launched] == len(self.buckets[self._launched]):
            self._launch_up_to(self._launched + 1)

    def _launch_up_to(self, end: int) -> None:
        while self._launched < end:
            index = self._launched
            flat = flatten_aligned([p.grad for p in self.buckets[index]], self.buckets[index], self.offsets[index])
            op = dist.ReduceOp.AVG if _averages(flat) else dist.ReduceOp.SUM
            self._pending.append((dist.all_reduce(flat, op=op, async_op=True), flat, index))
            self._launched += 1


def gradient_offsets(params: Sequence[Tensor]) -> list[int]:
    """Where each parameter's gradient starts in its bucket's flat buffer: in order, each at a multiple of
    `GRADIENT_ALIGN` elements."""
    offsets, end = [], 0
    for p in params:
        offsets.append(end)
        end += -(-p.numel() // GRADIENT_ALIGN) * GRADIENT_ALIGN
    return offsets


def flatten_aligned(grads: Sequence[Tensor | None], params: Sequence[Tensor], offsets: Sequence[int]) -> Tensor:
    """One flat buffer holding each gradient at its offset (zeros for a missing one and in the gaps), in one
    copy of the gradients."""
    pieces: list[Tensor] = []
    end = 0
    for grad, p, offset in zip(grads, params, offsets, strict=True):
        if offset > end:
            pieces.append(p.new_zeros(offset - end))
        pieces.append(grad.reshape(-1) if grad is not None else p.new_zeros(p.numel()))
        end = offset + p.numel()
    return torch.cat(pieces)


def _averages(flat: Tensor) -> bool:
    """Whether the all-reduce of `flat` averages by itself: NCCL's (CUDA tensors) does, gloo's has no AVG."""
    return flat.device.type == "cuda"


class GatherGroup:
    """One all-gather of owners' parameters: each rank's owned parameters of the group in a flat slot,
    padded to the largest slot (all_gather_into_tensor needs equal pieces)."""

    def __init__(self, params: Sequence[nn.Parameter], owners: Sequence[int], ctx: DistContext) -> None:
        self.ctx = ctx
        self.by_rank: list[list[nn.Parameter]] = [[] for _ in range(ctx.world_size)]
        for p, owner in zip(params, owners, strict=True):
            self.by_rank[owner].append(p)
        self.slot = max(sum(p.numel() for p in ps) for ps in self.by_rank)

    def launch(self) -> tuple[dist.Work | None, Tensor]:
        """Start the all-gather of this rank's current values; returns its work and the buffer it fills."""
        mine = self.by_rank[self.ctx.rank]
        device = self.ctx.device
        # Only the padding past this rank's parameters is zeroed: zeroing the whole slot was a pass of its own
        # (0.20 ms a step for `small` on 2 H200s, BENCHMARKS.md V15).
        used = sum(p.numel() for p in mine)
        local = torch.empty(self.slot, dtype=torch.float32, device=device)
        local[used:].zero_()
        if mine:
            torch.cat([p.detach().reshape(-1) for p in mine], out=local[:used])
        everyone = torch.empty(self.slot * self.ctx.world_size, dtype=torch.float32, device=device)
        return _all_gather_single(everyone, local), everyone

    @torch.no_grad()
    def land(self, work: dist.Work | None, everyone: Tensor) -> None:
        """Wait for the all-gather and write the other owners' values into their parameters."""
        if work is not None:
            work.wait()
        for rank, params in enumerate(self.by_rank):
            if rank == self.ctx.rank or not params:
                continue
            slot = everyone[rank * self.slot:(rank + 1) * self.slot]
            pieces = slot[:sum(p.numel() for p in params)].split([p.numel() for p in params])
            torch._foreach_copy_(list(params), [piece.view_as(p) for piece, p in zip(pieces, params, strict=True)])


class OwnedUpdates:
    """The all-gathers that bring each owner's freshly stepped parameters to every replica.

    The first group (what the model reads outside its blocks, and what MuonClip and the spectral cap read
    right after the step) lands in `gather`. The blocks' parameters follow in runs of consecutive blocks:
    `gather` only starts their all-gathers, and each run lands just before its first block's next forward
    (a forward pre-hook), so all but the first run's traffic overlaps the forward's compute instead of
    delaying it: `small` on 2 H200s spent 2.6 ms a step in the all-gather with nothing beside it (BENCHMARKS.md
    V15), and ran 0.3% and 0.6% faster with the runs (V16). Whatever else reads the weights first calls
    `complete` (the model's state_dict and load_state_dict do)."""

    def __init__(self, groups: Sequence[tuple[GatherGroup, nn.Module | None]], model: nn.Module) -> None:
        self.groups = list(groups)
        self._pending: list[tuple[GatherGroup, dist.Work | None, Tensor]] = []
        self._hooks = [first.register_forward_pre_hook(self._before(index))
                       for index, (_, first) in enumerate(self.groups) if first is not None]
        self._hooks.append(model.register_state_dict_pre_hook(lambda *_: self.complete()))
        self._hooks.append(model.register_load_state_dict_pre_hook(lambda *_: self.complete()))

    @property
    def pending(self) -> int:
        """Groups whose all-gather has not landed yet."""
        return len(self._pending)

    def gather(self) -> None:
        """The owners stepped: land the first group now and start the others' all-gathers."""
        self.complete()
        for group, _ in self.groups:
            self._pending.append((group, *group.launch()))
        self.complete(up_to=self.groups[0][0])

    def complete(self, up_to: GatherGroup | None = None) -> None:
        """Land the pending all-gathers in order, through the group ``up_to`` (None: all of them)."""
        while self._pending:
            group, work, everyone = self._pending.pop(0)
            group.land(work, everyone)
            if group is up_to:
                return

    def close(self) -> None:
        """Remove the hooks. Pending all-gathers are dropped, not waited for: after a failure a peer may never
        join them (an orderly run settled its weights for its last sample)."""
        self._pending = []
        for hook in self._hooks:
            hook.remove()

    def _before(self, index: int) -> Callable[..., None]:
        group = self.groups[index][0]

        def land_before_forward(module: nn.Module, args: Any) -> None:
            if any(pending is group for pending, _, _ in self._pending):
                self.complete(up_to=group)

        return land_before_forward


def _all_gather_single(output: Tensor, local: Tensor) -> dist.Work | None:
    gather = dist.all_gather_single if supports("all_gather_single") else dist.all_gather_into_tensor
    return gather(output, local, async_op=True)


@dataclass
class Replication:
    """Replicate data parallelism of one model: its gradient reduction, the parameters each rank owns,
    and the gather of the owners' updates."""
    gradients: ReplicatedGradients
    updates: OwnedUpdates
    owned: frozenset[nn.Parameter]

    def owns(self, p: Tensor) -> bool:
        return p in self.owned


def replicate(model: nn.Module, ctx: DistContext, work: Callable[[nn.Parameter], OptimizerWork],
              local: Callable[[nn.Parameter], bool] = lambda p: False,
              whole_after_step: Callable[[nn.Parameter], bool] = lambda p: False,
              land_in_forward: bool = True) -> Replication:
    """Set up replicate data parallelism for ``model`` (already compiled; identical on every rank).
    ``work(p)`` estimates a parameter's optimizer work, for the ownership balance; parameters that
    are ``local`` (expert parallelism's expert rows, different on every rank) are left alone; those
    ``whole_after_step`` are gathered before anything after the optimizer step reads them (MuonClip's,
    the spectral cap's), the other blocks' parameters as the next forward reaches them (`OwnedUpdates`),
    unless ``land_in_forward`` is False (a model compiled whole, whose graph would have to trace the hooks'
    waits): then all of them land after the step."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad and not local(p)]
    for name, p in named:
        if p.dtype != torch.float32:
            raise TypeError(f"replicate data parallelism keeps fp32 parameters; {name} is {p.dtype}")
        if not p.is_contiguous():  # its reduced gradient becomes a contiguous view of a flat buffer
            raise TypeError(f"replicate data parallelism needs contiguous parameters; {name} has strides {p.stride()}")
    params = [p for _, p in named]
    load = [0.0] * ctx.world_size
    groups, owned = [], set()
    layout = gather_groups(model, params, whole_after_step) if land_in_forward else [(params, None)]
    for members, first in layout:
        # Balanced group by group, each continuing from the load of the ones before: every all-gather's
        # slots stay about equal (little padding) and so does each rank's whole optimizer step.
        owners = assign_owners([work(p).cost for p in members], ctx.world_size, load)
        owned.update(p for p, owner in zip(members, owners, strict=True) if owner == ctx.rank)
        groups.append((GatherGroup(members, owners, ctx), first))
    return Replication(ReplicatedGradients(params, ctx), OwnedUpdates(groups, model), frozenset(owned))


# The blocks' parameters are gathered in this many runs of consecutive blocks: the first run's all-gather
# is not hidden (only the embedding's work precedes its first block), each later one behind the runs before.
GATHER_RUNS = 4


def gather_groups(model: nn.Module, params: Sequence[nn.Parameter], whole_after_step: Callable[[nn.Parameter], bool]
                  ) -> list[tuple[list[nn.Parameter], nn.Module | None]]:
    """``params`` in all-gather groups, in the order they are needed: first those outside the model's
    ``blocks`` (a ModuleList; a model without one is a single group) or ``whole_after_step``, then the
    rest of the blocks' in `GATHER_RUNS` runs of consecutive blocks, each with the block that reads it
    first."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        return [(list(params), None)]
    runs = _consecutive_runs(list(blocks), GATHER_RUNS)
    chosen = set(params)
    run_of: dict[nn.Parameter, int] = {}
    for index, run in enumerate(runs):
        for block in run:
            for p in block.parameters():
                if p in chosen and not whole_after_step(p):
                    run_of.setdefault(p, index)
    groups = [([p for p in params if p not in run_of], None)]
    for index, run in enumerate(runs):
        members = [p for p in params if run_of.get(p) == index]
        if members:
            groups.append((members, run[0]))
    return [(members, first) for members, first in groups if members]


def _consecutive_runs(items: list[nn.Module], count: int) -> list[list[nn.Module]]:
    """``items`` in at most ``count`` runs of consecutive items, sizes differing by at most one."""
    count = min(count, len(items))
    bounds = [len(items) * i // count for i in range(count + 1)]
    return [items[bounds[i]:bounds[i + 1]] for i in range(count)]


def owned_share(replication: Replication, params: Iterable[nn.Parameter]) -> float:
    """The fraction of ``params``' elements this rank owns (for the run header)."""
    params = list(params)
    total = sum(p.numel() for p in params)
    return sum(p.numel() for p in params if replication.owns(p)) / max(total, 1)
