"""Shared fixtures."""
import os

# Inductor checks each vector ISA the CPU lists by building and loading a small C++ library, in every
# process whose compile cache is new: ~5 s of CPU each on the 2-core CI machine, where the suite starts
# ~30 such processes. That probe tests the compiler, not megacpp; set before torch reads its config, and
# inherited by the tests' subprocesses.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
# One intra-op thread per test process: the tensors are tiny, CI runs two workers on two cores beside the
# tests' own subprocesses, and OpenMP threads spinning at barriers there took CPU from the other worker (the
# suite on the CI machine 24:18 against 26:20, 42 against 46 user CPU-minutes). torchrun's ranks already
# run with one (tests/torchrun.py); the default-path fixtures were generated with one.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch._dynamo  # noqa: E402

from megacpp.compile.policy import KNOBS  # noqa: E402
from tests.helpers import write_corpus  # noqa: E402


@pytest.fixture
def small_corpus(tmp_path):
    root = tmp_path / "corpus"
    write_corpus(root)
    return root


@pytest.fixture
def isolated_dynamo():
    """Fresh Dynamo caches and the policy knobs restored after the test; one intra-op thread, since the
    compile tests' tensors are tiny and a second thread only adds contention on a busy 2-core CPU."""
    torch._dynamo.reset()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    names = [k.resolve() for k in KNOBS.values()]
    with torch._dynamo.config.patch({n: getattr(torch._dynamo.config, n) for n in names}):
        yield
    torch.set_num_threads(threads)
    torch._dynamo.reset()
