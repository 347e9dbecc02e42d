"""The ranks' meeting on the job store, the one-line collective failures and the activity a waiting rank
reports, in one process: ranks are threads on an in-memory store (the multi-process cases are in
tests/test_dist_rendezvous.py)."""
from __future__ import annotations

import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from megacpp.distributed.failures import describe_failure
from megacpp.distributed.join import RendezvousError, meet, report_interval
from megacpp.distributed.watchdog import activity

WHERE = "10.0.0.1:29500"
TORCHRUN = {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


def meet_in_thread(store, rank: int, world: int, timeout_s: float = 60.0) -> dict:
    """Start `meet` for one rank in a thread; the dict gets its error (None when it met) once done."""
    box: dict = {}

    def run():
        try:
            meet(store, rank, world, WHERE, timeout_s, log=lambda line: None)
            box["error"] = None
        except RendezvousError as exc:
            box["error"] = str(exc)

    box["thread"] = threading.Thread(target=run, daemon=True)
    box["thread"].start()
    return box


def test_ranks_that_agree_meet():
    store = dist.HashStore()
    others = [meet_in_thread(store, rank, 3) for rank in (1, 2)]
    meet(store, 0, 3, WHERE, 60.0, log=lambda line: None)
    for box in others:
        box["thread"].join(timeout=10)
        assert box["error"] is None


def test_a_rank_alone_reports_who_is_missing_and_stops_at_its_timeout():
    lines: list[str] = []
    start = time.monotonic()
    with pytest.raises(RendezvousError) as caught:
        meet(dist.HashStore(), 2, 4, WHERE, 3.0, log=lines.append)
    assert 3.0 <= time.monotonic() - start < 6.0
    assert str(caught.value).startswith(f"rank 2 of 4: only 1 of 4 ranks joined (missing: 0, 1, 3) within "
                                        f"dist.init_timeout_s = 3 s at {WHERE}")
    assert len(lines) >= 2 and all("rank 2 of 4: waiting for the other ranks at 10.0.0.1:29500: 1 of 4 ranks "
                                   "joined (missing: 0, 1, 3) after" in line for line in lines), lines


def test_a_world_size_disagreement_stops_the_rank_already_waiting_too():
    store = dist.HashStore()
    waiting = meet_in_thread(store, 0, 2)
    time.sleep(0.2)
    with pytest.raises(RendezvousError, match=r"^WORLD_SIZE disagrees between ranks at 10\.0\.0\.1:29500: "
                                              r"rank 1 has 3, rank 0 has 2"):
        meet(store, 1, 3, WHERE, 60.0, log=lambda line: None)
    waiting["thread"].join(timeout=10)
    assert waiting["error"].startswith("WORLD_SIZE disagrees"), "the waiting rank stops at once, not at 60 s"


def test_a_rank_launched_twice_stops_both_of_them():
    store = dist.HashStore()
    first = meet_in_thread(store, 1, 3)
    time.sleep(0.2)
    with pytest.raises(RendezvousError, match=r"^RANK=1 was launched twice at 10\.0\.0\.1:29500: give each of "
                                              r"the 3 processes its own RANK \(0\.\.2\)$"):
        meet(store, 1, 3, WHERE, 60.0, log=lambda line: None)
    first["thread"].join(timeout=10)
    assert first["error"].startswith("RANK=1 was launched twice")


def test_report_interval_is_at_most_30_s_and_four_times_within_the_timeout():
    assert report_interval(7200.0) == 30.0
    assert report_interval(8.0) == 2.0
    assert report_interval(1.0) == 1.0  # never busier than the store poll


@pytest.mark.parametrize("message", [
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:38290. "
    "This is typically caused by a remote worker crashing.",
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:30928: Connection reset by peer",
])
def test_a_peers_death_is_one_line_naming_it(message):
    line = describe_failure(RuntimeError(message), TORCHRUN)
    assert line.startswith("rank 0: a peer rank died during a collective (")
    assert "[127.0.0.1]:" in line and "pair.cc" not in line and "\n" not in line
    assert "--resume" in line


def test_a_store_failure_is_one_line_naming_the_store():
    line = describe_failure(dist.DistStoreError("Wait timeout"), TORCHRUN)
    assert line == ("rank 0: the job store at 10.0.0.1:29500 failed (Wait timeout): the rank or torchrun agent "
                    "that hosts it ended or stopped answering")


def test_other_errors_and_single_processes_keep_their_traceback():
    assert describe_failure(RuntimeError("shape mismatch"), TORCHRUN) is None, "a bug keeps its traceback"
    assert describe_failure(RuntimeError("Connection reset by peer"), {"WORLD_SIZE": "1"}) is None


def test_activity_names_the_state_and_the_innermost_code_outside_torch():
    state, code = activity(sys._getframe())
    assert state == "running"
    assert code.startswith("tests/test_dist_join.py:")
    assert code.endswith(" test_activity_names_the_state_and_the_innermost_code_outside_torch")


def fake_stack(*calls: tuple[str, int, str]) -> SimpleNamespace:
    """A frame chain (innermost first) as `activity` walks it."""
    frame = None
    for filename, line, name in reversed(calls):
        frame = SimpleNamespace(f_code=SimpleNamespace(co_filename=filename, co_name=name), f_lineno=line,
                                f_back=frame)
    return frame


TORCH = "/venv/lib/python3.11/site-packages/torch"
LOOP = ("/work/megacpp/megacpp/train/loop.py", 258, "train_step")


@pytest.mark.parametrize("inner, state", [
    ((f"{TORCH}/distributed/distributed_c10d.py", 3252, "all_reduce"), "in a collective"),
    ((f"{TORCH}/_inductor/compile_fx.py", 900, "compile_fx"), "compiling"),
    ((f"{TORCH}/_dynamo/convert_frame.py", 1000, "_compile"), "compiling"),
])
def test_activity_inside_torch_is_named_by_where_megacpp_called_it(inner, state):
    assert activity(fake_stack(inner, LOOP)) == (state, "megacpp/train/loop.py:258 train_step")
