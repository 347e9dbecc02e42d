"""Compile an op's backward Triton kernels in a helper process while the forward goes on.

A Triton kernel compiles at its first launch, on the launching thread. megacpp's backward kernels are
first launched in the first step's backward, one after the other, where nothing else can run: that phase
took 14.3-18.0 s of `small`'s cold first step on an H100 against 0.5 s for `dense`, which has no kernels
of its own (BENCHMARKS.md, U1 and W1). Their launches are known as soon as the forward has run, since the
backward reads the forward's inputs with their layouts and allocates the rest itself. So at an op's
forward, the op describes its backward's launches (shapes, strides, dtypes and 16-byte alignment of the
real tensors), and a helper process compiles each with `JITFunction.warmup` on meta tensors of that
description: the same specialization, hence the same entry in Triton's on-disk cache (the directory the
trainer's launches use), where the real launch then finds it. Those keys hold the version of the ptxas
Triton runs too, which compile/env.py pins at entry for every process of a run. A process, not threads:
compiled in the trainer's own threads the kernels halved the backward (7.5 against 14.3-18.0 s) but
Triton's Python front end took the GIL from the trainer's compile, and the forward grew by 3 s (W1). A
description that differs from the real launch (an unforeseen layout) costs only the helper's time: the
real launch compiles as it would have.

A backward that starts while its helper is still compiling compiles the kernels it needs itself, beside
the helper, as without one. Waiting for the helper instead was measured and is slower: R's helper starts
at R's first forward, the pattern's last block kind, and the first backward begins with R's, so R's
backward waited 2.7-4.6 s and the first backward took 3.7-6.0 s in four cold `small` runs on H100s,
against 1.5-2.2 s in the runs before it (BENCHMARKS.md, B1 and B2). Each op's first backward notes what it
found (`note_helpers`: ready, or still compiling), and the trainer logs it after the first step
(`outcomes`), with the logs of helpers that failed.

An evaluation's or a generation's forward is never followed by its backward; within
`no_backward_follows()` (evaluation, the position curve and generation, hence samples and the C++ syntax
check, enter it) the ops start no helpers. The op cannot tell by itself: training's compiled forward runs
with grad mode off too.

Set ``MEGACPP_KERNEL_PREWARM=0`` to compile every kernel at its first launch instead.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import traceback
import warnings
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

try:  # launches hold descriptors only where their kernels run, hence where triton is installed
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None

ENV_SWITCH = "MEGACPP_KERNEL_PREWARM"
MAX_KEYS = 4  # layouts prewarmed per op and process: training's, and a few more (an eval batch of another size)

_lock = threading.Lock()
_submitted: dict[Hashable, subprocess.Popen | None] = {}  # by (op name, layout)
_per_name: dict[Hashable, int] = {}  # layouts submitted per op name
_noted: set[str] = set()  # ops whose first backward has looked at their helpers
_outcomes: dict[str, str] = {}  # what each op's first backward found, by the op's name
_no_backward: ContextVar[bool] = ContextVar("megacpp_no_backward_follows", default=False)


@dataclass(frozen=True)
class Launch:
    """One kernel launch, `kernel[grid](*args, **meta)`; meta holds the constexprs and launch options. The ops
    that prewarm build their launches as these, so that one code path both launches and describes them."""

    kernel: Any  # a triton JITFunction
    grid: tuple[int, ...]
    args: tuple
    meta: dict[str, Any]


def run_launch(launch: Launch) -> Any:
    """Launch it; returns triton's compiled kernel."""
    return launch.kernel[launch.grid](*launch.args, **launch.meta)


def enabled(device: torch.device) -> bool:
    """Whether launches on `device` are prewarmed: CUDA only (Triton's interpreter compiles nothing), not
    switched off by the environment, and not within `no_backward_follows`."""
    return device.type == "cuda" and os.environ.get(ENV_SWITCH, "1") != "0" and not _no_backward.get()


@contextlib.contextmanager
def no_backward_follows() -> Iterator[None]:
    """Start no helpers within it (also a decorator; not around a ``yield``): for forwards that no backward
    follows. A `small` run's evaluation at its end started three helpers on an H200, which compiled 8
    backward kernels for its layouts on the host's cores, none of them ever launched (BENCHMARKS.md, C3)."""
    token = _no_backward.set(True)
    try:
        yield
    finally:
        _no_backward.reset(token)


