"""The configuration gate: every merge path ends in it, and each error names the key and its source."""
import pytest

from megacpp import cli
from megacpp.config import Config, ConfigError, to_dict
from megacpp.model.pattern import PatternError
from megacpp.presets import PRESETS
from megacpp.run_config import from_dict, load_config
from megacpp.validate import validate_config


def _toml(tmp_path, text: str):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def _line_of(path, fragment: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if fragment in line)


def test_presets_and_defaults_pass_the_gate():
    validate_config(Config())
    for make in PRESETS.values():
        validate_config(make())


# One bad value of each kind, set on the command line: the error leads with `--key`, names the key,
# and quotes each other key the rule involves with its source (here the tiny preset).
BAD_OVERRIDES = [
    # range
    ("train.steps", "0", "must be >= 1", None),
    ("optim.adamw_lr", "-0.1", "must be >= 0", None),
    ("optim.muon_lr", "nan", "must be a finite number >= 0", None),
    ("data.val_fraction", "1.0", "must be in [0, 1)", None),
    ("dist.step_timeout_s", "0", "must be > 0", None),
    # Literal
    ("compile.mode", "blokcs", "expected one of 'none', 'model', 'blocks', got 'blokcs'", None),
    ("optim.decay_shape", "cos", "expected one of 'linear', 'cosine'", None),
    ("model.moe.dispatch", "dropless", "expected one of 'auto', 'padded', 'grouped'", None),
    # form
    ("train.device", "gpu", "must be auto, cpu, cuda or cuda:N", None),
    # divisibility
    ("model.attention.n_kv_heads", "3", "n_heads must be a multiple of n_kv_heads", "model.attention.n_heads = 4"),
    ("model.mamba.head_dim", "48", "head_dim must divide Mamba-3's inner width", "model.d_model = 128"),
    # cross-field
    ("model.moe.top_k", "9", "top_k must be <= n_experts", "model.moe.n_experts = 8"),
    ("data.seq_len", "9000", "exceeds model.attention.max_seq_len", "model.attention.max_seq_len = 8192"),
    ("optim.warmup_steps", "300", "schedule does not fit the run", "train.steps = 200"),
    # layer index
    ("model.engram.layers", "[3, 10]", "block indices [10] are outside [0, depth)", "model.depth = 10"),
    # an optimizer's own setting, ranged by its OptimizerSpec; a block section's rule, by its dataclass
    ("optim.ns_steps", "0", "must be >= 1", None),
    ("optim.adamw_beta2", "1.0", "must be in [0, 1)", None),
    ("model.rnn.A_init_min", "20", "A_init_min must be <= A_init_max: they bound an init range",
     "model.rnn.A_init_max = 16.0"),
    ("model.mamba.rope_fraction", "0.05", "rope_fraction * d_state must cover at least one pair",
     "model.mamba.d_state = 16"),
    # learning-rate factors per block kind: form, kind, factor, repetition; a kind the pattern lacks
    ("optim.lr_scale_by_kind", "M", "entry 'M' is not <kind>=<factor>", None),
    ("optim.lr_scale_by_kind", "Q=0.5", "with a kind among A, M, R, E, F", None),
    ("optim.lr_scale_by_kind", "M=fast", "entry 'M=fast': factor 'fast' is not a number", None),
    ("optim.lr_scale_by_kind", "M=-0.5", "entry 'M=-0.5': the factor must be a finite number >= 0", None),
    ("optim.lr_scale_by_kind", "R=inf", "entry 'R=inf': the factor must be a finite number >= 0", None),
    ("optim.lr_scale_by_kind", "R=nan", "entry 'R=nan': the factor must be a finite number >= 0", None),
    ("optim.lr_scale_by_kind", "M=0.5,M=1", "entry 'M=1': kind M is given more than once", None),
    ("optim.expert_ns_steps", "0", "must be >= 1", None),
]


@pytest.mark.parametrize(("key", "raw", "why", "other"), BAD_OVERRIDES, ids=[b[0] for b in BAD_OVERRIDES])
def test_bad_override_names_key_and_command_line(key, raw, why, other):
    with pytest.raises(ConfigError) as err:
        load_config("tiny", overrides=[(key, raw)])
    msg = str(err.value)
    assert msg.startswith(f"command line --{key}: ") and why in msg
    if other is not None:
        assert f"{other} (preset 'tiny')" in msg


