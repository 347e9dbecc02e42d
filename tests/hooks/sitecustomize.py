"""Test-only fault injection for the auto-fit supervisor's tests (tests/test_oom_autofit.py) and the
run's edges (tests/test_run_edges.py).

Python imports ``sitecustomize`` at startup, so with this directory first on PYTHONPATH the hooks reach
the supervisor's child processes and torchrun's workers, which a monkeypatch in the test process could
not. Nothing in megacpp knows of them.

- ``MEGACPP_TEST_OOM_ABOVE=M`` (every rank) or ``M:R`` (rank R only): a training step at a micro-batch
  above M raises ``torch.OutOfMemoryError``, as a GPU too small for it would; and `megacpp train` runs
  under the supervisor on CPU too, where auto-fit is otherwise off.
- ``MEGACPP_TEST_CRASH_AT_STEP=S``: a training process started by the supervisor raises an ordinary
  RuntimeError (a stand-in for a bug in megacpp, which prints a traceback) at the start of step S.
- ``MEGACPP_TEST_HOST_OOM_AT_STEP=S``: any training process asks the host allocator for 1 PiB at the
  start of step S, which fails with torch's own out-of-memory RuntimeError.
- ``MEGACPP_TEST_DISK_FULL_IN_MOMENTS=1``: writing the optimizer moments of a checkpoint fails as a full
  disk does (OSError ENOSPC from the distributed checkpoint's file writer).
"""
import os

_OOM = os.environ.get("MEGACPP_TEST_OOM_ABOVE")
_CHILD = "MEGACPP_AUTOFIT_ATTEMPT" in os.environ

if _OOM is not None and not _CHILD:
    from megacpp.train.autofit import supervisor

    supervisor.trains_on_cuda = lambda _device: True

if _CHILD and (_OOM is not None or "MEGACPP_TEST_CRASH_AT_STEP" in os.environ):
    import torch

    from megacpp.train.loop import Trainer

    _train_step = Trainer.train_step
    _crash_step = int(os.environ.get("MEGACPP_TEST_CRASH_AT_STEP", "0"))
    _above, _, _only_rank = (_OOM or "").partition(":")

    def _faulty_train_step(self):
        micro = self.batch.micro_batch
        if _OOM is not None and micro > int(_above) and (not _only_rank or int(_only_rank) == self.ctx.rank):
            raise torch.OutOfMemoryError(f"MEGACPP_TEST_OOM_ABOVE: injected at micro-batch {micro}")
        if self.step + 1 == _crash_step:
            raise RuntimeError(f"injected crash in step {_crash_step}")
        return _train_step(self)

    Trainer.train_step = _faulty_train_step

_HOST_OOM_STEP = os.environ.get("MEGACPP_TEST_HOST_OOM_AT_STEP")

if _HOST_OOM_STEP is not None:
    import torch

    from megacpp.train.loop import Trainer

    _step_before_host_oom = Trainer.train_step

    def _host_oom_train_step(self):
        if self.step + 1 == int(_HOST_OOM_STEP):
            torch.empty(2**50, dtype=torch.uint8)  # beyond any host's address space: the allocator refuses
        return _step_before_host_oom(self)

    Trainer.train_step = _host_oom_train_step

if os.environ.get("MEGACPP_TEST_DISK_FULL_IN_MOMENTS"):
    import errno

    import torch.distributed.checkpoint.filesystem as _dcp_files

    def _disk_full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "optim/__0_0.distcp")

    _dcp_files._write_item = _disk_full

