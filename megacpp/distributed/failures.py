"""One line for the collective and store failures a rank cannot prevent: a peer that died, a lost store.

When a peer rank dies (killed, out of memory, its host gone) the survivors' next collective raises a
RuntimeError from gloo or NCCL ("Connection closed by peer [10.0.0.2]:41234"), and a job store that went
away raises torch's DistStoreError or DistNetworkError. These are not megacpp bugs: the CLI prints them
as one line naming what happened, and the full traceback stays in the rank's log (<run>/logs/rank<R>.log).
This module imports no torch: the CLI consults it for any RuntimeError.
"""
from __future__ import annotations

import os

# What gloo and NCCL say when the other end of a connection is gone (torch 2.x): the peer process ended.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "remote process exited",
             "Socket closed", "Broken pipe")
STORE_ERRORS = ("DistStoreError", "DistNetworkError")  # torch.distributed's classes, matched by name


def describe_failure(exc: BaseException, environ: dict[str, str] | None = None) -> str | None:
    """The one line for `exc` when it is a peer's death or a store failure of a multi-process job; None for
    anything else (a bug: its traceback is kept)."""
    env = dict(os.environ if environ is None else environ)
    if int(env.get("WORLD_SIZE", "1")) <= 1 or not isinstance(exc, RuntimeError):
        return None
    me = f"rank {env.get('RANK', '?')}"
    text = str(exc)
    detail = _detail(text)
    if any(pattern in text for pattern in PEER_LOST):
        return (f"{me}: a peer rank died during a collective ({detail}): the job cannot go on; torchrun's "
                "summary names the rank that failed first and its log (<out_dir>/logs/rank<R>.log) says why; "
                "continue with the same command plus --resume")
    if any(cls.__name__ in STORE_ERRORS for cls in type(exc).__mro__):
        where = f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"
        return (f"{me}: the job store at {where} failed ({detail}): the rank or torchrun agent that hosts it "
                "ended or stopped answering")
    return None


def _detail(text: str) -> str:
    """gloo's message without its source location and advice: 'Connection closed by peer [10.0.0.2]:41234'."""
    line = text.strip().splitlines()[0] if text.strip() else "no message"
    if line.startswith("[") and "] " in line:  # "[.../gloo/transport/tcp/pair.cc:553] Connection closed ..."
        line = line.split("] ", 1)[1]
    return line.split(". ", 1)[0].rstrip(".")
