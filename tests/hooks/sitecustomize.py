"""Test-only crash injection for the auto-fit supervisor's tests (tests/test_oom_autofit.py).

With this directory first on PYTHONPATH and ``MEGACPP_TEST_CRASH_AT_STEP=S`` set, a training process
started by the supervisor raises an ordinary RuntimeError (a stand-in for a bug in megacpp, which
prints a traceback) at the start of step S. Python imports ``sitecustomize`` at startup, so the hook
reaches the child process, which a monkeypatch in the test process could not. The supervisor itself
(no ``MEGACPP_AUTOFIT_ATTEMPT``) is left alone.
"""
import os

if "MEGACPP_TEST_CRASH_AT_STEP" in os.environ and "MEGACPP_AUTOFIT_ATTEMPT" in os.environ:
    from megacpp.train.loop import Trainer

    _crash_step = int(os.environ["MEGACPP_TEST_CRASH_AT_STEP"])
    _train_step = Trainer.train_step

    def _crashing_train_step(self):
        if self.step + 1 == _crash_step:
            raise RuntimeError(f"injected crash in step {_crash_step}")
        return _train_step(self)

    Trainer.train_step = _crashing_train_step
