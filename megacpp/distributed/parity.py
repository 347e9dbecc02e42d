"""Ranks must run the same program: compare everything that changes graphs, kernels or data.

At init every rank describes itself (config, library versions, GPU, determinism and compile settings,
environment variables that steer torch, the kernels it resolved, tokenizer and data keys, global batch,
parameter names and shapes, a fingerprint of the initial weights) and one all-gather compares the
descriptions. A mismatch stops every rank with one line naming the setting and each rank's value,
seconds after start instead of as a hang or a silent divergence hours later. The same comparison
runs on replicated state during training (`replica_fingerprint`).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Collection, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from megacpp.distributed.context import DistContext, DistError
from megacpp.distributed.launch_env import PER_RANK_ENV as AUTOFIT_PER_RANK_ENV
from megacpp.model.hints import canonical_name
from megacpp.optim.local import is_sharded
from megacpp.versions import package_version, torch_version

# Environment variables that change what torch compiles or how it computes; per-rank variables
# (RANK, LOCAL_RANK, CUDA_VISIBLE_DEVICES, ...) and paths are deliberately absent.
ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCHDYNAMO_", "TORCH_COMPILE_", "TORCH_NCCL_", "NCCL_ALGO", "NCCL_PROTO",
                "CUBLAS_", "CUDNN_", "NVIDIA_TF32_OVERRIDE", "PYTORCH_CUDA_ALLOC_CONF", "MEGACPP_")
ENV_PER_RANK = ("TORCH_FR_DUMP_TEMP_FILE", "MEGACPP_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
                *AUTOFIT_PER_RANK_ENV)
# Config keys that name host-local places: hosts may keep their caches anywhere (the data itself is
# compared through the tokenizer hash and the data key).
HOST_LOCAL_KEYS = (("data", "cache_dir"), ("compile", "cache_dir"))


class ParityError(DistError):
    """Ranks disagree on something that must be identical."""


def tensor_digest(tensors: Iterable[tuple[str, Tensor]]) -> str:
    """blake2b over names, dtypes, shapes and bytes of the given (name, full tensor) pairs."""
    h = hashlib.blake2b(digest_size=12)
    for name, t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def relevant_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    env = os.environ if environ is None else environ
    return {k: v for k, v in sorted(env.items())
            if k.startswith(ENV_PREFIXES) and k not in ENV_PER_RANK}


def shared_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config as a plain dict without its host-local keys."""
    out = {section: dict(values) if isinstance(values, dict) else values for section, values in config.items()}
    for section, key in HOST_LOCAL_KEYS:
        out.get(section, {}).pop(key, None)
    return out


def library_versions(device: torch.device) -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": str(torch_version()), "cuda": str(torch.version.cuda),
           **{name: package_version(name) for name in ("triton", "numpy", "tokenizers", "safetensors")}}
    if device.type == "cuda":
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        out["gpu"] = torch.cuda.get_device_name(device)
        cap = torch.cuda.get_device_capability(device)
        out["compute_capability"] = f"sm_{cap[0]}{cap[1]}"
    return out


def dynamo_policy() -> dict[str, Any]:
    """The Dynamo settings as read back from torch (what this rank really compiles with)."""
    import torch._dynamo

    from megacpp.compile.policy import KNOBS

    return {key: getattr(torch._dynamo.config, knob.resolve()) for key, knob in KNOBS.items()}


def model_layout(model: nn.Module) -> dict[str, str]:
    """Parameter name -> global shape and dtype."""
    return {n: f"{tuple(p.shape)} {p.dtype}" for n, p in model.named_parameters()}


def replica_fingerprint(model: nn.Module, extra: dict[str, Any] | None = None,
                        local: Collection[str] = ()) -> dict[str, str]:
    """Digests of the state that every rank holds whole and must hold identically, by name: unsharded
    parameters and persistent buffers (e.g. MoE selection biases), and `extra` (loader position,
    schedule). ``local`` names parameters each rank holds other rows of (expert parallelism)."""
    # The state dict: persistent buffers only (per-forward statistics differ by design until reduced).
    whole = [(n, t) for n, t in model.state_dict().items() if not is_sharded(t) and canonical_name(n) not in local]
    out: dict[str, Any] = {"replicated": {name: tensor_digest([(name, t)]) for name, t in whole}}
    for key, value in (extra or {}).items():
        out[key] = json.dumps(value, sort_keys=True, default=str)
    return out


def check_parity(ctx: DistContext, items: dict[str, Any], when: str) -> None:
    """All-gather `items` (name -> JSON-able value) and raise on every rank at the first mismatch."""
    if not ctx.distributed:
        return
    everyone = ctx.all_gather_objects(items)
    for key in items:
        values = [rank_items.get(key) for rank_items in everyone]
        if any(v != values[0] for v in values[1:]):
            raise ParityError(f"rank parity ({when}): {_describe_mismatch(key, values)}; every rank must "
                              "run the same program (same config, versions, environment and data)")


def _describe_mismatch(key: str, values: list[Any]) -> str:
    """Name the first differing leaf of nested dicts and give each rank's value (shortened)."""
    path = key
    while all(isinstance(v, dict) for v in values):
        keys = sorted(set().union(*values))
        sub = next((k for k in keys if any(v.get(k) != values[0].get(k) for v in values[1:])), None)
        if sub is None:
            break
        path, values = f"{path}.{sub}", [v.get(sub) for v in values]
    shown = ", ".join(f"rank {r}: {_short(v)}" for r, v in enumerate(values))
    return f"{path} differs ({shown})"


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def weight_fingerprint(model: nn.Module) -> str:
    """A digest of every weight's float64 sum and sum of squares (cheap on the device, and any
    difference between ranks' initial weights changes it)."""
    with torch.no_grad():
        moments = [(name, torch.stack([p.double().sum(), p.double().square().sum()]))
                   for name, p in model.state_dict().items() if p.is_floating_point()]
    return tensor_digest(moments)
