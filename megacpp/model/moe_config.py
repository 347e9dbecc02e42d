"""The mixture-of-experts block's config section (pattern symbol E) and when its grouped dispatch can serve it.

Torch-free, so the configuration (`megacpp config`, `megacpp.run_config.load_config`) loads without torch;
the mixer (megacpp/model/moe.py) imports it from here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megacpp.rules import AT_LEAST_1, NON_NEGATIVE, POSITIVE, ConfigSection, Interval, Keys
from megacpp.versions import supports

Routing = Literal["token_choice", "expert_choice"]
Dispatch = Literal["auto", "padded", "grouped"]
# grouped_mm wants 16-byte-aligned leading strides: rows of d_model and expert_hidden elements must be
# a multiple of 16 bytes for every operand dtype it takes (bf16/fp16: 8 elements, fp32: 4).
GROUPED_ALIGNMENT = 8


@dataclass
class MoEConfig(ConfigSection):
    n_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 128
    shared_expert: bool = True
    capacity_factor: float = 1.25
    routing: Routing = "token_choice"
    bias_update_rate: float = 1e-3
    # Token choice only. padded: static per-sequence capacity, overflow dropped (the reference, the CPU
    # path); grouped: dropless grouped GEMMs; auto: grouped on CUDA under bf16 autocast, padded otherwise.
    dispatch: Dispatch = "auto"

    @classmethod
    def ranges(cls) -> dict[str, Interval]:
        return {"n_experts": AT_LEAST_1, "top_k": AT_LEAST_1, "expert_hidden": AT_LEAST_1,
                "capacity_factor": POSITIVE, "bias_update_rate": NON_NEGATIVE}

    def check(self, k: Keys) -> None:
        """Each token picks top_k distinct experts. dispatch = "grouped" forces the dropless grouped GEMMs:
        token-choice routing, a torch with grouped_mm and 16-byte-aligned rows, or the model cannot be built
        ("auto" falls back instead)."""
        if self.top_k > self.n_experts:
            raise k.error_among(("top_k", "n_experts"), "top_k must be <= n_experts: each token picks distinct experts")
        # Asked only for "grouped": the answer reads the running torch's version, which loads torch.
        if self.dispatch == "grouped" and (problem := grouped_dispatch_problem(k.value("d_model"), self)):
            raise k.error_among(("dispatch", "routing", "d_model", "expert_hidden"), problem)


def grouped_dispatch_problem(d_model: int, cfg: MoEConfig) -> str:
    """Why the grouped dispatch cannot serve this configuration ("" when it can)."""
    if cfg.routing != "token_choice":
        return f"it serves token_choice routing, not {cfg.routing!r}"
    if not supports("grouped_mm"):
        return "this torch has no torch.nn.functional.grouped_mm"
    misaligned = {name: size for name, size in (("d_model", d_model), ("expert_hidden", cfg.expert_hidden))
                  if size % GROUPED_ALIGNMENT}
    if misaligned:
        return f"grouped_mm needs 16-byte-aligned rows: {misaligned} must be multiples of {GROUPED_ALIGNMENT}"
    return ""
