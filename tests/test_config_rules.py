"""Every rule in one home: each configuration section owns its ranges and its rules (megacpp.rules), the
gate and the block constructors run the same ones, and every numeric field has a range."""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass

import pytest

from megacpp.config import Config, ConfigError, apply_overrides
from megacpp.model.config import ModelConfig
from megacpp.model.registry import BLOCK_KINDS
from megacpp.optim.registry import OPTIMIZERS
from megacpp.presets import preset
from megacpp.rules import AT_LEAST_1, ConfigSection, Interval, check_alone, field_types, sections
from megacpp.run_config import load_config
from megacpp.validate import section_ranges


def _is_numeric(tp: object) -> bool:
    """int or float, optional or not (bool is no number here, though Python makes it an int)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(_is_numeric(option) for option in typing.get_args(tp))
    return tp in (int, float)


def unranged_and_unknown(section: object, ranges: list[typing.Mapping[str, Interval]]) -> tuple[list[str], list[str]]:
    """The numeric fields of `section` without a range, and the ranges that name no field of it."""
    fields = field_types(type(section))
    ranged = {name for mapping in ranges for name in mapping}
    return ([name for name, tp in fields.items() if _is_numeric(tp) and name not in ranged],
            sorted(ranged - set(fields)))


def test_every_numeric_field_of_every_section_has_a_range():
    missing, unknown = [], []
    for path, section in sections(Config()):
        if path:
            lacking, stray = unranged_and_unknown(section, section_ranges(path, section))
            missing += [f"{path}.{name}" for name in lacking]
            unknown += [f"{path}.{name}" for name in stray]
    assert missing == [] and unknown == []


def test_the_field_walk_finds_a_field_without_a_range_and_a_range_without_a_field():
    @dataclass
    class Planted(ConfigSection):
        width: int = 4
        rate: float | None = None
        name: str = "x"
        flag: bool = False

    assert unranged_and_unknown(Planted(), [{"width": AT_LEAST_1, "widht": AT_LEAST_1}]) == (["rate"], ["widht"])


def test_every_block_kind_has_a_section_on_the_model_config():
    """The registry line names the ModelConfig field that holds the kind's section."""
    model = ModelConfig()
    for kind in BLOCK_KINDS.values():
        assert isinstance(getattr(model, kind.config_field), ConfigSection), kind.symbol


def test_every_optimizer_ranges_fields_of_the_optimizer_section():
    fields = {f.name for f in dataclasses.fields(Config().optim)}
    for name, spec in OPTIMIZERS.items():
        assert spec.ranges and set(spec.ranges) <= fields, name


# A bad value of each block kind: (override, the problem both the gate and the constructor state).
BLOCK_PROBLEMS = {
    "A": (("model.attention.n_kv_heads", "3"), "n_heads must be a multiple of n_kv_heads"),
    "M": (("model.mamba.head_dim", "48"), "head_dim must divide Mamba-3's inner width expand * d_model = 256"),
    "R": (("model.rnn.dt_min", "0.5"), "dt_min must be <= dt_max: they bound an init range"),
    "E": (("model.moe.top_k", "9"), "top_k must be <= n_experts: each token picks distinct experts"),
    "F": (("model.ffn.hidden", "0"), "must be >= 1"),
}


def test_every_registered_kind_has_a_bad_value_here():
    assert set(BLOCK_PROBLEMS) == set(BLOCK_KINDS)


@pytest.mark.parametrize("symbol", list(BLOCK_PROBLEMS))
def test_tier1_the_gate_and_the_block_constructor_refuse_with_the_same_rule(symbol):
    (key, raw), problem = BLOCK_PROBLEMS[symbol]
    with pytest.raises(ConfigError) as gate:
        load_config("tiny", overrides=[(key, raw)])
    assert str(gate.value).startswith(f"command line --{key}: ") and problem in str(gate.value)

    kind = BLOCK_KINDS[symbol]
    model = apply_overrides(preset("tiny"), [(key, raw)]).model  # the same value, without the gate
    section = getattr(model, kind.config_field)
    with pytest.raises(ConfigError) as built:
        kind.mixer_class()(model.d_model, section, 0)
    assert str(built.value).startswith(f"{type(section).__name__}.") and problem in str(built.value)


def test_tier1_an_unused_kind_is_held_to_its_ranges_but_not_its_rules():
    load_config("tiny", overrides=[("model.pattern", "AEF"), ("model.mamba.head_dim", "48")])
    expected = r"^command line --model.mamba.d_state: model.mamba.d_state = 0 must be >= 1$"
    with pytest.raises(ConfigError, match=expected):
        load_config("tiny", overrides=[("model.pattern", "AEF"), ("model.mamba.d_state", "0")])


def test_tier1_a_model_config_built_in_python_meets_the_rules_when_built():
    """HybridLM runs the model's rules, as the gate does: a depth that drops kinds is named, not a traceback."""
    from megacpp.model.hybrid import HybridLM
    from megacpp.model.pattern import PatternError

    with pytest.raises(PatternError, match=r"^ModelConfig.depth = 3: depth 3 cannot fill pattern 'AEMR'"):
        HybridLM(ModelConfig(depth=3, pattern="AEMR"))
    with pytest.raises(ConfigError, match=r"^ModelConfig.engram.layers = \[7\]: block indices \[7\] are outside"):
        check_alone(ModelConfig(depth=5, engram=dataclasses.replace(ModelConfig().engram, layers=[7])))
