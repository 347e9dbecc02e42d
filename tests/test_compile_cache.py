"""Inductor cache directory choice and warm-cache export/import."""
from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch._functorch.config
import torch._inductor.config
from filelock import FileLock

import megacpp.ops
from megacpp.compile.cache import (
    LOCK,
    MANIFEST,
    OPS_CACHE_KEY,
    CacheBusy,
    CacheError,
    export_cache,
    file_hashes,
    import_cache,
    ops_source_digest,
    setup_inductor_cache,
)


@pytest.fixture(autouse=True)
def restore_env(monkeypatch):
    for key in ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE",
                "MEGACPP_CACHE_DIR"):
        monkeypatch.setenv(key, "")  # records the original state, restored after the test
        monkeypatch.delenv(key)
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield


def _fake_cache(root: Path, salt: str = "") -> Path:
    for rel, text in {"fxgraph/ab/entry": "graph" + salt, "aotautograd/cd/entry": "aot" + salt,
                      "q6/kernel.cpp": "cpp" + salt, "locks/x.lock": "", "triton/0/k.json": "{}" + salt}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_unwritable_root_falls_back_to_a_private_temp_dir_and_says_so(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a regular file: nothing can be created under it, even as root")
    status = setup_inductor_cache(blocker / "cache")
    assert status.source == "fallback"
    assert str(blocker) in status.fallback_reason
    assert status.path.is_dir() and os.access(status.path, os.W_OK)
    assert (status.path.stat().st_mode & 0o777) == 0o700  # process-private
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(status.path)
    assert "WARNING" in status.format() and "private temp dir" in status.format()
    # The next run with the same unusable root compiles into the same directory: none left behind per run.
    assert setup_inductor_cache(blocker / "cache").path == status.path


def test_writable_root_is_used_and_caches_switched_on(tmp_path, monkeypatch):
    status = setup_inductor_cache(tmp_path)
    assert (status.path, status.source, status.fallback_reason) == ((tmp_path / "inductor").resolve(), "argument",
                                                                    None)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(status.path)
    assert os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] == os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] == "1"
    assert torch._inductor.config.fx_graph_cache and torch._functorch.config.enable_autograd_cache
    monkeypatch.setenv("MEGACPP_CACHE_DIR", str(tmp_path / "root"))
    assert setup_inductor_cache().path == (tmp_path / "root" / "inductor").resolve()


def test_tier1_cache_keys_carry_the_custom_ops_source_digest(tmp_path):
    setup_inductor_cache(tmp_path)
    assert torch._inductor.config.unsafe_marked_cacheable_functions[OPS_CACHE_KEY] == ops_source_digest()
    ops = tmp_path / "ops"
    shutil.copytree(Path(megacpp.ops.__file__).parent, ops, ignore=shutil.ignore_patterns("__pycache__"))
    before = ops_source_digest(ops)
    assert len(before) == 16 and before == ops_source_digest()
    (ops / "notes.txt").write_text("not a source file")
    assert ops_source_digest(ops) == before
    with open(ops / "mamba3_fused.py", "a") as f:
        f.write("# one more line\n")
    changed = ops_source_digest(ops)
    (ops / "mamba3_fused.py").rename(ops / "mamba3_fused_v2.py")
    assert len({before, changed, ops_source_digest(ops)}) == 3


def test_export_import_round_trip_and_equal_hash_skips(tmp_path):
    src = _fake_cache(tmp_path / "local")
    first = export_cache(tmp_path / "shared", src)
    assert first.action == "exported" and first.files == 4  # Inductor's locks/ are not exported
    assert json.loads((tmp_path / "shared" / MANIFEST).read_text())["digest"] == first.digest
    again = export_cache(tmp_path / "shared", src)
    assert again.action == "skipped" and again.digest == first.digest

    other_host = tmp_path / "other-host"
    imported = import_cache(tmp_path / "shared", other_host)
    assert imported.action == "imported" and imported.files == 4
    assert file_hashes(other_host) == file_hashes(src) and len(file_hashes(src)) == 4
    assert (other_host / "fxgraph/ab/entry").read_text() == "graph"
    assert import_cache(tmp_path / "shared", other_host).action == "skipped"

    (src / "fxgraph/ab/entry").write_text("recompiled")
    changed = export_cache(tmp_path / "shared", src)
    assert changed.action == "exported" and changed.digest != first.digest
    assert import_cache(tmp_path / "shared", other_host).action == "imported"
    assert (other_host / "fxgraph/ab/entry").read_text() == "recompiled"


def test_unwritable_targets_are_refused(tmp_path):
    src = _fake_cache(tmp_path / "local")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CacheError, match="not writable"):
        export_cache(blocker / "shared", src)
    export_cache(tmp_path / "shared", src)
    with pytest.raises(CacheError, match="not writable"):
        import_cache(tmp_path / "shared", blocker / "cache")
    with pytest.raises(CacheError, match="not a megacpp cache export"):
        import_cache(src, tmp_path / "elsewhere")


def test_a_held_lock_blocks_export(tmp_path):
    src = _fake_cache(tmp_path / "local")
    dest = tmp_path / "shared"
    dest.mkdir()
    with FileLock(str(dest / LOCK)), pytest.raises(CacheBusy, match="held by another process"):
        export_cache(dest, src, lock_timeout=0.2)
    assert not (dest / MANIFEST).exists()


