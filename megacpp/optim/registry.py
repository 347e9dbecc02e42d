"""The optimizers an `OptimizerStack` is built from, by name.

The name is the prefix of the routing groups (``"muon:original"``, ``"adamw:embed"``) and of the keys
of the stack's checkpointed moments (``"<name>/<parameter name>/<state key>"``), so renaming an entry
changes the checkpoint format; adding one does not. The order is the order the stack steps them in
and lists them in its ``state_dict()["parts"]``.

A new optimizer is its own module (a `TensorHParamOptimizer` subclass with ``init_state``), its spec
module (its `OptimizerSpec`, torch-free, naming the class by path; the configuration gate holds its
settings to the spec's ``ranges``) plus one line here; a knob of its own is an OptimConfig field its
spec ranges (docs/architecture.md, "Adding an optimizer").
Parameters reach it through their modules' hints, ``ParamHint(optimizer="<name>")``; Muon and AdamW also
take the parameters the default routes send them (megacpp.optim.groups.DEFAULT_ROUTES).
"""
from __future__ import annotations

from megacpp.optim.adamw_spec import ADAMW_SPEC
from megacpp.optim.muon_spec import MUON_SPEC
from megacpp.optim.spec import OptimizerSpec

OPTIMIZERS: dict[str, OptimizerSpec] = {
    "muon": MUON_SPEC,
    "adamw": ADAMW_SPEC,
}
