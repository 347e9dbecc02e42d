"""Expert parallelism (``dist.expert_parallel = P``): each E block's routed experts split over P ranks.

The world of W ranks is a 2-D mesh ``(replicas, experts)`` of shape (W/P, P); rank r sits at
(r // P, r % P), so an expert group is P consecutive ranks (one host's GPUs, where the all-to-all
runs over NVLink). Rank r holds experts [j*E/P, (j+1)*E/P) of every E block, j = r % P, as plain
parameters of the same names with E/P rows; every other parameter (attention, M, R, shared expert,
router, embeddings) stays whole and follows the data-parallel strategy over all W ranks.

Inside an E block's forward (compiled, in one graph on every rank; `ExpertExchange`):
1. each rank routes its own tokens (router and selection bias are replicated, so the same rule);
2. every routed row (token, slot) is placed in the part of a static send buffer (P chunks of b*t*k
   rows) that goes to the rank holding its expert, in expert order;
3. one all-to-all sends the buffers, one more their experts' local ids (the padding's id is E/P);
4. the receiving rank runs its experts on the rows it got (grouped GEMMs over the rows sorted by
   expert on CUDA; every local expert on every row, selected by id, as the reference);
5. one all-to-all brings each row's output back to its token's rank, where the block combines it
   exactly as on one device.
Both exchanges are functional collectives (``all_to_all_single_autograd``), traced into the compiled
graph: no graph break, and the backward is the reverse all-to-all. The shapes follow the input's (the
batch axis may stay dynamic), never the routing.

Dropless, with bounded buffers: each chunk has room for all of a rank's routed rows (they could all go
to one rank), so nothing is ever dropped and EP cannot change what the model learns, at the price of
buffers and all-to-all bytes P times the routed rows (zeros past each rank's rows). On 2 ranks that is
2x; docs/distributed.md estimates what it costs at 8.

Gradients: a rank's local expert gradients hold the sum over every rank's tokens of its own loss's
gradient, so the mean over ranks is that sum / W, all-reduced over the replicas of the expert group
when W > P (`ExpertParallel.finish_gradients`). Muon steps each rank's whole expert matrices locally
(exact: it orthogonalizes each expert's matrix on its own); the gradient-norm clip adds the expert
groups' squared norms over the expert group (`ExpertParallel.global_norm`).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from megacpp.distributed.config import DistConfig
from megacpp.distributed.context import DistContext, DistError, grid_mesh
from megacpp.model.hints import canonical_name
from megacpp.model.moe import MoE, batched_experts, expert_order, permute_rows
from megacpp.optim.local import full_value

EXPERT_PARAMETERS = ("w_up", "w_down")


def local_expert_rows(rows: Tensor, ids: Tensor, w_up: Tensor, w_down: Tensor, dtype: torch.dtype | None) -> Tensor:
    """Each row through the local expert its id names: rows (R, d), ids (R,) in [0, E_l] where E_l
    (= w_up.shape[0]) marks padding, whose output is zero. ``dtype`` None: the reference, every local
    expert on every row (E_l times the work) selected by id; otherwise two grouped GEMMs in ``dtype``
    over the rows in expert order, padding last and outside every group."""
    n_local = w_up.shape[0]
    if dtype is None:
        every = batched_experts(rows.unsqueeze(0).expand(n_local, *rows.shape).contiguous(), w_up, w_down)
        mine = ids.unsqueeze(0) == torch.arange(n_local, device=ids.device).unsqueeze(1)  # (E_l, R)
        return torch.where(mine.unsqueeze(-1), every, 0).sum(dim=0)
    order, position, counts = expert_order(ids.unsqueeze(0), n_local + 1)
    offs = counts[:n_local].cumsum(dim=0).to(torch.int32)
    ordered = permute_rows(rows.to(dtype), order, position)
    hidden = F.relu(F.grouped_mm(ordered, w_up.to(dtype), offs=offs))
    out = F.grouped_mm(hidden * hidden, w_down.to(dtype), offs=offs)
    # grouped_mm leaves the rows past the last group unwritten: the padding's output is zero instead.
    used = torch.arange(out.shape[0], device=out.device) < offs[-1]
    return permute_rows(torch.where(used.unsqueeze(-1), out, 0), position, order)


def send_layout(routed: Tensor, n_experts: int, degree: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Where each routed row goes in the send buffer of ``degree`` chunks of n = routed.numel() slots.

    routed (b, m): each routed row's expert; rank j holds experts [j*E/degree, (j+1)*E/degree). Returns
    source (degree*n,): the row each slot holds (a clamped index where unused); slot (n,): each row's slot,
    so that source[slot[i]] == i; used (degree*n,) bool; counts (E,): rows per expert. Within its rank's
    chunk a row sits at its place in expert order (stable: within an expert, row-major order)."""
    n = routed.numel()
    n_local = n_experts // degree
    order, position, counts = expert_order(routed, n_experts)
    per_rank = counts.view(degree, n_local).sum(dim=1)
    first = per_rank.cumsum(dim=0) - per_rank
    # Slot r of rank j's chunk holds the (first[j] + r)-th row in expert order, if rank j has that many.
    within = torch.arange(n, device=routed.device)
    used = (within.unsqueeze(0) < per_rank.unsqueeze(1)).reshape(-1)
    source = order[(first.unsqueeze(1) + within).clamp(max=n - 1)].reshape(-1)
    rank = torch.div(routed.reshape(-1), n_local, rounding_mode="floor")
    slot = rank * n + position - first[rank]
    return source, slot, used, counts


