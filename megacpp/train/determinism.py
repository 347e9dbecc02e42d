"""Seeding and the two run modes: the fast path (default) and bitwise mode (``--deterministic``).

One seed drives Python's, NumPy's and torch's (CPU and CUDA) generators; the data loader owns a
generator of its own derived from the same seed, so each consumer's draws come in a fixed order.
"""
from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch

CUBLAS_WORKSPACE = ":4096:8"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # seeds every CUDA device too


def configure_mode(deterministic: bool) -> dict[str, Any]:
    """Apply the run mode and return what was set, for the start-up report and the checkpoint.

    Bitwise mode makes a missing deterministic implementation an error (naming the op), turns off
    TF32 and cuDNN autotuning, and pins Inductor's autotuning off so kernel choices cannot vary.
    """
    if deterministic:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
        torch.use_deterministic_algorithms(True, warn_only=False)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        _pin_inductor_autotune()
    else:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.benchmark = False
    return mode_report()


def _pin_inductor_autotune() -> None:
    import torch._inductor.config as inductor_config

    inductor_config.max_autotune = False
    inductor_config.max_autotune_gemm = False
    inductor_config.coordinate_descent_tuning = False
    # Inductor's own deterministic mode skips on-device benchmarking whose pick changes numerics.
    # Feature-detected: a config key, not an API whose presence tracks a release we gate on.
    if hasattr(inductor_config, "deterministic"):
        inductor_config.deterministic = True


def mode_report() -> dict[str, Any]:
    return {
        "mode": "bitwise" if torch.are_deterministic_algorithms_enabled() else "fast",
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
    }


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """The host generators' states and `device`'s (when it is a GPU), checkpointable with weights_only
    loading. Only the training device's generator: under torchrun every rank seeds alike and draws
    alike on its own GPU, so one rank's states are every rank's."""
    state: dict[str, Any] = {
        "python": _python_state_to_tensor(random.getstate()),
        "numpy": _numpy_state_to_tensor(np.random.get_state()),
        "torch": torch.get_rng_state(),
    }
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    random.setstate(_python_state_from_tensor(state["python"]))
    np.random.set_state(_numpy_state_from_tensor(state["numpy"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


# weights_only torch.load accepts tensors and plain containers; RNG states are converted to those.

def _python_state_to_tensor(state: tuple) -> dict[str, Any]:
    version, internal, gauss = state
    return {"version": version, "internal": torch.tensor(internal, dtype=torch.int64), "gauss": gauss}


def _python_state_from_tensor(d: dict[str, Any]) -> tuple:
    return (d["version"], tuple(int(v) for v in d["internal"].tolist()), d["gauss"])


def _numpy_state_to_tensor(state: tuple) -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = state
    return {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached": float(cached)}


def _numpy_state_from_tensor(d: dict[str, Any]) -> tuple:
    return (d["name"], d["keys"].numpy().astype(np.uint32), d["pos"], d["has_gauss"], d["cached"])