def test_grouped_moe_dispatch_is_gated_with_the_keys_it_needs():
    """dispatch = grouped forces the dropless GEMMs: expert choice or misaligned widths cannot serve it."""
    with pytest.raises(ConfigError) as err:
        load_config("tiny", overrides=[("model.moe.routing", "expert_choice"), ("model.moe.dispatch", "grouped")])
    assert str(err.value).startswith("command line --model.moe.") and "token_choice" in str(err.value)
    with pytest.raises(ConfigError, match="multiples of 8"):
        load_config("tiny", overrides=[("model.moe.expert_hidden", "100"), ("model.moe.dispatch", "grouped")])
    load_config("tiny", overrides=[("model.moe.dispatch", "grouped")])  # token choice, 128 wide: fine


def test_expert_ns_steps_is_refused_where_the_experts_are_not_on_muon():
    """The experts' Newton-Schulz iterations change nothing for experts on AdamW: an error naming both keys."""
    with pytest.raises(ConfigError) as err:
        load_config("tiny", overrides=[("optim.expert_ns_steps", "3"), ("optim.expert_optimizer", "adamw")])
    msg = str(err.value)
    assert msg.startswith("command line --optim.expert_") and "would change nothing" in msg
    assert "optim.expert_ns_steps = 3" in msg and "optim.expert_optimizer = 'adamw'" in msg
    with pytest.raises(ConfigError, match="would change nothing"):
        load_config("tiny", overrides=[("optim.expert_ns_steps", "3"), ("optim.use_muon", "false")])
    cfg, _ = load_config("tiny", overrides=[("optim.expert_ns_steps", "3")])
    assert cfg.optim.expert_ns_steps == 3


def test_bad_toml_values_name_file_and_line(tmp_path):
    """A range error, a divisibility error and a layer index, each read from the file: file:line leads."""
    cases = [
        ("[train]\neval_every = 0\n", "eval_every", "train.eval_every = 0 must be >= 1"),
        ("[model.mamba]\nexpand = 2\nhead_dim = 48\n", "head_dim", "model.mamba.head_dim = 48: head_dim must divide"),
        ('preset = "tiny"\n[model.engram]\nlayers = [12]\n', "layers", "block indices [12] are outside"),
    ]
    for text, fragment, expected in cases:
        path = _toml(tmp_path, text)
        with pytest.raises(ConfigError) as err:
            load_config(path=path)
        assert str(err.value).startswith(f"{path}:{_line_of(path, fragment)}: ") and expected in str(err.value)


def test_cross_field_error_leads_with_the_key_the_user_set_and_sources_the_other(tmp_path):
    path = _toml(tmp_path, "[model.attention]\nmax_seq_len = 128\n")
    with pytest.raises(ConfigError) as err:
        load_config("tiny", path, overrides=[("data.seq_len", "512")])
    msg = str(err.value)
    assert msg.startswith("command line --data.seq_len: data.seq_len = 512: ")
    assert f"model.attention.max_seq_len = 128 ({path}:2)" in msg


def test_gate_runs_after_the_toml_merge(tmp_path):
    """A bad value that only the file sets is caught, naming the file's line."""
    path = _toml(tmp_path, 'preset = "tiny"\n\n[model.moe]\ntop_k = 12\n')
    with pytest.raises(ConfigError, match=rf"^{path}:4: model.moe.top_k = 12: top_k must be <= n_experts"):
        load_config(path=path)


def test_gate_runs_after_the_command_line_and_judges_the_final_result(tmp_path):
    """The file alone is valid and the override breaks it: caught. The file alone is invalid and the
    override repairs it: accepted, since the gate judges the merged result, not each layer."""
    valid = _toml(tmp_path, "[model.attention]\nn_heads = 4\nn_kv_heads = 2\n")
    with pytest.raises(ConfigError, match=r"^command line --model.attention.n_heads: .*multiple of n_kv_heads"):
        load_config("tiny", valid, overrides=[("model.attention.n_heads", "5")])
    repaired = _toml(tmp_path, "[model.attention]\nn_heads = 6\nn_kv_heads = 4\n")
    cfg, sources = load_config("tiny", repaired, overrides=[("model.attention.n_kv_heads", "3")])
    assert (cfg.model.attention.n_heads, cfg.model.attention.n_kv_heads) == (6, 3)
    assert sources.source("model.attention.n_heads") == f"{repaired}:2"
    assert sources.source("model.attention.n_kv_heads") == "command line --model.attention.n_kv_heads"
    assert sources.source("model.d_model") == "preset 'tiny'"


