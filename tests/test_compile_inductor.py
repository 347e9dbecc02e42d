"""Inductor on CPU: the stand-in compiles with zero breaks in model and blocks modes, and a warm cache
exported from one process is used by another (slow: Inductor compiles C++ on CPU)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch._dynamo

from megacpp.compile.cache import export_cache
from megacpp.compile.config import CompileConfig
from megacpp.compile.health import CompileHealth, bounds_for, forbid_recompiles
from megacpp.compile.policy import KNOBS
from megacpp.compile.regions import compile_model
from megacpp.compile.report import random_token_batch
from tests.compile_fixtures.standin import build_standin

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def fresh_dynamo(tmp_path, monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    names = [k.resolve() for k in KNOBS.values()]
    with torch._dynamo.config.patch({n: getattr(torch._dynamo.config, n) for n in names}):
        yield
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["model", "blocks"])
def test_standin_compiles_with_inductor_without_breaks_or_recompiles(mode):
    cfg = CompileConfig(mode=mode, backend="inductor")
    torch.manual_seed(0)
    model = build_standin("AMERF")
    with CompileHealth(bounds_for(cfg)) as health:
        health.attach(compile_model(model, cfg))
        model(**random_token_batch(64, 4, 16)).backward()
        health.end_warmup()
        with forbid_recompiles():
            model(**random_token_batch(64, 3, 16)).backward()
        assert health.break_sites(upstream=None) == {}
        assert health.check_bounds(strict=True) == []
        assert health.totals().graphs >= 1


_CHILD = textwrap.dedent(
    """
    import json, os, sys, torch
    from megacpp.compile.cache import import_cache, setup_inductor_cache
    from megacpp.compile.config import CompileConfig
    from megacpp.compile.regions import compile_model
    from megacpp.compile.report import random_token_batch
    from tests.compile_fixtures.standin import build_standin
    status = setup_inductor_cache(sys.argv[1])
    result = import_cache(sys.argv[2]) if len(sys.argv) > 2 else None
    torch.manual_seed(0)
    model = build_standin(os.environ.get("STANDIN", "F"))
    compile_model(model, CompileConfig(mode="model", backend="inductor"))
    model(**random_token_batch(64, 4, 16)).backward()
    counters = torch._dynamo.utils.counters
    print(json.dumps({"hits": counters["inductor"]["fxgraph_cache_hit"],
                      "aot_hits": counters["aot_autograd"]["autograd_cache_hit"],
                      "imported": result.action if result else None,
                      "megacpp": __import__("megacpp").__file__}))
    """
)


REPO = Path(__file__).resolve().parent.parent


def _child(*args: str, package_root: Path = REPO, standin: str = "F") -> dict:
    """Run _CHILD with megacpp imported from package_root (the tests from this checkout), from a neutral
    working directory (`python -c` puts it first on sys.path)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", STANDIN=standin,
               PYTHONPATH=os.pathsep.join(dict.fromkeys((str(package_root), str(REPO)))))
    env.pop("TORCHINDUCTOR_CACHE_DIR")
    out = subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True, env=env, check=True,
                         timeout=600, cwd=Path(args[0]).parent)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_exported_cache_warms_another_process(tmp_path):
    cold = _child(str(tmp_path / "host-a"))
    assert cold["hits"] == 0
    exported = export_cache(tmp_path / "shared", tmp_path / "host-a" / "inductor")
    assert exported.action == "exported" and exported.files > 0
    warm = _child(str(tmp_path / "host-b"), str(tmp_path / "shared"))
    assert warm["imported"] == "imported"
    assert warm["hits"] >= 1 and warm["aot_hits"] >= 1


def test_tier2_changed_custom_op_source_misses_the_warm_cache(tmp_path):
    """An upgrade that changes megacpp/ops (here: one byte appended to a copy of the package) must not
    get graphs compiled for the old ops from a warm cache: the R block's custom ops are in the graph."""
    cache = str(tmp_path / "cache")
    cold = _child(cache, standin="R")
    warm = _child(cache, standin="R")
    assert cold["aot_hits"] == 0 and warm["aot_hits"] >= 1 and warm["hits"] >= 1
    upgraded = tmp_path / "upgraded"
    shutil.copytree(REPO / "megacpp", upgraded / "megacpp", ignore=shutil.ignore_patterns("__pycache__"))
    with open(upgraded / "megacpp" / "ops" / "m2rnn_scan.py", "a") as f:
        f.write("\n# changed\n")
    after = _child(cache, package_root=upgraded, standin="R")
    assert after["megacpp"] == str(upgraded / "megacpp" / "__init__.py")
    assert after["aot_hits"] == 0 and after["hits"] == 0, (cold, warm, after)