class ExpertExchange:
    """The routed experts of one E block across its expert group (steps 2-5 of the module docstring).

    Installed as the block's ``routed_experts``; called with MoE's arguments, it returns what
    `megacpp.model.moe.grouped_expert_rows` returns, with the keep mask of `padded_expert_rows` (all
    True: dropless): rows (b, t, k, d), keep (b, t, k), the block's counts per expert (E,).

    The routed rows are put in expert order by `expert_order` (a stable counting sort, the one the
    grouped dispatch of one device uses), which also orders them by destination rank; rank j's chunk of
    the send buffer is slots [j*n, (j+1)*n) for n = b*t*k (every row could go to one rank), filled by a
    gather from that order and zero past the rank's rows. Both moves of a row are gathers by a
    permutation with a gather backward (`permute_rows`): no scatter-add, and only the shapes every
    device's grouped dispatch already compiles with. (A one-hot over the size-2 rank axis, and an
    index_copy into buffers with a trash row, both failed in Inductor's Triton codegen on torch 2.11
    with `nam52`'s dynamic batch: "list indices must be integers or slices, not NoneType".)"""

    def __init__(self, group: dist.ProcessGroup, degree: int, n_experts: int) -> None:
        self.group = group
        self.degree = degree
        self.n_experts = n_experts

    def __call__(self, x: Tensor, expert_idx: Tensor, w_up: Tensor, w_down: Tensor,
                 dtype: torch.dtype | None) -> tuple[Tensor, Tensor, Tensor]:
        from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd

        b, t, k = expert_idx.shape
        d, n_local, degree = x.shape[-1], w_up.shape[0], self.degree
        n = b * t * k
        flat_expert = expert_idx.reshape(-1)
        source, slot, used, counts = send_layout(expert_idx.reshape(b, t * k), self.n_experts, degree)
        work = x.to(dtype) if dtype is not None else x
        rows_in = work.unsqueeze(2).expand(b, t, k, d).reshape(n, d)
        send = torch.where(used.unsqueeze(-1), permute_rows(rows_in, source, slot), 0)
        ids = torch.where(used, flat_expert[source].remainder(n_local), n_local)
        received = all_to_all_single_autograd(send, None, None, self.group)
        received_ids = all_to_all_single(ids, None, None, self.group)
        out = local_expert_rows(received, received_ids, w_up, w_down, dtype)
        back = all_to_all_single_autograd(out, None, None, self.group)
        rows = permute_rows(torch.where(used.unsqueeze(-1), back, 0), slot, source)
        return rows.view(b, t, k, d), torch.ones_like(expert_idx, dtype=torch.bool), counts


