"""The process group of a torchrun job, and the collectives the trainer needs, as one object.

`DistContext` is what the trainer holds: rank, world size, this rank's device and the 1-D
data-parallel mesh (`grid_mesh` lays the ranks out in 2-D for expert parallelism and hsdp). On one
process every collective is a no-op, so training code has no branches on the world size. Under
torchrun (WORLD_SIZE > 1) the group is created from torchrun's environment: `cuda:nccl,cpu:gloo` on
GPUs (NCCL for tensors, gloo for the CPU objects of the parity checks), gloo on CPU, with `device_id`
passed so that NCCL's first barrier does not hang guessing the device.
Nothing here assumes one host: ranks are global, devices come from LOCAL_RANK.
"""
from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store

from megacpp.distributed.config import DistConfig
from megacpp.distributed.join import agent_hosts_store, connect_store, meet, report_interval, restart_namespace
from megacpp.distributed.watchdog import LauncherWatch, WaitReporter
from megacpp.errors import ConfigError
from megacpp.runtime.device import resolve_device
from megacpp.versions import supports

# NCCL's flight recorder: on a collective timeout each rank dumps its last collectives, readable with
# torch's `torchfrtrace`; the dump goes into the run directory. Users' own settings win.
FLIGHT_RECORDER = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_BUFFER_SIZE": "2000"}
Op = Literal["sum", "max", "min"]
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class DistError(ConfigError):
    """A distributed setting or environment that cannot work (one line, every rank)."""


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    mesh: Any = None  # DeviceMesh of the data-parallel dimension; None on one process
    backend: str = ""
    host: str = field(default_factory=platform.node)
    launcher_watch: LauncherWatch | None = None  # stops this rank when torchrun's agent is gone
    wait_reporter: WaitReporter | None = None  # says what a rank blocked in a collective waits for

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------ collectives (no-ops on one process)

    def all_reduce_(self, tensor: torch.Tensor, op: Op = "sum") -> torch.Tensor:
        """Reduce `tensor` in place over ranks (gloo needs CPU tensors; NCCL device tensors)."""
        if self.distributed:
            dist.all_reduce(tensor, op=_OPS[op])
        return tensor

    def all_gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (picklable), in rank order."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`src`'s values into `tensor` on every rank, in place."""
        if self.distributed:
            dist.broadcast(tensor, src=src)
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def set_timeout(self, seconds: float) -> bool:
        """Set the process-group timeout for later collectives; False when this torch cannot."""
        if not self.distributed or not supports("pg_timeout"):
            return False
        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(timedelta(seconds=seconds), None)
        return True

    def close(self, orderly: bool = False) -> None:
        """Destroy the process group (every exit path: a live group keeps peers waiting).

        ``orderly`` (every rank got here the same way, e.g. at the end of a run): first wait for all
        ranks, so no rank tears its group down while a peer's last collective is still in flight, and
        afterwards until every rank has torn it down (gloo otherwise aborts a peer at exit: 'terminate
        called without an active exception'). Never after a failure: a peer may be stuck elsewhere, and
        the barrier would hang.
        """
        for helper in (self.launcher_watch, self.wait_reporter):
            if helper is not None:
                helper.close()
        if self.distributed and dist.is_initialized():
            store = dist.distributed_c10d._get_default_store() if orderly else None
            if orderly:
                dist.barrier()
            dist.destroy_process_group()
            if store is not None:
                # gloo's barrier followed by teardown is racy (pytorch/gloo#155): a rank that leaves first
                # closes its sockets while a peer is still tearing its pairs down, and the peer aborted
                # ('terminate called without an active exception', ~1 in 8 two-rank CPU runs). Every rank
                # waits here, on the job's store rather than gloo, until all have destroyed their group.
                _store_barrier(store, "megacpp/closed", self.rank, self.world_size)

    def describe(self) -> str:
        if not self.distributed:
            return f"single process on {self.device}"
        return (f"rank {self.rank} of {self.world_size} (local rank {self.local_rank} on {self.host}), "
                f"{self.device}, backend {self.backend}")


def _store_barrier(store: Store, key: str, rank: int, world_size: int, timeout_s: float = 60.0) -> None:
    """Wait until every rank has set `key`/<rank> on the store; a peer that never does (it died) only
    costs the timeout: an orderly exit never hangs on it."""
    try:  # the store's host (torchrun's agent) may be gone too
        store.set(f"{key}/{rank}", "1")
        store.wait([f"{key}/{r}" for r in range(world_size)], timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistStoreError):
        pass


