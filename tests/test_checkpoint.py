import hashlib
import json
import re

import pytest
import torch
from torch import nn

from megacpp.config import ConfigError, to_dict
from megacpp.distributed import checkpoint as dist_checkpoint
from megacpp.distributed.context import DistContext
from megacpp.presets import preset
from megacpp.run_config import from_dict, load_config
from megacpp.runtime.checkpoint import (
    CheckpointError,
    _sha256_each,
    latest_valid_checkpoint,
    list_checkpoints,
    load_checkpoint,
)
from megacpp.train.resume_rules import check_compatible, check_resume_settings


def _model(step: float) -> nn.Linear:
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.fill_(step)
        model.bias.copy_(torch.arange(3.0))
    return model


def _moments(step: float) -> dict[str, torch.Tensor]:
    return {"adamw/weight/exp_avg": torch.full((3, 4), 2 * step), "adamw/weight/step": torch.tensor(step)}


def _save(tmp_path, step, keep_last=3):
    return dist_checkpoint.save(DistContext(), tmp_path, step, _model(step), _moments(step),
                                {"step": step, "x": torch.tensor([step])},
                                {"config": {"model": {"depth": 4}}, "tokenizer_hash": "abc"}, keep_last)


def test_tier1_round_trip(tmp_path):
    path = _save(tmp_path, 5)
    model, state, meta = load_checkpoint(path)
    assert torch.equal(model["weight"], torch.full((3, 4), 5.0))
    assert torch.equal(state["x"], torch.tensor([5]))
    assert meta["step"] == 5 and meta["tokenizer_hash"] == "abc"
    fresh, moments = _model(0.0), _moments(0.0)
    train_state, _ = dist_checkpoint.load(DistContext(), path, fresh, moments)
    assert torch.equal(fresh.weight, torch.full((3, 4), 5.0)) and torch.equal(fresh.bias, torch.arange(3.0))
    assert all(torch.equal(moments[k], v) for k, v in _moments(5.0).items())
    assert train_state["step"] == 5
    assert any(name.startswith("optim/") for name in meta["files"]), "moments are hashed like every file"


def test_corrupt_moments_file_is_detected(tmp_path):
    path = _save(tmp_path, 4)
    shard = next((path / "optim").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"optim/.*corrupt"):
        load_checkpoint(path)


def test_failed_write_raises_and_keeps_previous_checkpoints(tmp_path, monkeypatch):
    """A write error (full disk, unwritable file) names the phase, removes the half-written
    directory and leaves the earlier checkpoints as they were."""
    good = _save(tmp_path, 1)

    def disk_full(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dist_checkpoint, "write_local_files", disk_full)
    with pytest.raises(CheckpointError, match=r"step 2 was not saved \(writing weights.*No space left"):
        _save(tmp_path, 2)
    assert [p.name for p in list_checkpoints(tmp_path)] == [good.name]
    assert not (tmp_path / "checkpoints" / "step_00000002.tmp").exists()
    load_checkpoint(good)


