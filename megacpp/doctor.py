"""``megacpp doctor``: what this machine runs megacpp with, and what megacpp promises on it."""
from __future__ import annotations

import platform
import sys

import torch

from megacpp.config import Config
from megacpp.ops.fast_paths import kernel_report
from megacpp.versions import package_version, torch_version

# What is bit-exact, what is rerun-deterministic, what is only statistically equivalent, and the test
# that backs each row. Keep in step with tests/ (test_doctor.py checks every named test exists).
PROMISES: list[tuple[str, str, str]] = [
    ("tier 1 bit-exact", "default path (new flags off) vs the pinned reference output and loss, CPU",
     "tests/test_determinism.py::test_tier1_default_path_matches_pinned_fixture"),
    ("tier 1 bit-exact", "resume: N steps + checkpoint + M steps == N+M steps (weights, optimizer, losses)",
     "tests/test_train.py::test_tier1_interrupted_then_resumed_equals_uninterrupted"),
    ("tier 1 bit-exact", "seeded weight perturbation and restore (frozen parameters too)",
     "tests/test_determinism.py::test_tier1_perturb_restore"),
    ("tier 1 bit-exact", "loader resume: the same tokens after a state_dict round trip",
     "tests/test_data_loader.py::test_tier1_resume_gives_identical_batches"),
    ("tier 2 rerun", "two fresh processes, same seed and config: identical losses for 20 steps (CPU)",
     "tests/test_determinism.py::test_tier2_two_processes_same_losses"),
    ("tier 2 rerun", "bitwise mode on a GPU: two runs of `small`, identical losses for 50 steps",
     "BENCHMARKS.md (H200 run; CI has no GPU)"),
    ("tier 2 rerun", "decoding: same prompt, seed and settings give the same tokens",
     "tests/test_determinism.py::test_tier2_sampling_reproducible"),
    ("tier 2 rerun", "MoE dispatch: static shapes, stable tie-breaking, identical outputs and statistics",
     "tests/test_moe.py::test_tier2_rerun_identical_outputs_stats_and_grads"),
    ("tier 3 tolerance", "decode caches vs full forward logits (fp32, |diff| <= 1e-4)",
     "tests/test_hybrid.py::test_tier3_atol_1e4_decode_matches_forward"),
    ("tier 3 tolerance", "packed documents vs each document alone (fp32, |diff| <= 1e-4)",
     "tests/test_hybrid.py::test_tier3_atol_1e4_packed_documents_isolated"),
    ("tier 3 tolerance", "opt-in bf16 Mamba-3 scan matmuls vs the fp64 reference (<= 4 bf16 roundoffs)",
     "tests/test_mamba3_scan.py::test_tier3_bf16_matmul_gradients_match_sequential_float64"),
    ("statistical only", "GPU fast path: attention backward and atomics-based reductions vary run to run",
     "BENCHMARKS.md (run-to-run loss spread)"),
    ("tier 1 bit-exact", "distributed Muon on FSDP2 shards == single-device Muon (CPU, 2 and 3 ranks)",
     "tests/test_dist_muon.py::test_tier1_sharded_muon_equals_single_device_muon"),
    ("tier 1 bit-exact", "2 ranks: interrupted + resumed == uninterrupted; the checkpoint loads bit-identically "
     "on 1 and 2 ranks (CPU)", "tests/test_dist_train.py::test_tier1_two_rank_checkpoint_resumes_on_one_and_two_ranks"),
    ("tier 3 tolerance", "1 rank at batch 2B vs 2 ranks at batch B, 8 steps (AdamW 1e-4, Muon 2e-3; CPU)",
     "tests/test_dist_train.py::test_tier3_one_rank_at_batch_4_matches_two_ranks_at_batch_2"),
    ("statistical only", "multi-GPU on GPUs: gradient reduction order, and cuBLAS picks other kernels for the "
     "owner rank's smaller Muon batches", "BENCHMARKS.md (1 vs 2 H200, same global batch)"),
]


def _devices() -> list[str]:
    if not torch.cuda.is_available():
        return [f"cpu ({torch.get_num_threads()} threads); no CUDA device"]
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}")
    return out


def distributed_report(cfg: Config) -> list[str]:
    """What a torchrun job would run with here: backends, this process's torchrun variables, the
    NCCL and flight-recorder settings in force, and the FSDP2 settings of the config."""
    import os

    import torch.distributed as dist

    from megacpp.compile.env import TORCHRUN_DEFAULTS
    from megacpp.distributed.context import FLIGHT_RECORDER

    if not dist.is_available():
        return ["torch.distributed: not available in this torch build (single process only)"]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if gpus and dist.is_nccl_available() else "unavailable"
    rows = [f"backends: gloo {'yes' if dist.is_gloo_available() else 'no'}, NCCL {nccl}; megacpp uses "
            + ("cuda:nccl,cpu:gloo" if gpus else "gloo (CPU)")
            + (f"; up to {gpus} ranks per host (--nproc_per_node <= GPUs)" if gpus else "")]
    torchrun = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
                if k in os.environ}
    rows.append("torchrun: " + (", ".join(f"{k}={v}" for k, v in torchrun.items()) if torchrun
                                 else "not under torchrun (launch: torchrun --nproc_per_node=N -m megacpp.cli train)"))
    defaults = {**TORCHRUN_DEFAULTS, **FLIGHT_RECORDER}
    rows += [f"{k}={os.environ.get(k, v + ' (megacpp default under torchrun)')}" for k, v in defaults.items()]
    rows += [f"{k}={v} (set)" for k, v in sorted(os.environ.items())
             if k.startswith(("NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_")) and k not in defaults]
    d = cfg.dist
    rows.append(f"FSDP2: reshard_after_forward={d.reshard_after_forward}, prefetch {d.prefetch or 'FSDP2 order'}, "
                f"all-gather dtype {d.param_dtype}, "
                f"init timeout {d.init_timeout_s:.0f} s, step timeout {d.step_timeout_s:.0f} s, "
                f"replica check every {d.fingerprint_every or 'checkpoint'} step(s)")
    return rows


def doctor_report(cfg: Config) -> str:
    from megacpp.compile.cache import describe_cache_dirs
    from megacpp.data.config import default_cache_dir
    from megacpp.environment import audit

    lines = [
        "versions",
        f"  python {sys.version.split()[0]} ({platform.platform()})",
        f"  torch {torch_version()}, CUDA {torch.version.cuda or 'none'}, triton {package_version('triton')}",
        "  " + ", ".join(f"{name} {package_version(name)}" for name in ("tokenizers", "safetensors", "numpy")),
        "devices",
        *(f"  {d}" for d in _devices()),
        "caches",
        f"  data and tokenizers: {default_cache_dir()}",
        *(f"  {line}" for line in describe_cache_dirs(cfg.compile)),
        "kernels",
        *(f"  {k}" for k in kernel_report()),
        "environment audit (compiled extensions vs the running torch)",
        *(f"  {v.line()}" for v in audit()),
        f"  Inductor autotuning: max_autotune={cfg.compile.max_autotune} (GEMM autotuning off unless asked), "
        f"in a subprocess={cfg.compile.autotune_subprocess}",
        "distributed",
        *(f"  {line}" for line in distributed_report(cfg)),
        "determinism promises (test that backs each)",
        *(f"  {tier:<17} {what}\n  {'':<17} -> {test}" for tier, what, test in PROMISES),
    ]
    return "\n".join(lines)