def grid_mesh(ctx: DistContext, inner: int, names: tuple[str, str]) -> Any:
    """The job's ranks as a 2-D DeviceMesh of shape (W / inner, inner), dimensions named ``names``: rank r
    sits at (r // inner, r % inner), so a group of the inner dimension is ``inner`` consecutive ranks (one
    host's GPUs under torchrun, where its collectives run over NVLink). Every rank must call it."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(ctx.device.type, (ctx.world_size // inner, inner), mesh_dim_names=names)


def local_world_size(environ: Mapping[str, str] | None = None) -> int:
    """The processes torchrun started on this host (LOCAL_WORLD_SIZE); 1 outside torchrun."""
    env = os.environ if environ is None else environ
    return int(env.get("LOCAL_WORLD_SIZE", "1"))


def torchrun_world(environ: Mapping[str, str] | None = None) -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's variables; (0, 1, 0) outside torchrun."""
    env = os.environ if environ is None else environ
    world = int(env.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, 0
    missing = [k for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise DistError(f"WORLD_SIZE={world} but {', '.join(missing)} unset: launch with torchrun "
                        "(e.g. torchrun --nproc_per_node=8 -m megacpp.cli train ...)")
    return int(env["RANK"]), world, int(env["LOCAL_RANK"])


def rank_device(name: str, local_rank: int, world: int) -> torch.device:
    """This rank's device: ``auto``/``cuda`` mean cuda:LOCAL_RANK under torchrun."""
    if world == 1:
        return resolve_device(name)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if device.index not in (None, local_rank):
            raise DistError(f"train.device = {name!r} under torchrun: each rank uses cuda:LOCAL_RANK "
                            f"(this rank: cuda:{local_rank}); set train.device to auto or cuda")
        if not torch.cuda.is_available() or local_rank >= torch.cuda.device_count():
            raise DistError(f"local rank {local_rank} needs a GPU but torch sees "
                            f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}; use "
                            "--nproc_per_node at most the GPU count, or train.device = cpu")
        return torch.device("cuda", local_rank)
    return device


def init_distributed(device_name: str, cfg: DistConfig, run_dir: str | Path | None = None,
                     store: Store | None = None, eager_nccl: bool = True) -> DistContext:
    """Create the process group of this torchrun job (nothing outside torchrun) and return the context.

    Call after `megacpp.compile.prepare_compile` (it sets NCCL's heartbeat for long compiles) and
    before anything else touches the GPU. ``store``: rendezvous on this store instead of torchrun's
    environment (an auto-fit attempt's own namespace, megacpp.train.autofit.rendezvous). ``eager_nccl``
    False creates the NCCL communicators at the first collective instead of here (an auto-fit retry).
    The ranks first meet on the job store (megacpp.distributed.join: they say what they wait for and stop
    on a launch mistake); a rank blocked in a collective says for whom, and under torchrun each rank
    stops, saving, when its launcher is gone.
    """
    rank, world, local_rank = torchrun_world()
    device = rank_device(device_name, local_rank, world)
    if world == 1:
        return DistContext(device=device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    for key, value in FLIGHT_RECORDER.items():
        os.environ.setdefault(key, value)
    if run_dir is not None:
        os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(Path(run_dir).resolve() / "logs" / "nccl_trace_rank_"))
    backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
    # device_id binds the group to the GPU and forms the NCCL communicators now (eager); without it
    # NCCL forms them at the first collective, on the device set above.
    device_id = device if device.type == "cuda" and eager_nccl else None
    timeout = timedelta(seconds=cfg.init_timeout_s)
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    launcher = "torchrun's agent" if store is None else "the auto-fit supervisor"  # this process's parent
    if store is None:  # the job store torch's env:// would make, but without its silent wait for the workers
        agent = agent_hosts_store()
        store = connect_store(addr, port, rank, world, cfg.init_timeout_s, host=rank == 0 and not agent,
                              hosted_by="torchrun's agent" if agent else "rank 0")
        store = PrefixStore("default_pg", store)  # torch's own namespace for the default group's keys
    meet(store, rank, world, f"{addr}:{port}", cfg.init_timeout_s, restart_namespace())
    dist.init_process_group(backend=backend, timeout=timeout, device_id=device_id, store=store, rank=rank,
                            world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    # under torchrun only: a rank launched by hand has a shell for its parent, which may leave on purpose
    watch = LauncherWatch(rank, launcher) if "TORCHELASTIC_RUN_ID" in os.environ else None
    reporter = WaitReporter(store, rank, world, report_interval(cfg.init_timeout_s))
    return DistContext(rank, world, local_rank, device, mesh, backend, launcher_watch=watch, wait_reporter=reporter)
