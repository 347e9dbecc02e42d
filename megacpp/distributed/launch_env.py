"""Environment variables a launcher sets differently on each rank, which the ranks' parity check skips.

The auto-fit supervisor (megacpp.train.autofit) hands each training process the places of its own
out-of-memory report, its start time and its parent's pid: they differ between ranks by design.
Defined here, below the parity check that reads them and the supervisor that sets them.
"""
from __future__ import annotations

REPORT_ENV = "MEGACPP_AUTOFIT_REPORT"
SPAWNED_ENV = "MEGACPP_AUTOFIT_SPAWNED"
PARENT_ENV = "MEGACPP_AUTOFIT_PARENT"
PER_RANK_ENV = (REPORT_ENV, SPAWNED_ENV, PARENT_ENV)
