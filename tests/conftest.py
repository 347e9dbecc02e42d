"""Shared fixtures."""
import pytest

from tests.helpers import write_corpus


@pytest.fixture
def small_corpus(tmp_path):
    root = tmp_path / "corpus"
    write_corpus(root)
    return root