def test_keeps_last_k_newest_first(tmp_path):
    for step in (10, 20, 30, 40):
        _save(tmp_path, step, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000040", "step_00000030"]


def test_truncated_file_is_a_clear_error_and_resume_skips_it(tmp_path):
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    blob = newest / "model.safetensors"
    blob.write_bytes(blob.read_bytes()[:-7])
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(newest)
    warnings = []
    assert latest_valid_checkpoint(tmp_path, warn=warnings.append).name == "step_00000001"
    assert "truncated" in warnings[0]
    assert newest.exists(), "a broken checkpoint is reported, never deleted"


def test_corrupt_bytes_same_size(tmp_path):
    path = _save(tmp_path, 3)
    blob = path / "state.pt"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(path)


def test_incomplete_directory_without_meta(tmp_path):
    path = _save(tmp_path, 3)
    (path / "meta.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        load_checkpoint(path)


def _format2_without(meta, key):
    meta = {k: v for k, v in meta.items() if k not in ("meta_sha256", key)}
    return {**meta, "format": 2}


def _resealed_without_bytes(meta):
    """A format-3 meta whose own checksum matches but whose file entry lost its keys."""
    from megacpp.runtime.checkpoint import _meta_digest

    meta = {**meta, "files": {**meta["files"], "model.safetensors": {}}}
    return {**meta, "meta_sha256": _meta_digest(meta)}


@pytest.mark.parametrize("reshape", [
    lambda meta: [], lambda meta: None, lambda meta: "s", lambda meta: {"format": 2},
    lambda meta: _format2_without(meta, "config"), lambda meta: _format2_without(meta, "files"),
    lambda meta: {**_format2_without(meta, ""), "files": {"model.safetensors": {}}},
    _resealed_without_bytes,
], ids=["list", "null", "string", "format-only", "no-config", "no-files", "entry-without-bytes", "resealed"])
def test_tier1_valid_json_of_the_wrong_shape_is_corrupt_metadata(tmp_path, reshape):
    """meta.json that parses but is not the object readers index (AttributeError, KeyError 'files',
    'config' or 'bytes' before) gets broken JSON's error, and resume skips it like broken JSON."""
    path = _save(tmp_path, 1)
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps(reshape(meta)))
    with pytest.raises(CheckpointError, match=r"meta\.json: corrupt metadata \(") as err:
        load_checkpoint(path)
    assert "\n" not in str(err.value)
    warnings = []
    assert latest_valid_checkpoint(tmp_path, warn=warnings.append) is None
    assert len(warnings) == 1 and "corrupt metadata" in warnings[0]


def test_half_written_tmp_directory_is_ignored(tmp_path):
    _save(tmp_path, 1)
    (tmp_path / "checkpoints" / "step_00000009.tmp").mkdir()
    assert latest_valid_checkpoint(tmp_path).name == "step_00000001"


def test_incompatible_model_config_and_tokenizer(tmp_path):
    path = _save(tmp_path, 1)
    meta = json.loads((path / "meta.json").read_text())
    with pytest.raises(CheckpointError, match=r"model.depth: checkpoint 4 vs now 6"):
        check_compatible(meta, {"depth": 6}, "abc", path)
    with pytest.raises(CheckpointError, match="tokenizer"):
        check_compatible(meta, {"depth": 4}, "other", path)
    check_compatible(meta, {"depth": 4}, "abc", path)


def _resume_meta(cfg) -> dict:
    """A checkpoint's metadata as the trainer writes it, for check_resume_settings."""
    return {"config": to_dict(cfg), "global_batch": cfg.train.batch_size, "world_size": 1}


def test_tier1_resume_may_change_how_the_model_is_computed_not_what_it_is(tmp_path):
    """Settings of how the model is computed or bounded (the spectral cap, the scan's operands, MoE
    dispatch, the loss head's kernel) may change on resume and are returned for the log; its shape or
    meaning may not."""
    saved = preset("small")
    saved.model.rnn.w_spectral_cap, saved.model.mamba.scan_matmuls = 0.0, "fp32"
    saved.model.loss_kernel = "reference"
    now = preset("small")
    now.model.moe.dispatch = "padded"
    changed = check_resume_settings(_resume_meta(saved), to_dict(now), 1, tmp_path)
    assert sorted(changed) == [("loss_kernel", "reference", "auto"), ("mamba.scan_matmuls", "fp32", "activation"),
                               ("moe.dispatch", "auto", "padded"), ("rnn.w_spectral_cap", 0.0, 1.0)]
    assert check_resume_settings(_resume_meta(now), to_dict(now), 1, tmp_path) == []
    now.model.rnn.key_dim = 32
    with pytest.raises(CheckpointError, match=r"model.rnn.key_dim: checkpoint 64 vs now 32"):
        check_resume_settings(_resume_meta(saved), to_dict(now), 1, tmp_path)


def test_tier1_a_setting_the_checkpoint_predates_is_its_default(tmp_path):
    """A checkpoint written before a setting existed has no key for it: it trained with the behaviour
    the setting's default keeps, so it is compared as that default (resumable or not)."""
    cfg = preset("tiny")
    meta = _resume_meta(cfg)
    del meta["config"]["model"]["rnn"]["w_spectral_cap"], meta["config"]["model"]["mtp_depth"]
    assert check_resume_settings(meta, to_dict(cfg), 1, tmp_path) == []
    check_compatible(meta, to_dict(cfg.model), meta.get("tokenizer_hash"), tmp_path)
    cfg.model.rnn.w_spectral_cap = 1.0
    assert check_resume_settings(meta, to_dict(cfg), 1, tmp_path) == [("rnn.w_spectral_cap", 0.0, 1.0)]
    cfg.model.mtp_depth = 1
    with pytest.raises(CheckpointError, match=r"model.mtp_depth: checkpoint 0 vs now 1"):
        check_resume_settings(meta, to_dict(cfg), 1, tmp_path)


@pytest.mark.parametrize("saved_value", [False, True])
def test_tier1_a_setting_the_code_has_retired_is_dropped_from_a_saved_config(tmp_path, saved_value):
    """moe.fuse_shared_expert was written into checkpoints by the trees that had it; it changed no weight, so
    a resume, and every reader of a saved config, drops it instead of refusing the checkpoint. A file or the
    command line naming it is refused, saying it was removed."""
    cfg = preset("small")
    meta = _resume_meta(cfg)
    meta["config"]["model"]["moe"]["fuse_shared_expert"] = saved_value
    assert check_resume_settings(meta, to_dict(cfg), 1, tmp_path) == []
    check_compatible(meta, to_dict(cfg.model), meta.get("tokenizer_hash"), tmp_path)
    assert to_dict(from_dict(meta["config"])) == to_dict(cfg)
    assert meta["config"]["model"]["moe"]["fuse_shared_expert"] is saved_value  # the caller's dict is not edited
    with pytest.raises(ConfigError, match=r"'model.moe.fuse_shared_expert' was removed from megacpp .*: delete it"):
        load_config("small", overrides=[("model.moe.fuse_shared_expert", "true")])
    toml = tmp_path / "old.toml"
    toml.write_text('preset = "small"\n[model.moe]\nfuse_shared_expert = false\n')
    with pytest.raises(ConfigError, match=r"old.toml:3: 'model.moe.fuse_shared_expert' was removed"):
        load_config(path=toml)


def test_tier1_files_hashed_side_by_side_keep_each_files_own_digest(tmp_path):
    gen = torch.Generator().manual_seed(5)
    paths = []
    for i, size in enumerate([0, 1, 4099, 1 << 20, 3 * (1 << 20) + 7]):
        paths.append(tmp_path / f"f{i}")
        paths[-1].write_bytes(torch.randint(0, 256, (size,), generator=gen, dtype=torch.uint8).numpy().tobytes())
    expected = [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths]
    assert _sha256_each(paths) == expected
    assert _sha256_each(paths[::-1]) == expected[::-1]


@pytest.mark.parametrize("block", [3, 7, 4096, 65536])
def test_tier1_block_digests_are_the_sha256_of_each_blocks_sha256(tmp_path, block):
    """Written out with hashlib over slices of the bytes: odd file sizes, a short last block, an empty file
    (the sha256 of no digests), a file shorter than one block, and several files whose blocks are hashed
    together."""
    from megacpp.runtime.checkpoint import block_digests

    gen = torch.Generator().manual_seed(block)
    paths, expected = [], []
    for i, size in enumerate([0, 1, 7, 4099, 70001]):
        data = torch.randint(0, 256, (size,), generator=gen, dtype=torch.uint8).numpy().tobytes()
        paths.append(tmp_path / f"f{i}")
        paths[-1].write_bytes(data)
        tree = b"".join(hashlib.sha256(data[at:at + block]).digest() for at in range(0, size, block))
        expected.append(hashlib.sha256(tree).hexdigest())
    assert block_digests(paths, block) == expected
    assert block_digests(paths[::-1], block) == expected[::-1]


def test_tier1_a_byte_changed_in_any_block_is_found(tmp_path, monkeypatch):
    """With blocks of 32 bytes the weights file spans several; a byte flipped in its last block only (the
    first ones unchanged) still fails verification, and meta.json records the block size it was hashed with."""
    from megacpp.runtime import checkpoint

    monkeypatch.setattr(checkpoint, "HASH_BLOCK_BYTES", 32)
    path = _save(tmp_path, 3)
    meta = json.loads((path / "meta.json").read_text())
    weights = path / "model.safetensors"
    assert meta["format"] == 4 and meta["hash_block_bytes"] == 32 and weights.stat().st_size > 3 * 32
    monkeypatch.setattr(checkpoint, "HASH_BLOCK_BYTES", 1 << 28)  # verification reads the size from meta.json
    assert load_checkpoint(path)[2]["step"] == 3
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model.safetensors: corrupt \(sha256_blocks does not match"):
        load_checkpoint(path)


def _as_format3(path) -> None:
    """Rewrite a checkpoint's meta.json as megacpp wrote format 3: each file's sha256 over its whole bytes,
    no block size, the meta's own checksum sealed again."""
    from megacpp.runtime.checkpoint import _meta_digest

    meta = json.loads((path / "meta.json").read_text())
    meta = {k: v for k, v in meta.items() if k not in ("hash_block_bytes", "meta_sha256")}
    meta["format"] = 3
    meta["files"] = {name: {"bytes": entry["bytes"], "sha256": hashlib.sha256((path / name).read_bytes()).hexdigest()}
                     for name, entry in meta["files"].items()}
    meta["meta_sha256"] = _meta_digest(meta)
    (path / "meta.json").write_text(json.dumps(meta))


def test_tier1_a_format3_checkpoint_hashed_whole_still_verifies_and_loads(tmp_path):
    path = _save(tmp_path, 6)
    _as_format3(path)
    model, state, meta = load_checkpoint(path)
    assert meta["format"] == 3 and torch.equal(model["weight"], torch.full((3, 4), 6.0)) and state["step"] == 6
    assert latest_valid_checkpoint(tmp_path) == path
    data = bytearray((path / "state.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / "state.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"state.pt: corrupt \(sha256 does not match"):
        load_checkpoint(path)


@pytest.mark.parametrize("block_bytes", [None, 0, -64, "64", 1.5])
def test_tier1_a_format4_meta_without_a_positive_block_size_is_corrupt_metadata(tmp_path, block_bytes):
    from megacpp.runtime.checkpoint import _meta_digest

    path = _save(tmp_path, 2)
    meta = json.loads((path / "meta.json").read_text())
    meta = {k: v for k, v in meta.items() if k not in ("hash_block_bytes", "meta_sha256")}
    if block_bytes is not None:
        meta["hash_block_bytes"] = block_bytes
    meta["meta_sha256"] = _meta_digest(meta)
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"corrupt metadata \(.hash_block_bytes. is .*a positive integer"):
        load_checkpoint(path)


def test_tier1_a_save_logs_one_line_with_each_phases_time(tmp_path):
    lines = []
    path = dist_checkpoint.save(DistContext(), tmp_path, 5, _model(5), _moments(5), {"step": 5},
                                {"config": {"model": {"depth": 4}}, "tokenizer_hash": "abc"}, 3, log=lines.append)
    assert len(lines) == 1 and lines[0].startswith(f"checkpoint {path.name} written in ")
    found = re.fullmatch(r"checkpoint \S+ written in ([\d.]+) s: preparing the directory ([\d.]+) s, gathering the "
                         r"weights ([\d.]+) s, optimizer moments ([\d.]+) s, weights, state and hashes \(rank 0\) "
                         r"([\d.]+) s, publishing ([\d.]+) s", lines[0])
    assert found is not None, lines[0]
    total, *parts = map(float, found.groups())
    assert abs(total - sum(parts)) <= 0.05 * len(parts) + 1e-9  # each figure rounded to 0.1 s


def test_tier1_weights_that_share_storage_or_view_part_of_one_are_written_whole(tmp_path):
    from safetensors.torch import load_file

    from megacpp.runtime.checkpoint import write_local_files

    flat = torch.arange(20.0)
    tied = torch.randn(3, 4)
    state = {"tied.a": tied, "tied.b": tied, "part": flat[5:11].view(2, 3), "columns": torch.randn(4, 6)[:, ::2],
             "empty.a": torch.empty(0), "empty.b": torch.empty(0, 2)}
    write_local_files(tmp_path, state, {"step": 1})
    loaded = load_file(tmp_path / "model.safetensors")
    assert set(loaded) == set(state)
    assert all(torch.equal(loaded[name], tensor) for name, tensor in state.items())
