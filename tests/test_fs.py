"""Atomic writes (megacpp.fs): a failure at any point leaves the old content and no temporary behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from contextlib import nullcontext
from pathlib import Path

import pytest

from megacpp import fs
from megacpp.fs import (
    atomic_dir,
    atomic_path,
    atomic_write_bytes,
    atomic_write_text,
    is_temporary,
    remove_stale_temporaries,
    scratch_dir,
)

REPO = Path(__file__).resolve().parent.parent


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_write_replaces_the_content_and_leaves_only_the_file(tmp_path):
    target = tmp_path / "meta.json"
    target.write_bytes(b"old")
    atomic_write_bytes(target, b"new content")
    assert target.read_bytes() == b"new content"
    atomic_write_text(target, "caf\u00e9\n", fsync=True)
    assert target.read_bytes() == "caf\u00e9\n".encode()
    assert listing(tmp_path) == ["meta.json"]


def test_a_failure_mid_write_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    target = tmp_path / "train.bin"
    target.write_bytes(b"the old shard")
    with pytest.raises(RuntimeError, match="disk gone"), atomic_path(target) as tmp:
        assert tmp.parent == tmp_path and is_temporary(tmp.name)
        tmp.write_bytes(b"half of the ne")
        raise RuntimeError("disk gone")
    assert target.read_bytes() == b"the old shard"
    assert listing(tmp_path) == ["train.bin"]


def test_an_interrupt_mid_write_also_cleans_up(tmp_path):
    target = tmp_path / "tokenizer.json"
    target.write_text("{}")
    with pytest.raises(KeyboardInterrupt), atomic_path(target) as tmp:
        tmp.write_text('{"half": ')
        raise KeyboardInterrupt
    assert target.read_text() == "{}" and listing(tmp_path) == ["tokenizer.json"]


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_a_failing_fsync_or_rename_keeps_the_old_file(tmp_path, monkeypatch, failing):
    target = tmp_path / "manifest.json"
    target.write_text("old")

    def refuse(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fs.os, failing, refuse)
    with pytest.raises(OSError, match="No space left"):
        atomic_write_text(target, "new", fsync=True)
    monkeypatch.undo()
    assert target.read_text() == "old" and listing(tmp_path) == ["manifest.json"]


def test_a_write_into_a_missing_directory_fails_without_creating_anything(tmp_path):
    with pytest.raises(FileNotFoundError):
        atomic_write_bytes(tmp_path / "absent" / "file", b"x")
    assert listing(tmp_path) == []


def test_a_killed_writer_leaves_the_old_file_and_a_temporary_that_the_sweep_removes(tmp_path):
    target = tmp_path / "val.bin"
    target.write_bytes(b"intact")
    child = textwrap.dedent(f"""
        import sys, time
        from megacpp.fs import atomic_path
        with atomic_path({str(target)!r}) as tmp:
            with open(tmp, "wb") as f:
                f.write(b"partial")
                f.flush()
                print("writing", flush=True)
                time.sleep(60)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert target.read_bytes() == b"intact"
    leftovers = [name for name in listing(tmp_path) if name != "val.bin"]
    assert len(leftovers) == 1 and is_temporary(leftovers[0])
    assert remove_stale_temporaries(tmp_path) == 1
    assert listing(tmp_path) == ["val.bin"]


def test_the_sweep_removes_temporaries_of_either_naming_and_nothing_else(tmp_path):
    (tmp_path / "train.bin").write_bytes(b"keep")
    (tmp_path / "train.bin.tmp-999").write_bytes(b"older writer's leftover")
    (tmp_path / ".manifest.json.tmp-12-ab12cd34").write_text("leftover")
    (tmp_path / ".inductor.tmp-7-00ff00ff").mkdir()
    (tmp_path / ".inductor.tmp-7-00ff00ff" / "entry").write_text("staged")
    assert remove_stale_temporaries(tmp_path) == 3
    assert listing(tmp_path) == ["train.bin"]


def test_atomic_dir_replaces_the_whole_directory_on_success(tmp_path):
    target = tmp_path / "inductor"
    target.mkdir()
    (target / "stale").write_text("from the previous export")
    with atomic_dir(target) as staging:
        assert staging.parent == tmp_path and list(staging.iterdir()) == []
        (staging / "fresh").write_text("new")
    assert listing(target) == ["fresh"] and listing(tmp_path) == ["inductor"]


def test_atomic_dir_failure_leaves_the_old_directory_and_no_staging(tmp_path):
    target = tmp_path / "inductor"
    target.mkdir()
    (target / "entry").write_text("old")
    with pytest.raises(OSError), atomic_dir(target) as staging:
        (staging / "entry").write_text("half")
        raise OSError(28, "No space left on device")
    assert (target / "entry").read_text() == "old" and listing(tmp_path) == ["inductor"]


@pytest.mark.parametrize("fail", [False, True])
def test_scratch_dir_is_removed_whatever_happens(tmp_path, fail):
    seen = []
    with pytest.raises(RuntimeError) if fail else nullcontext(), scratch_dir(tmp_path, "import") as staging:
        seen.append(staging)
        assert staging.parent == tmp_path and is_temporary(staging.name)
        (staging / "file").write_text("x")
        if fail:
            raise RuntimeError("copy failed")
    assert seen and not seen[0].exists() and listing(tmp_path) == []
