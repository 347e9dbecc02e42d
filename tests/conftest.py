"""Shared fixtures."""
import pytest
import torch
import torch._dynamo

from megacpp.compile.policy import KNOBS
from tests.helpers import write_corpus


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