def test_block_rules_apply_only_to_blocks_the_pattern_uses():
    """d_model 100 leaves Mamba-3's 200-wide inner width indivisible by head_dim 32: an error with M in
    the pattern, nothing without (the model never reads model.mamba then)."""
    with pytest.raises(ConfigError, match="model.d_model = 100: head_dim must divide"):
        load_config("tiny", overrides=[("model.d_model", "100")])
    cfg, _ = load_config("tiny", overrides=[("model.d_model", "100"), ("model.pattern", "AEFR")])
    assert cfg.model.d_model == 100


def test_pattern_problems_stay_pattern_errors_with_their_source():
    with pytest.raises(PatternError, match=r"^command line --model.pattern: model.pattern = 'AEXM' .*position 2"):
        load_config("tiny", overrides=[("model.pattern", "AEXM")])
    with pytest.raises(PatternError, match=r"^command line --model.depth: model.depth = 3: depth 3 cannot fill"):
        load_config("tiny", overrides=[("model.depth", "3")])


def test_preset_on_command_line_and_in_file_must_agree(tmp_path):
    path = _toml(tmp_path, 'preset = "small"\n[train]\nsteps = 10\n')
    with pytest.raises(ConfigError) as err:
        load_config("tiny", path)
    msg = str(err.value)
    assert "--preset tiny" in msg and f"preset = 'small' at {path}:1" in msg
    cfg, sources = load_config("small", path)
    assert (cfg.model.d_model, cfg.train.steps) == (768, 10)
    assert sources.source("model.d_model") == "preset 'small'"


def test_lr_scale_by_kind_takes_both_list_spellings_and_only_kinds_the_pattern_uses(tmp_path):
    """A list on the command line (comma-separated or TOML) and in a file; [] or "" is none. A factor for a
    kind the pattern lacks would do nothing: an error quoting the pattern and its source."""
    for raw in ("M=0.5,R=0.25", '["M=0.5", "R=0.25"]'):
        cfg, _ = load_config("tiny", overrides=[("optim.lr_scale_by_kind", raw)])
        assert cfg.optim.lr_scale_by_kind == ["M=0.5", "R=0.25"]
    assert load_config("tiny", overrides=[("optim.lr_scale_by_kind", "")])[0].optim.lr_scale_by_kind == []
    assert Config().optim.lr_scale_by_kind == []
    with pytest.raises(ConfigError) as err:
        load_config("dense", overrides=[("optim.lr_scale_by_kind", "F=0.5,R=0.5")])
    msg = str(err.value)
    assert msg.startswith("command line --optim.lr_scale_by_kind: optim.lr_scale_by_kind = ['F=0.5', 'R=0.5']: ")
    assert "block kind(s) R do not occur in the pattern" in msg and "model.pattern = 'AF' (preset 'dense')" in msg
    path = _toml(tmp_path, 'preset = "tiny"\n[optim]\nlr_scale_by_kind = ["M=0.5", "R=-1"]\n')
    with pytest.raises(ConfigError, match=rf"^{path}:3: optim.lr_scale_by_kind = \['M=0.5', 'R=-1'\] .*'R=-1'"):
        load_config(path=path)
    cfg = PRESETS["tiny"]()
    cfg.optim.lr_scale_by_kind = ["E=2", "F"]
    with pytest.raises(ConfigError, match=r"^optim.lr_scale_by_kind = \['E=2', 'F'\] .*entry 'F'"):
        validate_config(cfg)


def test_checkpoint_config_is_gated_with_its_meta_json_as_source(tmp_path):
    data = to_dict(PRESETS["tiny"]())
    data["model"]["moe"]["top_k"] = 20
    meta = str(tmp_path / "step_00000002" / "meta.json")
    with pytest.raises(ConfigError, match=rf"^{meta}: model.moe.top_k = 20: top_k must be <= n_experts"):
        from_dict(data, source=meta)


def test_config_built_in_python_is_gated_without_a_source():
    """The Trainer's entry: no merge has checked these values, so the gate checks types and choices too."""
    cfg = PRESETS["tiny"]()
    cfg.compile.mode = "blokcs"
    with pytest.raises(ConfigError, match=r"^compile.mode: expected one of 'none', 'model', 'blocks'"):
        validate_config(cfg)