def tensor_key(*tensors: torch.Tensor | None) -> tuple:
    """What a Triton launch specializes on of each tensor (and what sizes the integer arguments), as a
    hashable key: shape, strides, dtype and the pointer's alignment to 16 bytes."""
    return tuple(None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.data_ptr() % 16) for t in tensors)


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor with t's shape, strides, dtype and storage offset: its `data_ptr()` is the offset in
    bytes, so it is 16-byte aligned exactly where t is (CUDA allocations are)."""
    return _meta_tensor(tuple(t.shape), t.stride(), t.storage_offset(), t.dtype)


def _layout(t: torch.Tensor) -> tuple:
    return ("tensor", tuple(t.shape), t.stride(), t.storage_offset(), t.dtype)


def _describe_arg(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return _layout(a)
    if TensorDescriptor is not None and isinstance(a, TensorDescriptor):
        return ("descriptor", _layout(a.base), list(a.shape), list(a.strides), list(a.block_shape))
    return a


def describe_launch(launch: Launch) -> dict[str, Any]:
    """A launch as plain data for the helper: the kernel by module and name, each tensor argument by
    layout, each tensor descriptor by its tensor's layout and its own shape, strides and tile."""
    fn = launch.kernel.fn
    return {"module": fn.__module__, "name": fn.__name__, "grid": tuple(launch.grid),
            "args": [_describe_arg(a) for a in launch.args], "meta": dict(launch.meta)}


def rebuild_arg(a: Any) -> Any:
    """A described argument as the helper passes it to the kernel: meta tensors of the same layouts."""
    if isinstance(a, tuple) and a[:1] == ("tensor",):
        return _meta_tensor(*a[1:])
    if isinstance(a, tuple) and a[:1] == ("descriptor",):
        return TensorDescriptor(_meta_tensor(*a[1][1:]), *a[2:])
    return a


def warm_in_background(name: Hashable, tensors: Sequence[torch.Tensor], device: torch.device,
                       describe: Callable[[], Sequence[Any]]) -> subprocess.Popen | None:
    """Compile the launches `describe()` returns in a helper process, once per `name` and layout of
    `tensors` (the inputs the launches derive from), for at most MAX_KEYS layouts per name and process; the
    helper, or None when prewarming is off or this key was seen before. `describe` runs here (it builds
    meta tensors)."""
    if not enabled(device) or _per_name.get(name, 0) >= MAX_KEYS:  # the forward's hot path: nothing more to do
        return None
    key = (name, tensor_key(*tensors))
    if key in _submitted:  # every later forward of a layout: no lock
        return None
    with _lock:
        if key in _submitted or _per_name.get(name, 0) >= MAX_KEYS:
            return None
        _submitted[key] = None
        _per_name[name] = _per_name.get(name, 0) + 1
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        spec = {"device": index, "launches": [describe_launch(launch) for launch in describe()]}
        helper = _start(spec, _shared_triton_cache_dir(index))
    except Exception as exc:  # the prewarm only moves compiles earlier: failing, it must not fail the forward
        warnings.warn(f"kernel prewarm of {name!r} skipped, its kernels compile at their first launch: {exc!r}",
                      RuntimeWarning, stacklevel=2)
        return None
    _submitted[key] = helper
    return helper


def note_helpers(op: str) -> None:
    """At a backward of `op` (the first item of the name its forward prewarmed under), before its launches:
    note for `outcomes` whether the helpers compiling its kernels are done. One still compiling is not
    waited for (see the module's note). Only the first call looks; later ones are a set lookup, so the
    ops call it at every backward."""
    if op in _noted:
        return
    _noted.add(op)
    helpers = [helper for (name, _), helper in list(_submitted.items()) if helper is not None and _display(name) == op]
    if helpers:
        _outcomes[op] = _outcome(helpers)


def outcomes() -> str | None:
    """One line on what each prewarmed op's first backward found, e.g. ``kernel prewarm: m2rnn_scan_fast_bwd
    still compiling when its backward began, mamba3_fused_bwd ready``; None when no backward has run."""
    if not _outcomes:
        return None
    return "kernel prewarm: " + ", ".join(f"{name} {what}" for name, what in _outcomes.items())


def _display(name: Hashable) -> str:
    """The op's part of a prewarm name: ``("mamba3_fused_bwd", 64, torch.bfloat16)`` -> ``mamba3_fused_bwd``."""
    return str(name[0] if isinstance(name, tuple) and name else name)


