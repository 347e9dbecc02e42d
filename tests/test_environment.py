"""The environment audit (compiled extensions vs the running torch) and `doctor --freeze/--check`."""
from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import sysconfig

import pytest

from megacpp.cli import main
from megacpp.environment import audit, compare, freeze
from megacpp.versions import torch_version

RUNNING = ".".join(map(str, torch_version().release[:2]))

# A C extension that needs a symbol no library here provides: what a binary built against another
# torch looks like at import ("undefined symbol").
FOREIGN_ABI = """
#include <Python.h>
extern void at_native_symbol_of_another_torch(void);
static PyObject* call(PyObject* self, PyObject* args) { at_native_symbol_of_another_torch(); Py_RETURN_NONE; }
static PyMethodDef methods[] = {{"call", call, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", NULL, -1, methods};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&module); }
"""
CLEAN_ABI = FOREIGN_ABI.replace("at_native_symbol_of_another_torch();", "")


def fake_extension(site, name: str, version: str, requires: str, source: str) -> None:
    """An installed distribution `name` with a compiled module `name._C` built from `source`."""
    package = site / name
    package.mkdir()
    (package / "__init__.py").write_text("from . import _C\n")
    c_file = site / f"{name}.c"
    c_file.write_text(source)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    subprocess.run(["gcc", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", str(c_file),
                    "-o", str(package / f"_C{suffix}")], check=True)
    info = site / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                   f"Requires-Dist: {requires}\n")
    (info / "top_level.txt").write_text(f"{name}\n")
    (info / "RECORD").write_text(f"{name}/__init__.py,,\n{name}/_C{suffix},,\n{info.name}/METADATA,,\n")


def verdicts_for(site) -> dict:
    return {v.package: v for v in audit([str(site)])}


def test_a_package_labelled_for_this_torch_whose_binary_needs_another_is_named_mislabelled(tmp_path):
    fake_extension(tmp_path, "fakeattn", f"2.0+torch{RUNNING}", f"torch=={RUNNING}.0", FOREIGN_ABI)
    verdict = verdicts_for(tmp_path)["fakeattn"]
    assert not verdict.ok
    assert "MISLABELLED" in verdict.verdict and "undefined symbol" in verdict.verdict
    assert f"torch {RUNNING}" in verdict.built_for


def test_a_package_built_for_another_torch_is_named_and_a_matching_one_passes(tmp_path):
    fake_extension(tmp_path, "oldssm", "1.0+cu12torch2.4", "torch==2.4.0", CLEAN_ABI)
    fake_extension(tmp_path, "goodext", f"1.0+torch{RUNNING}", f"torch=={RUNNING}.0", CLEAN_ABI)
    verdicts = verdicts_for(tmp_path)
    assert not verdicts["oldssm"].ok and f"built for torch 2.4, running {RUNNING}" in verdicts["oldssm"].verdict
    assert verdicts["goodext"].ok, verdicts["goodext"].line()


def test_freeze_and_check_round_trip_and_a_planted_difference(tmp_path, capsys):
    record = tmp_path / "env.json"
    assert main(["doctor", "--freeze", str(record)]) == 0
    frozen = json.loads(record.read_text())
    # The running torch's own version, and its distribution's: they differ for PyPI's CUDA wheels
    # (torch.__version__ "2.11.0+cu130", metadata "2.11.0"), and both are recorded.
    assert frozen["torch"] == str(torch_version())
    assert frozen["packages"]["torch"] == importlib.metadata.version("torch")
    assert frozen["python"] == ".".join(map(str, sys.version_info[:3]))
    assert main(["doctor", "--check", str(record)]) == 0
    assert "same environment" in capsys.readouterr().out
    frozen["packages"]["numpy"] = "0.0.1"
    frozen["packages"]["left-on-the-other-host"] = "1.0"
    frozen["torch"] = "2.4.0"
    record.write_text(json.dumps(frozen))
    assert main(["doctor", "--check", str(record)]) == 1
    out = capsys.readouterr().out
    assert "packages: numpy 0.0.1 recorded" in out
    assert "packages: left-on-the-other-host 1.0 is missing here" in out
    assert "torch: '2.4.0' recorded" in out and "3 difference(s)" in out


def test_check_of_a_file_that_is_not_a_record_is_one_line(tmp_path, capsys):
    bad = tmp_path / "env.json"
    bad.write_text("not json")
    assert main(["doctor", "--check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "not an environment record" in err and "Traceback" not in err


def test_compare_lists_every_kind_of_difference():
    a = {"torch": "2.11", "packages": {"x": "1", "y": "2"}, "gpus": ["H200"]}
    b = {"torch": "2.11", "packages": {"x": "1", "z": "3"}, "gpus": ["H100"], "driver": "580"}
    assert compare(a, b) == [
        "driver: None recorded, '580' here", "gpus: ['H200'] recorded, ['H100'] here",
        "packages: y 2 is missing here", "packages: z 3 is installed here only",
    ]
    assert compare(a, a) == []


@pytest.mark.parametrize("key", ["python", "torch", "packages", "megacpp"])
def test_freeze_records(key):
    assert freeze()[key]


def test_doctor_prints_the_audit_section(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "environment audit" in out and "triton" in out and "Inductor autotuning" in out


def test_tier1_freeze_replaces_only_an_earlier_record(tmp_path, capsys):
    """`--freeze FILE` over a file that is not a record (notes, a config) refuses in one line and keeps it;
    over an earlier record it writes the new one."""
    notes = tmp_path / "notes.txt"
    for text in ("notes\n", '{"packages_not": 1}\n', "[1, 2]\n"):
        notes.write_text(text)
        assert main(["doctor", "--freeze", str(notes)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert f"--freeze {notes}: the file exists and is not an environment record" in err
        assert notes.read_text() == text
    record = tmp_path / "env.json"
    record.write_text(json.dumps({"packages": {"old": "1"}}))
    assert main(["doctor", "--freeze", str(record)]) == 0
    assert "old" not in json.loads(record.read_text())["packages"]


def test_tier1_freeze_into_a_directory_or_a_missing_one_names_the_users_path(tmp_path, capsys):
    for path, says in ((tmp_path, "is a directory"), (tmp_path / "nope" / "env.json", "is not an existing directory")):
        assert main(["doctor", "--freeze", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--freeze {path}: " in err and says in err, err
        assert ".tmp-" not in err
    assert list(tmp_path.iterdir()) == []
