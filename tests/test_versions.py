"""Version parsing and the version-gate table."""
from __future__ import annotations

import pytest

from megacpp import versions
from megacpp.versions import GATES, parse_version, public_version, supports


def test_minor_versions_compare_numerically_not_as_strings():
    assert "2.9" > "2.12"  # the trap
    assert parse_version("2.9") < parse_version("2.12") < parse_version("2.13")
    assert parse_version("2.9.1") < parse_version("2.10.0")
    assert parse_version("10.0") > parse_version("9.99")


@pytest.mark.parametrize(
    "older, newer",
    [
        ("2.12.0.dev20260304+cu130", "2.12.0a0"),
        ("2.12.0a0", "2.12.0b1"),
        ("2.12.0b1", "2.12.0rc1"),
        ("2.12.0rc1", "2.12.0rc2"),
        ("2.12.0rc2", "2.12.0"),
        ("2.12.0", "2.12.0.post1"),
        ("2.12.0.dev20260304", "2.12.0.dev20260305"),
        ("2.11.0+cu130", "2.12.0.dev20260304+cu130"),
    ],
)
def test_pre_release_and_dev_ordering(older, newer):
    assert parse_version(older) < parse_version(newer)
    assert not parse_version(newer) < parse_version(older)


def test_local_label_is_kept_for_display_but_never_orders():
    assert parse_version("2.11.0") == parse_version("2.11")  # trailing zeros do not order either
    builds = [parse_version(v) for v in ("2.11.0+cu130", "2.11.0+cpu", "2.11")]
    assert {public_version(v) for v in builds} == {parse_version("2.11.0")}
    assert parse_version("2.12.0.dev20260304+cu130").local == "cu130"
    assert str(parse_version("2.12.0.dev20260304+cu130")) == "2.12.0.dev20260304+cu130"
    # A gate at X: a local build of X passes as X does; a local build of a nightly of X does not.
    assert supports("cache_artifacts", "2.7.0+cu126") and supports("cache_artifacts", "2.7")
    assert not supports("cache_artifacts", "2.7.0.dev20250101+cu126")


def test_garbage_is_rejected():
    with pytest.raises(ValueError):
        parse_version("two point twelve")


def test_supports_reads_the_gate_table(monkeypatch):
    assert supports("cache_artifacts", "2.13.0+cpu")
    assert not supports("cache_artifacts", "2.6.0")
    # a nightly of the gate's release predates it: the safe (fallback) side
    assert not supports("cache_artifacts", "2.7.0.dev20250101+cu126")
    monkeypatch.setitem(GATES, "cache_artifacts", versions.Gate("2.14", "moved"))
    assert not supports("cache_artifacts", "2.13.0")
    with pytest.raises(KeyError, match="unknown version gate"):
        supports("no_such_feature")


def test_running_torch_passes_every_gate():
    # megacpp requires torch >= 2.11; a failing gate here means the table is wrong
    assert all(supports(feature) for feature in GATES)