def _outcome(helpers: list[subprocess.Popen]) -> str:
    """ready (every helper done before the backward) or still compiling; and failed helpers, whose logs lie
    beside their spec files."""
    codes = [helper.poll() for helper in helpers]
    what = "still compiling when its backward began" if None in codes else "ready"
    failed = sum(code not in (None, 0) for code in codes)
    if failed:
        what += f" ({failed} helper(s) failed: see megacpp-kernel-prewarm-*.log in {tempfile.gettempdir()})"
    return what


def wait_all(timeout_s: float = 600.0) -> list[int]:
    """Wait for every helper started; their exit codes."""
    return [helper.wait(timeout_s) for helper in list(_submitted.values()) if helper is not None]


def pin_cache_keys(namespace: dict[str, Any]) -> None:
    """Compute the Triton cache key of each JIT function a module defines, in definition order; called at the
    end of the module. Triton 3.6 keys a function by its source, its callees' keys and the constexpr globals
    it reaches, and which of those globals it counts depends on the order in which a process first computes
    the keys (on an H100, `_bwd_states_kernel`'s key differed between a process that computed it at import
    and one that computed it after the forward's kernels had compiled: BENCHMARKS.md, W4). The trainer and
    a helper reach their kernels in different orders, so a helper's kernels missed the trainer's cache;
    computed here, at import, in one order, each kernel's key is the same in every process."""
    from triton.runtime.jit import JITFunction

    for value in list(namespace.values()):
        if isinstance(value, JITFunction) and value.__module__ == namespace["__name__"]:
            value.cache_key  # noqa: B018 -- a property that computes and keeps the key


def _shared_triton_cache_dir(index: int) -> str:
    """The Triton cache directory of this process's launches, set now where it is not yet: Inductor sets
    TRITON_CACHE_DIR, when unset, to this same directory under its cache when it loads its first kernel; a
    run that never compiles (eager on CUDA) would otherwise look in Triton's default directory."""
    from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

    if not os.environ.get("TRITON_CACHE_DIR"):
        os.environ["TRITON_CACHE_DIR"] = triton_cache_dir(index)
    return os.environ["TRITON_CACHE_DIR"]


def _start(spec: dict[str, Any], cache_dir: str) -> subprocess.Popen:
    handle, path = tempfile.mkstemp(prefix="megacpp-kernel-prewarm-", suffix=".pkl")
    with os.fdopen(handle, "wb") as f:
        pickle.dump(spec, f)
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, TRITON_CACHE_DIR=cache_dir,
               PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    return subprocess.Popen([sys.executable, "-m", __name__, path], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env, start_new_session=True)


def _meta_tensor(shape: tuple[int, ...], stride: tuple[int, ...], offset: int, dtype: torch.dtype) -> torch.Tensor:
    span = offset + 1 + sum((size - 1) * step for size, step in zip(shape, stride, strict=True))
    return torch.empty(span, dtype=dtype, device="meta").as_strided(shape, stride, offset)


def _warm(launch: dict[str, Any], device: int) -> None:
    kernel = getattr(importlib.import_module(launch["module"]), launch["name"])
    torch.cuda.set_device(device)  # Triton compiles for the thread's current device
    compiled = kernel.warmup(*map(rebuild_arg, launch["args"]), grid=launch["grid"], **launch["meta"])
    # Triton builds a kernel's launcher (a C module per signature in some versions, cached on disk beside the
    # kernels) and loads it at the first launch: do that here too. `_init_handles` is Triton's own lazy
    # step; where a version lacks it, the trainer's first launch does it, as without the prewarm.
    init = getattr(compiled, "_init_handles", None)
    if callable(init):
        init()


def main(argv: list[str]) -> int:
    """The helper: compile every launch of the spec file, each in a thread of its own (Triton's compile
    spends most of its time outside the GIL: M's six kernels took 6.6 s on six threads of a 2-core CPU
    against 11.4 s in turn), and delete the spec. A failure is left beside it as `<spec>.log` (the real
    launch then compiles the kernel, and reports the error if it is one)."""
    path = Path(argv[0])
    try:
        spec = pickle.loads(path.read_bytes())
        with ThreadPoolExecutor(max(1, len(spec["launches"]))) as pool:
            for future in [pool.submit(_warm, launch, spec["device"]) for launch in spec["launches"]]:
                future.result()
    except Exception:
        path.with_suffix(".log").write_text(traceback.format_exc())
        return 1
    finally:
        path.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
