"""The torchrun job's key-value store, shared by the auto-fit supervisors and their training processes.

Under the auto-fit supervisor (megacpp.train.autofit.supervisor) each rank's training runs in a child process
that may be started several times within one torchrun job. Two things then go through the job's TCP
store, the one torchrun's agent hosts at MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True;
otherwise rank 0's supervisor hosts it, so it outlives every attempt):

- the process group of attempt N is created on a ``PrefixStore`` of its own, so the keys of a dead
  attempt (peers' addresses, group counters) are never read by the next one: no stale process-group
  state, the "connectFullMesh ... Connection refused" of a retry that reuses the old keys;
- the decision to retry: the rank that runs out of memory sets `oom_key` (its report, as JSON) before
  it exits, and every supervisor polls that key, so all ranks retry together even when a peer is
  blocked inside a collective that will never complete.
"""
from __future__ import annotations

import os

from torch.distributed import PrefixStore, Store, TCPStore

from megacpp.distributed.join import agent_hosts_store, connect_store

CLAIM_KEY = "megacpp/run_dir_claim"  # rank 0's supervisor: "" (claimed) or its one-line refusal


def job_store(timeout_s: float, host: bool = False) -> TCPStore:
    """A connection to the job store at MASTER_ADDR:MASTER_PORT; ``host`` starts it instead (rank 0's
    supervisor, when no torchrun agent hosts one). A client says what it waits for while the store is not
    reachable yet (megacpp.distributed.join)."""
    return connect_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["RANK"]),
                         int(os.environ["WORLD_SIZE"]), timeout_s, host,
                         "torchrun's agent" if agent_hosts_store() else "rank 0's supervisor")


def attempt_store(store: Store, attempt: int) -> PrefixStore:
    """The keys of attempt `attempt`'s process group: a namespace no other attempt writes."""
    return PrefixStore(f"megacpp/attempt{attempt}/pg", store)


def oom_key(attempt: int) -> str:
    """Set (to a JSON report) by the first rank of attempt `attempt` that ran out of memory in warmup."""
    return f"megacpp/attempt{attempt}/oom"