@dataclass
class ExpertParallel:
    """The expert-parallel layout of one model: its mesh, the sharded parameters and their names."""
    degree: int
    mesh: object  # DeviceMesh (replicas, experts)
    ctx: DistContext
    params: dict[str, nn.Parameter]  # canonical name -> this rank's expert rows
    first_expert: int  # of this rank's rows in every block

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("experts")

    @property
    def replicas(self) -> int:
        return self.ctx.world_size // self.degree

    def holds(self, p: Tensor) -> bool:
        return any(p is q for q in self.params.values())  # identity: a tensor's == is elementwise

    def describe(self) -> str:
        return (f"expert parallelism {self.degree} x {self.replicas} replica(s): this rank holds experts "
                f"{self.first_expert}..{self.first_expert + self._rows - 1} of each E block")

    @property
    def _rows(self) -> int:
        return next(iter(self.params.values())).shape[0]

    def finish_gradients(self) -> None:
        """The expert gradients as the mean over ranks: the sum over this expert group's tokens is
        already in them (the all-to-all backward); divide by W and add the other replicas' sums."""
        grads = [p.grad for p in self.params.values() if p.grad is not None]
        if not grads:
            return
        if self.replicas > 1:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.mesh.get_group("replicas"))
            torch._foreach_copy_(grads, [piece.view_as(g) for piece, g in zip(flat.split([g.numel() for g in grads]),
                                                                                 grads, strict=True)])
        torch._foreach_mul_(grads, 1.0 / self.ctx.world_size)

    def global_norm(self, grads: Iterable[Tensor]) -> Tensor:
        """The global norm of ``grads``: replicated gradients as they are, expert gradients summed over
        the expert group (each rank holds other experts' rows)."""
        grads = list(grads)
        experts = {id(p.grad) for p in self.params.values() if p.grad is not None}
        mine = [g for g in grads if id(g) in experts]
        others = [g for g in grads if id(g) not in experts]
        device = grads[0].device if grads else self.ctx.device
        squares = torch.zeros(2, device=device)
        if others:  # sharded (fsdp) gradients give the global norm as a replicated DTensor
            squares[0] = full_value(torch.nn.utils.get_total_norm(others, foreach=True)).float().square()
        if mine:
            squares[1] = torch.nn.utils.get_total_norm(mine, foreach=True).float().square()
        dist.all_reduce(squares[1:], group=self.group)
        return squares.sum().sqrt()

    def square_sums(self, squares: Tensor, is_expert: Tensor) -> Tensor:
        """Per-parameter squared norms (this rank's) with the expert rows' summed over the expert group."""
        expert_part = torch.where(is_expert, squares, 0)
        dist.all_reduce(expert_part, group=self.group)
        return torch.where(is_expert, expert_part, squares)

    # ------------------------------------------------------------- checkpoints: one format, whole tensors

    def rows_of(self, total_rows: int) -> tuple[int, int]:
        """[start, stop) of this rank's rows of a whole expert tensor of ``total_rows`` experts."""
        per_rank = total_rows // self.degree
        j = self.ctx.rank % self.degree
        return j * per_rank, (j + 1) * per_rank

    def whole(self, local: Tensor) -> Tensor:
        """The whole tensor (every expert) from each rank's rows, on every rank of the expert group."""
        pieces = [torch.empty_like(local) for _ in range(self.degree)]
        dist.all_gather(pieces, local.contiguous(), group=self.group)
        return torch.cat(pieces)

    def global_view(self, local: Tensor) -> Tensor:
        """``local`` (this rank's expert rows) as a DTensor of the whole tensor, sharing its storage: what a
        distributed checkpoint saves and loads in place, and reshards to any other layout."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        shape = torch.Size((local.shape[0] * self.degree, *local.shape[1:]))
        return DTensor.from_local(local, self.mesh, (Replicate(), Shard(0)), run_check=False, shape=shape,
                                  stride=torch.empty(shape, device="meta").stride())


def expert_blocks(model: nn.Module) -> list[tuple[str, MoE]]:
    """(canonical name, module) of every E block's MoE."""
    return [(canonical_name(name), m) for name, m in model.named_modules() if isinstance(m, MoE)]


def check_expert_parallel(model: nn.Module, cfg: DistConfig, ctx: DistContext) -> None:
    """The settings EP needs, as one line naming the key: P divides the world and every block's experts,
    token-choice routing."""
    degree = cfg.expert_parallel
    if ctx.world_size % degree:
        raise DistError(f"dist.expert_parallel = {degree} does not divide the {ctx.world_size} rank(s) of this job "
                        f"(launch torchrun with a multiple of {degree} processes)")
    blocks = expert_blocks(model)
    if not blocks:
        raise DistError(f"dist.expert_parallel = {degree}, but the model has no E block to split")
    for name, moe in blocks:
        if moe.cfg.n_experts % degree:
            raise DistError(f"dist.expert_parallel = {degree} does not divide {name}'s {moe.cfg.n_experts} experts "
                            "(model.moe.n_experts)")
        if moe.cfg.routing != "token_choice":
            raise DistError(f"dist.expert_parallel needs model.moe.routing = 'token_choice' (got {moe.cfg.routing!r})")


def shard_experts(model: nn.Module, cfg: DistConfig, ctx: DistContext) -> ExpertParallel | None:
    """Keep this rank's experts of every E block and install the exchange; None when
    ``dist.expert_parallel`` is 1. Call on the whole model (identical on every rank), before compile."""
    degree = cfg.expert_parallel
    if degree == 1:
        return None
    check_expert_parallel(model, cfg, ctx)  # one process: P does not divide its 1 rank
    mesh = grid_mesh(ctx, degree, ("replicas", "experts"))
    j = ctx.rank % degree
    params: dict[str, nn.Parameter] = {}
    first = 0
    for name, moe in expert_blocks(model):
        per_rank = moe.cfg.n_experts // degree
        first = j * per_rank
        for attr in EXPERT_PARAMETERS:
            whole = getattr(moe, attr)
            local = nn.Parameter(whole.detach()[first:first + per_rank].clone(), requires_grad=whole.requires_grad)
            setattr(moe, attr, local)
            params[f"{name}.{attr}"] = local
        moe.routed_experts = ExpertExchange(mesh.get_group("experts"), degree, moe.cfg.n_experts)
    return ExpertParallel(degree, mesh, ctx, params, first)
