"""Compile configuration: which regions to compile, with what backend, and the expected health bounds."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from megacpp.rules import NON_NEGATIVE, ConfigSection, Interval, Keys

CompileMode = Literal["none", "model", "blocks"]
CompileBackend = Literal["inductor", "aot_eager", "eager"]
OptimizerHelper = Literal["auto", "on", "off"]
ModelHelper = Literal["on", "off"]
CudaGraphs = Literal["auto", "on", "off"]
MODES = get_args(CompileMode)
BACKENDS = get_args(CompileBackend)


@dataclass
class CompileConfig(ConfigSection):
    mode: CompileMode = "blocks"  # model: the whole model; blocks: each block of model.blocks on its own
    backend: CompileBackend = "inductor"  # eager: Dynamo capture only, no lowering
    fullgraph: bool = False  # True: Dynamo raises at the first break instead of the bound check counting it
    dynamic_batch: bool = True  # mark the batch axis (dim 0) dynamic on warmup inputs; no other dim is
    max_graph_breaks: int = 0  # expected bound per forward over megacpp's own code; 0 for the hybrid
    max_recompiles_after_warmup: int = 0
    forbid_recompiles: bool = False  # after warmup any recompile raises at once, naming its guard
    fail_on_recompile_limit_hit: bool = True  # raise at the cap instead of running that frame eagerly forever
    # Replay each compiled region as a CUDA graph (Inductor's CUDA graph trees, megacpp.compile.cudagraphs):
    # auto = on for one CUDA process outside bitwise mode with the inductor backend (`small` and `dense` set it).
    cudagraphs: CudaGraphs = "off"
    max_autotune: bool = False  # Inductor GEMM/pointwise autotuning (slow compiles; its subprocess can OOM)
    # Benchmark autotune choices in a subprocess, so a crashing candidate cannot kill training (only
    # matters once autotuning is on).
    autotune_subprocess: bool = True
    cache_dir: str = ""  # Inductor cache root; "" = $MEGACPP_CACHE_DIR or ~/.cache/megacpp
    # A `megacpp cache export` directory to start from (a shared warm cache): imported into the cache
    # before the first compile, file by file verified, under the cache's lock (once per host: the other
    # ranks find it current and skip); "" = none.
    import_cache: str = ""
    # Compile the optimizer step in helper processes while the model compiles (megacpp.train.step_prewarm):
    # auto = on CUDA when their copy of the step's tensors is at most a tenth of the card.
    optimizer_helper: OptimizerHelper = "auto"
    # Compile the model's block kinds and loss in helper processes, one per kind, while the trainer compiles
    # them in order (megacpp.train.model_prewarm); one process or replicate, compile mode blocks. Off: on one
    # H100 `small`'s first step took 55.5-64.6 s with them and 58.4 s without (16 cores shared; BENCHMARKS K10).
    model_helper: ModelHelper = "off"

    @classmethod
    def ranges(cls) -> dict[str, Interval]:
        return {"max_graph_breaks": NON_NEGATIVE, "max_recompiles_after_warmup": NON_NEGATIVE}

    def check(self, k: Keys) -> None:
        """CUDA graphs replay what Inductor compiled: with nothing compiled, or another backend, `on` would
        do nothing."""
        if self.cudagraphs == "on" and (self.mode == "none" or self.backend != "inductor"):
            has = f"compile.mode {self.mode!r}, compile.backend {self.backend!r}"
            raise k.error("cudagraphs", f"needs regions compiled by the inductor backend, and this run has {has} "
                                        "(use auto or off)")
