"""Meeting the job's other ranks before the process group forms: never silently, never past the timeout.

torch's process-group setup waits for its peers inside the store and gloo with no output, for the whole
init timeout (2 h by default), also when no peer can ever come: a rank launched alone, or ranks given
different WORLD_SIZEs. Here each rank first reaches the job's store (hosted by torchrun's agent, or by
rank 0 outside torchrun), announces itself there (its RANK, its WORLD_SIZE) and waits for the others,
printing what it waits for at a modest interval. A disagreement (another WORLD_SIZE, a RANK launched
twice) stops every rank that has joined at once, with one line, and the wait ends at `dist.init_timeout_s`.
"""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta

from torch.distributed import DistStoreError, Store, TCPStore

from megacpp.errors import MegacppError

REPORT_EVERY_S = 30.0  # the longest silence while waiting; shorter when the timeout itself is short
POLL_S = 1.0  # how often a waiting rank looks for a failure another rank recorded
SHOWN_MISSING = 8  # ranks named in a "missing" list; a large job's list is cut after these

Log = Callable[[str], None]


class RendezvousError(MegacppError):
    """The ranks of a job cannot meet (a launch mistake or a peer that never came); one line, exit 1."""


def agent_hosts_store(environ: dict[str, str] | None = None) -> bool:
    """Whether torchrun's agent hosts the job store (it does for the static and c10d rendezvous)."""
    env = os.environ if environ is None else environ
    return env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _stderr(line: str) -> None:
    print(f"megacpp: {line}", file=sys.stderr, flush=True)


def report_interval(timeout_s: float) -> float:
    """At most `REPORT_EVERY_S` between reports, and at least four reports within the timeout."""
    return max(POLL_S, min(REPORT_EVERY_S, timeout_s / 4))


def connect_store(addr: str, port: int, rank: int, world_size: int, timeout_s: float, host: bool, hosted_by: str,
                  log: Log = _stderr) -> TCPStore:
    """The job store at addr:port: started here when `host`, else reached as a client that reports while the
    store is not reachable yet and gives up at `timeout_s`. `hosted_by` names the host in those reports."""
    where = f"{addr}:{port}"
    timeout = timedelta(seconds=timeout_s)
    if host:
        try:  # wait_for_workers=False: the peers are awaited (and reported) in `meet`, not silently here
            return TCPStore(addr, port, is_master=True, timeout=timeout, wait_for_workers=False, multi_tenant=True)
        except RuntimeError as exc:
            raise RendezvousError(f"rank 0 cannot host the job store at {where} ({_first_line(exc)}): another "
                                  "process already holds MASTER_PORT (a second process launched as RANK=0, or "
                                  "another job); give this job a free MASTER_PORT") from None
    start = time.monotonic()
    interval = report_interval(timeout_s)
    while True:
        left = timeout_s - (time.monotonic() - start)
        try:
            store = TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=max(0.1, min(interval, left))))
        except RuntimeError:
            waited = time.monotonic() - start
            if waited >= timeout_s:
                raise RendezvousError(
                    f"rank {rank} of {world_size}: the job store at {where} (hosted by {hosted_by}) was not "
                    f"reachable within dist.init_timeout_s = {timeout_s:g} s: start {hosted_by} too, with the same "
                    "MASTER_ADDR and MASTER_PORT, or check that this host can reach that address") from None
            log(f"rank {rank} of {world_size}: waiting for the job store at {where} (hosted by {hosted_by}): "
                f"not reachable for {waited:.0f} s")
            continue
        store.set_timeout(timeout)
        return store