def test_cli_train_with_a_bad_value_is_one_line_and_does_no_data_work(tmp_path, capsys):
    cache, out = tmp_path / "cache", tmp_path / "run"
    code = cli.main(["train", "--data.cache_dir", str(cache), "--train.out_dir", str(out),
                     "--model.moe.top_k", "99"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("megacpp: config error: command line --model.moe.top_k: ")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not cache.exists() and not out.exists()


def test_cli_preset_conflict_is_a_usage_error(tmp_path, capsys):
    path = _toml(tmp_path, 'preset = "small"\n')
    assert cli.main(["config", "--preset", "tiny", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--preset tiny" in err and "'small'" in err


def test_cli_os_error_on_a_user_path_is_one_line(monkeypatch, capsys):
    def refuse(args, cfg):
        raise PermissionError(13, "Permission denied", "/runs/locked")

    monkeypatch.setattr(cli, "cmd_config", refuse)
    assert cli.main(["config"]) == 1
    assert capsys.readouterr().err == "megacpp: error: Permission denied: /runs/locked\n"


def test_cli_keeps_the_traceback_of_a_bug(monkeypatch):
    """Only explained errors become one line; anything else is a megacpp bug and must stay loud."""
    def bug(args, cfg):
        raise KeyError("oops")

    monkeypatch.setattr(cli, "cmd_config", bug)
    with pytest.raises(KeyError):
        cli.main(["config"])


def test_cli_config_file_that_is_a_directory_or_not_utf8(tmp_path, capsys):
    assert cli.main(["config", "--config", str(tmp_path)]) == 2
    assert "is not a file" in capsys.readouterr().err
    binary = tmp_path / "bad.toml"
    binary.write_bytes(b"[model]\ndepth = \xff\n")
    assert cli.main(["config", "--config", str(binary)]) == 2
    err = capsys.readouterr().err
    assert "not UTF-8" in err and "Traceback" not in err


@pytest.mark.parametrize(("overrides", "lead", "why"), [
    ([("train.seed", "99999999999999999999")], "train.seed", "must be in [0, 18446744073709551615]"),
    ([("train.seed", "-1")], "train.seed", "must be in [0, 18446744073709551615]"),
    ([("data.shuffle_seed", "18446744073709551616")], "data.shuffle_seed", "must be in [0, 18446744073709551615]"),
    ([("train.seed", str(2**64 - 1)), ("data.shuffle_seed", "1")], "data.shuffle_seed",
     "train.seed + data.shuffle_seed seeds the data loader and must be <= 18446744073709551615"),
])
def test_tier1_seeds_are_unsigned_64_bit(overrides, lead, why):
    """torch's manual_seed takes an unsigned 64-bit seed: a larger one passed the gate and died in torch."""
    with pytest.raises(ConfigError) as err:
        load_config("tiny", overrides=overrides)
    assert str(err.value).startswith(f"command line --{lead}: ") and why in str(err.value)
    load_config("tiny", overrides=[("train.seed", str(2**64 - 1))])  # the largest seed is fine


@pytest.mark.parametrize("depth", ["99999999999999999999", "10001"])
def test_tier1_depth_has_an_upper_bound(depth):
    """Expanding the pattern to depth 99999999999999999999 raised OverflowError in the gate itself."""
    with pytest.raises(ConfigError) as err:
        load_config("tiny", overrides=[("model.depth", depth)])
    assert str(err.value).startswith(f"command line --model.depth: model.depth = {depth} must be in [1, 10000]")
    load_config("tiny", overrides=[("model.depth", "10000")])


def test_tier1_cli_config_with_a_huge_depth_is_one_line(capsys):
    assert cli.main(["config", "--preset", "tiny", "--model.depth", "99999999999999999999"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "must be in [1, 10000]" in err


@pytest.mark.parametrize("raw", ["", "[]", '[" "]'])
def test_tier1_a_corpus_that_names_no_path_is_refused(raw):
    with pytest.raises(ConfigError) as err:
        load_config("tiny", overrides=[("data.corpus", raw)])
    assert str(err.value).startswith("command line --data.corpus: data.corpus = ")
    assert "names no path; expected one or more files or directories" in str(err.value)