def test_concurrent_exports_leave_a_consistent_export(tmp_path):
    sources = [_fake_cache(tmp_path / f"host{i}", salt=str(i) * 2000) for i in range(4)]
    dest, errors = tmp_path / "shared", []

    def run(src: Path) -> None:
        try:
            for _ in range(5):
                export_cache(dest, src)
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s,)) for s in sources]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    manifest = json.loads((dest / MANIFEST).read_text())
    exported = file_hashes(dest / "inductor")
    assert exported in [file_hashes(s) for s in sources] and manifest["files"] == len(exported)
    assert import_cache(dest, tmp_path / "check").action == "imported"  # the import verifies the manifest


def test_torch_default_in_the_variable_is_not_a_user_choice(monkeypatch, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what importing torch._dynamo writes
    assert setup_inductor_cache().source == "default"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    status = setup_inductor_cache()
    assert (status.source, status.path) == ("TORCHINDUCTOR_CACHE_DIR", (tmp_path / "mine").resolve())


def test_doctor_lines_and_cli_round_trip(monkeypatch, tmp_path):
    from megacpp.compile.cache import describe_cache_dirs
    from megacpp.compile.cli import cache_cli
    from megacpp.compile.config import CompileConfig

    monkeypatch.setenv("MEGACPP_CACHE_DIR", str(tmp_path / "root"))
    lines = describe_cache_dirs(CompileConfig())
    assert lines[0] == f"inductor: {(tmp_path / 'root' / 'inductor').resolve()} (MEGACPP_CACHE_DIR)"
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ  # doctor sets nothing
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert "not writable" in describe_cache_dirs(CompileConfig(cache_dir=str(blocker)))[0]

    _fake_cache(tmp_path / "root" / "inductor")
    assert "cache exported: 4 files" in cache_cli("export", tmp_path / "shared")
    assert "cache skipped" in cache_cli("export", tmp_path / "shared")
    monkeypatch.setenv("MEGACPP_CACHE_DIR", str(tmp_path / "root2"))
    out = cache_cli("import", tmp_path / "shared")
    assert "cache imported: 4 files" in out and str(tmp_path / "root2") in out


def test_an_export_never_replaces_an_inductor_folder_it_did_not_write(tmp_path):
    src = _fake_cache(tmp_path / "local")
    dest = tmp_path / "mine"
    (dest / "inductor").mkdir(parents=True)
    (dest / "inductor" / "notes.txt").write_text("the user's")
    with pytest.raises(CacheError, match="has an inductor/ folder that no megacpp export wrote"):
        export_cache(dest, src)
    assert (dest / "inductor" / "notes.txt").read_text() == "the user's"
    export_cache(tmp_path / "shared", src)
    (src / "fxgraph/ab/entry").write_text("recompiled")
    assert export_cache(tmp_path / "shared", src).action == "exported", "its own earlier export is replaced"


def test_an_export_into_the_live_cache_is_refused_at_once(tmp_path):
    src = _fake_cache(tmp_path / "root" / "inductor")
    for dest in (src, tmp_path / "root", src / "sub"):
        with pytest.raises(CacheError, match="the live cache directory .* is there"):
            export_cache(dest, src, lock_timeout=0.5)
    assert file_hashes(src) == file_hashes(_fake_cache(tmp_path / "fresh"))


def test_an_export_of_another_torch_is_not_imported(tmp_path):
    src = _fake_cache(tmp_path / "local")
    export_cache(tmp_path / "shared", src)
    manifest = tmp_path / "shared" / MANIFEST
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "torch": "2.0.0"}))
    with pytest.raises(CacheError, match="exported by torch 2.0.0; this is torch .* nothing imported"):
        import_cache(tmp_path / "shared", tmp_path / "other-host")
    assert not (tmp_path / "other-host").exists()


def test_the_cache_commands_refuse_an_unusable_root_instead_of_a_temp_dir(monkeypatch, tmp_path):
    from megacpp.compile.cli import cache_cli

    _fake_cache(tmp_path / "good" / "inductor")
    monkeypatch.setenv("MEGACPP_CACHE_DIR", str(tmp_path / "good"))
    cache_cli("export", tmp_path / "shared")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("MEGACPP_CACHE_DIR", str(blocker / "cache"))
    for action, path in (("import", tmp_path / "shared"), ("export", tmp_path / "elsewhere")):
        with pytest.raises(CacheError, match=f"cannot {action} the compile cache: its root is unusable"):
            cache_cli(action, path)


def test_a_run_starts_from_compile_import_cache_once_per_cache(monkeypatch, tmp_path):
    from megacpp.compile.config import CompileConfig
    from megacpp.compile.entry import prepare_compile

    export_cache(tmp_path / "shared", _fake_cache(tmp_path / "built-elsewhere"))
    cfg = CompileConfig(cache_dir=str(tmp_path / "here"), import_cache=str(tmp_path / "shared"))
    first = prepare_compile(cfg)
    assert "cache imported: 4 files" in first.format()
    assert (tmp_path / "here" / "inductor" / "fxgraph/ab/entry").read_text() == "graph"
    assert "cache skipped: 4 files" in prepare_compile(cfg).format(), "the next rank or run finds it current"