def meet(store: Store, rank: int, world_size: int, where: str, timeout_s: float, namespace: str = "",
         log: Log = _stderr) -> None:
    """Announce this rank on `store` and return once all `world_size` ranks have; `namespace` keeps the keys
    of a restarted job (torchrun's restart count) apart from its predecessor's."""
    prefix = f"megacpp/join/{namespace}"
    failed, joined, done = f"{prefix}/failed", f"{prefix}/count", f"{prefix}/all"
    me = f"rank {rank} of {world_size}"

    def stop(message: str) -> RendezvousError:
        """This process stops on ``message``: it says so on the store, then waits (a few polls at most) until
        every process that announced itself has, so that the one hosting the store does not take it away
        from a peer that has not read the failure yet (that peer said "lost the job store" instead)."""
        try:
            seen = store.add(f"{prefix}/stopped", 1)
            announced = sum(store.add(f"{prefix}/rank{r}", 0) for r in range(world_size))
            deadline = time.monotonic() + 3 * POLL_S
            while seen < announced and time.monotonic() < deadline:
                time.sleep(0.1)
                seen = store.add(f"{prefix}/stopped", 0)
        except RuntimeError:  # the store is gone already: nobody is left to wait for
            pass
        return RendezvousError(message)

    def fail(message: str) -> RendezvousError:
        """Record the first failure for every rank that joined (they stop on it too) and stop on it."""
        store.compare_set(failed, "", message)
        return stop(message)

    if store.add(f"{prefix}/rank{rank}", 1) > 1:
        raise fail(f"RANK={rank} was launched twice at {where}: give each of the {world_size} processes its own "
                   f"RANK (0..{world_size - 1})")
    # the first rank to get here records its WORLD_SIZE; every later one compares its own with it
    theirs, _, first = store.compare_set(f"{prefix}/world_size", "", f"{world_size}@{rank}").decode().partition("@")
    if int(theirs) != world_size:
        raise fail(f"WORLD_SIZE disagrees between ranks at {where}: rank {rank} has {world_size}, rank {first} has "
                   f"{theirs}: start every process of the job with the same WORLD_SIZE (torchrun: the same "
                   "--nnodes and --nproc-per-node on every host)")
    if store.add(joined, 1) >= world_size:
        store.set(done, "1")
    start = last_report = time.monotonic()
    interval = report_interval(timeout_s)
    while True:
        try:
            store.wait([done], timedelta(seconds=POLL_S))
        except DistStoreError:  # its timeout: not all ranks joined yet
            pass
        except RuntimeError as exc:  # DistNetworkError and the like: the store is gone
            raise RendezvousError(f"{me}: lost the job store at {where} while waiting for the other ranks "
                                  f"({_first_line(exc)}): the rank or agent that hosts it ended") from None
        else:
            if not store.check([failed]):
                return
        if store.check([failed]):
            raise stop(store.get(failed).decode())
        now = time.monotonic()
        if now - start >= timeout_s:
            raise fail(f"{me}: only {_joined_line(store, prefix, joined, world_size)} within dist.init_timeout_s = "
                       f"{timeout_s:g} s at {where}: start the missing ranks with the same MASTER_ADDR, "
                       "MASTER_PORT and WORLD_SIZE (torchrun: every host's --nnodes, --node-rank, --rdzv-endpoint)")
        if now - last_report >= interval:
            last_report = now
            log(f"{me}: waiting for the other ranks at {where}: {_joined_line(store, prefix, joined, world_size)} "
                f"after {now - start:.0f} s (dist.init_timeout_s = {timeout_s:g} s)")


def _joined_line(store: Store, prefix: str, joined: str, world_size: int) -> str:
    """'1 of 2 ranks joined (missing: 1)'."""
    count = store.add(joined, 0)
    missing = [r for r in range(world_size) if not store.check([f"{prefix}/rank{r}"])]
    shown = ", ".join(str(r) for r in missing[:SHOWN_MISSING]) + (", ..." if len(missing) > SHOWN_MISSING else "")
    return f"{count} of {world_size} ranks joined" + (f" (missing: {shown})" if missing else "")


def restart_namespace() -> str:
    """torchrun's restart count: the keys of each restart of the workers are their own."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
