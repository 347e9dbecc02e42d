import pytest

from megacpp.config import Config, ConfigError, apply_overrides, dump_toml
from megacpp.presets import PRESETS, preset
from megacpp.run_config import load_config


def test_cli_override_nested_and_types():
    cfg = apply_overrides(Config(), [("model.depth", "8"), ("model.attention.qk_norm", "false"),
                                     ("model.engram.layers", "[1, 3]"), ("train.seed", "7")])
    assert cfg.model.depth == 8
    assert cfg.model.attention.qk_norm is False
    assert cfg.model.engram.layers == [1, 3]
    assert cfg.train.seed == 7


def test_cli_override_does_not_mutate_input():
    base = Config()
    apply_overrides(base, [("model.depth", "3")])
    assert base.model.depth == Config().model.depth


def test_cli_unknown_key_names_it_with_suggestion():
    with pytest.raises(ConfigError, match=r"--model.dpeth.*unknown config key 'model.dpeth'.*'depth'"):
        apply_overrides(Config(), [("model.dpeth", "8")])


def test_cli_wrong_type_names_key():
    with pytest.raises(ConfigError, match=r"model.depth.*expected int"):
        apply_overrides(Config(), [("model.depth", "eight")])


def test_toml_unknown_key_names_file_and_line(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\ndepth = 6\nwidht = 3\n')
    with pytest.raises(ConfigError) as err:
        load_config(path=path)[0]
    assert f"{path}:3" in str(err.value) and "'model.widht'" in str(err.value)


def test_toml_wrong_type_names_file_line_and_key(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('preset = "tiny"\n\n[model.attention]\nn_heads = "four"\n')
    with pytest.raises(ConfigError) as err:
        load_config(path=path)[0]
    assert f"{path}:4" in str(err.value) and "model.attention.n_heads" in str(err.value)
    assert "expected int" in str(err.value)


def test_choice_fields_accept_their_choices_and_name_them_otherwise(tmp_path):
    choices = [("model.mamba.scan_matmuls", "activation"), ("model.moe.routing", "expert_choice")]
    cfg = apply_overrides(Config(), choices)
    assert (cfg.model.mamba.scan_matmuls, cfg.model.moe.routing) == ("activation", "expert_choice")
    with pytest.raises(ConfigError, match=r"scan_matmuls.*expected one of 'fp32', 'activation', got 'bf16'"):
        apply_overrides(Config(), [("model.mamba.scan_matmuls", "bf16")])
    path = tmp_path / "run.toml"
    path.write_text('[model.moe]\nrouting = "expert"\n')
    with pytest.raises(ConfigError) as err:
        load_config(path=path)[0]
    assert f"{path}:2" in str(err.value) and "expected one of 'token_choice', 'expert_choice'" in str(err.value)


def test_toml_syntax_error_is_config_error(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[model\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(path=path)[0]


def test_toml_preset_base_and_round_trip(tmp_path):
    cfg = apply_overrides(preset("tiny"), [("model.depth", "12")])
    path = tmp_path / "round.toml"
    path.write_text(dump_toml(cfg))
    assert load_config(path=path)[0] == cfg


def test_unknown_preset():
    with pytest.raises(ConfigError, match="available presets: tiny, small, dense, nam52"):
        preset("huge")


def test_tier1_an_unknown_preset_in_a_file_names_the_file_and_line(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('# my run\n\npreset = "nope"\n')
    with pytest.raises(ConfigError) as err:
        load_config(path=path)[0]
    assert str(err.value) == f"{path}:3: unknown preset 'nope'; available presets: tiny, small, dense, nam52"


def test_presets_are_fresh_copies():
    a = PRESETS["tiny"]()
    a.model.depth = 99
    assert preset("tiny").model.depth != 99


def test_dense_preset_is_small_with_attention_and_mlp_only_and_has_the_hand_counted_parameters():
    """`dense` differs from `small` in the pattern, the per-kind learning rates (for kinds it does not
    have), the experts' Newton-Schulz iterations (it has no experts) and the run directory alone, and builds
    to the count
    worked out here from the layer shapes (no biases; RMSNorm has one weight per channel; QK-norm has
    no weights; the LM head is not tied)."""
    import dataclasses

    import torch

    from megacpp.model.hybrid import HybridLM

    small, dense = dataclasses.asdict(preset("small")), dataclasses.asdict(preset("dense"))
    differs = {(section, key) for section in small for key in small[section]
               if small[section][key] != dense[section][key]}
    assert differs == {("model", "pattern"), ("optim", "lr_scale_by_kind"), ("optim", "expert_ns_steps"),
                       ("train", "out_dir")}
    assert dense["optim"]["lr_scale_by_kind"] == [] and dense["optim"]["expert_ns_steps"] is None
    assert dense["model"]["pattern"] == "AF" and dense["model"]["depth"] == 24

    cfg = preset("dense").model
    cfg.vocab_size = preset("dense").data.vocab_size
    with torch.device("meta"):
        model = HybridLM(cfg)
    assert model.layout == "AF" * 12
    V, d, hidden = 32768, 768, 3072
    q_rows, kv_rows = 6 * 128, 2 * 128
    attention = d * (q_rows + 2 * kv_rows) + q_rows * d  # fused QKV, output projection
    mlp = d * hidden + hidden * d  # up, down (relu^2)
    per_pair = attention + mlp + 2 * d  # plus each sublayer's pre-norm
    expected = 12 * per_pair + V * d + d + d * V  # embedding, final norm, LM head
    assert expected == 125_848_320
    assert sum(p.numel() for p in model.parameters()) == expected


def test_tier1_corpus_on_the_command_line_takes_a_bare_path_a_comma_list_or_its_choice():
    """`--data.corpus /usr/include` was refused ("expected a list of str"): only the TOML list form parsed."""
    cases = (("/usr/include", ["/usr/include"]), ("/a, ./b", ["/a", "./b"]), ('["/x,y"]', ["/x,y"]),
             ('["src"]', ["src"]), ("system", "system"), ("none", None))
    for raw, want in cases:
        assert apply_overrides(preset("tiny"), [("data.corpus", raw)]).data.corpus == want, raw
    # A bare word is a choice or a mistake (a misspelt "system" must not become a missing directory).
    for raw in ("systen", "src", "/a,src"):
        with pytest.raises(ConfigError) as err:
            apply_overrides(preset("tiny"), [("data.corpus", raw)])
        assert str(err.value) == (f"command line --data.corpus: expected one of 'system' or paths (a path contains "
                                  f"'/': ./{raw}; several: a,b or [\"a\", \"b\"]), got {raw!r}")


def test_megacpp_config_shows_every_unset_key_and_no_derived_one(capsys):
    """TOML has no null: an unset key is a comment saying what it means (data.corpus among them), and
    model.vocab_size, which training takes from the tokenizer, is a comment too; setting it is refused."""
    from megacpp.cli import main

    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert "# corpus: unset, the C++ headers inside the installed torch (torch/include)" in out
    assert "# vocab_size: the tokenizer's vocabulary (data.vocab_size) when training" in out
    assert "\nvocab_size = 4096\n" not in out.split("[optim]")[0]
    assert main(["train", "--model.vocab_size", "100"]) == 2
    assert "command line --model.vocab_size: model.vocab_size is the tokenizer's vocabulary" in capsys.readouterr().err
