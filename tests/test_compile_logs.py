"""The compile log classifier: counted breaks, always-alert lines."""
from __future__ import annotations

import pytest

from megacpp.compile.logs import LogClassifier, LogKind

W = "W1121 21:05:52.150000 6145 torch/_dynamo/convert_frame.py:1994] [3/3] "


@pytest.mark.parametrize(
    "line, kind, rule",
    [
        ("UserWarning: triton._C.libtriton.native_specialize_impl is deprecated", LogKind.OTHER, ""),
        (W + "torch._dynamo hit config.recompile_limit (64)", LogKind.ALERT, "recompile_limit_hit"),
        (W + "torch._dynamo hit config.accumulated_recompile_limit (256)", LogKind.ALERT, "recompile_limit_hit"),
        (W + "torch._dynamo hit config.cache_size_limit (8)", LogKind.ALERT, "recompile_limit_hit"),
        ("torch._dynamo.exc.FailOnRecompileLimitHit: recompile_limit reached", LogKind.ALERT,
         "recompile_limit_failure"),
        ("I1121 step 100 loss 3.21", LogKind.OTHER, ""),
        # Inductor's select_algorithm, when a candidate's benchmark fails (seed 000's autotune OOM):
        ("Runtime error during autotuning: \nCUDA out of memory. Tried to allocate 2.00 GiB. \nIgnoring this "
         "choice.", LogKind.ALERT, "autotune_choice_failed"),
        ("triton.runtime.errors.OutOfResources: out of resource: shared memory, Required: 262144, Hardware "
         "limit: 232448", LogKind.ALERT, "triton_out_of_resources"),
        ("W1121 autotune: picked triton_mm_7 (0.012 ms)", LogKind.OTHER, ""),
    ],
)
def test_classification(line, kind, rule):
    verdict = LogClassifier().classify(line)
    assert (verdict.kind, verdict.rule) == (kind, rule)


def test_graph_breaks_count_until_the_bound_then_alert():
    classifier = LogClassifier(break_bound=2)
    line = "V1121 [0/0] [__graph_breaks] Graph break in user code at /work/main/megacpp/model/mamba3.py:88"
    kinds = [classifier.classify(line).kind for _ in range(3)]
    assert kinds == [LogKind.COUNT, LogKind.COUNT, LogKind.ALERT]
    assert "mamba3.py:88" in classifier.classify(line).why
    assert classifier.breaks == 4


def test_zero_bound_alerts_on_the_first_break():
    line = "Graph break (user stack suppressed due to duplicate graph break) in user code at /x.py:3"
    assert LogClassifier().classify(line).kind is LogKind.ALERT


def test_break_explanations_are_not_breaks():
    line = "For more details about this graph break, please visit: https://meta-pytorch.github.io/x.html"
    assert LogClassifier().classify(line).kind is LogKind.OTHER
