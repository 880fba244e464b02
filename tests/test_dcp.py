"""Sharded checkpoints (train.ckpt_format=dcp), with real train.py processes and gloo process groups on
the CPU: a chain of resumes 4 ranks (FSDP) -> 2 ranks (FSDP, asynchronous save) -> 1 process (full
format) -> 1 process (dcp, from the full file) whose losses equal the uninterrupted 4-rank run's;
sample.py's loader and scripts.convert_checkpoint on DCP directories; and the checkpoint module's
rules (discovery, rotation, temp cleanup, incomplete or foreign directories) on small DCP directories.

Every run keeps the global batch (train.global_batch_tokens) and so the data of each step; the world
size changes only how it is split into micro-batches, so the losses agree to float32 rounding of the
different reduction orders (relative 1e-5), not bit for bit."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from test_faults import file_size_limit
from test_train import ROOT, TINY, run, train_losses

from model.checkpoint import (DCP_META, CHECKPOINT_FORMAT, DcpSave, UnreadableCheckpoint, archive_newer_checkpoints,
                              checkpoint_files, config_dict, is_readable, load_checkpoint, load_model,
                              remove_stale_temp_files, save_checkpoint)
from model.gpt import GPT, GPTConfig
from scripts.convert_checkpoint import convert

STEPS = 6
ARGS = TINY + ["train.global_batch_tokens=512", f"train.max_steps={STEPS}", "train.keep_last=5"]
FSDP_DCP = ["train.parallel=fsdp", "train.ckpt_format=dcp"]


def train(out, *extra, ranks=0):
    return run("train.py", ARGS + [f"train.out_dir={out}", *extra], torchrun=ranks)


def copy_up_to(src, dest, step):
    """A copy of a run directory as it was at `step`: later checkpoints and the metrics dropped."""
    shutil.copytree(src, dest)
    for file in checkpoint_files(str(dest)):
        if int(os.path.basename(file)[5:].split(".")[0]) > step:
            shutil.rmtree(file) if os.path.isdir(file) else os.remove(file)
    os.remove(os.path.join(dest, "metrics.jsonl"))


def assert_close(losses, reference):
    for step, loss in losses.items():
        assert abs(loss - reference[step]) < 1e-5 * abs(reference[step]), (losses, reference)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """{name: run directory} of the resume chain, each resumed from the one before."""
    root = tmp_path_factory.mktemp("chain")
    dirs = {name: root / name for name in ("four", "two", "one", "back")}
    train(dirs["four"], *FSDP_DCP, "train.ckpt_interval=2", ranks=4)
    copy_up_to(dirs["four"], dirs["two"], 2)
    train(dirs["two"], *FSDP_DCP, "train.ckpt_interval=2", "train.ckpt_async=true", ranks=2)
    copy_up_to(dirs["two"], dirs["one"], 4)
    train(dirs["one"], "train.ckpt_interval=1")                            # full format, one process
    copy_up_to(dirs["one"], dirs["back"], 5)
    train(dirs["back"], "train.ckpt_format=dcp", "train.ckpt_interval=1")  # dcp, one process
    return dirs


@pytest.mark.distributed
@pytest.mark.slow
def test_resume_across_world_sizes_and_formats_matches_the_uninterrupted_run(chain):
    names = {d: sorted(os.listdir(chain[d])) for d in chain}
    assert names["four"] == ["ckpt_2.dcp", "ckpt_4.dcp", "ckpt_6.dcp", "config.yaml", "loss.png", "metrics.jsonl"]
    assert sorted(os.listdir(chain["four"] / "ckpt_6.dcp")) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", DCP_META]
    assert sorted(os.listdir(chain["two"] / "ckpt_6.dcp")) == [".metadata", "__0_0.distcp", "__1_0.distcp", DCP_META]
    assert [n for n in names["one"] if n.startswith("ckpt")] == ["ckpt_2.dcp", "ckpt_4.dcp", "ckpt_5.pt", "ckpt_6.pt"]
    assert [n for n in names["back"] if n.startswith("ckpt")] == ["ckpt_2.dcp", "ckpt_4.dcp", "ckpt_5.pt", "ckpt_6.dcp"]
    reference = train_losses(chain["four"])
    assert sorted(reference) == list(range(1, STEPS + 1))
    resumed = {d: train_losses(chain[d]) for d in ("two", "one", "back")}
    assert sorted(resumed["two"]) == [3, 4, 5, 6] and sorted(resumed["one"]) == [5, 6]
    assert sorted(resumed["back"]) == [6]
    for losses in resumed.values():
        assert_close(losses, reference)


@pytest.mark.distributed
@pytest.mark.slow
def test_checkpoint_time_and_size_are_logged(chain):
    with open(chain["two"] / "metrics.jsonl") as f:
        records = [r for r in map(json.loads, f) if "ckpt_seconds" in r]
    assert [r["ckpt_step"] for r in records] == [4, 6] and records[-1]["step"] == 6
    for r in records:           # asynchronous: training waited only for the copy, the write took longer
        assert 0 < r["ckpt_seconds"] <= r["ckpt_write_seconds"]
        size = sum(f.stat().st_size for f in (chain["two"] / f"ckpt_{r['ckpt_step']}.dcp").iterdir())
        assert r["ckpt_bytes"] == size


def plain(groups):
    """Optimizer param groups with tuples as lists (DCP stores AdamW's betas (0.9, 0.95) as a list)."""
    return [{k: list(v) if isinstance(v, tuple) else v for k, v in group.items()} for group in groups]


@pytest.mark.distributed
@pytest.mark.slow
def test_a_dcp_checkpoint_loads_and_converts_like_the_full_file(chain, tmp_path):
    """ckpt_6.dcp and ckpt_6.pt, written by one process each from the same state of step 5, load and
    convert to equal weights, optimizer and loader state; sample.py reads the 2-rank FSDP run's."""
    full_file, full = load_checkpoint(str(chain["one"] / "ckpt_6.pt"))
    model, _, _, file = load_model(str(chain["back"]), device="cpu")           # newest: ckpt_6.dcp
    assert file == str(chain["back"] / "ckpt_6.dcp")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, full["model"][name]), name
    out = tmp_path / "converted.pt"
    assert convert(str(chain["back"] / "ckpt_6.dcp"), str(out)) == str(chain["back"] / "ckpt_6.dcp")
    converted = torch.load(out, weights_only=False)
    assert sorted(converted) == sorted(full)
    tied = converted["model"]["lm_head.weight"], converted["model"]["wte.weight"]   # stored once, as in full
    assert tied[0].data_ptr() == tied[1].data_ptr() and os.path.getsize(out) < 1.01 * os.path.getsize(full_file)
    assert converted["loader"] == full["loader"] and converted["step"] == 6
    assert plain(converted["optimizer"]["param_groups"]) == plain(full["optimizer"]["param_groups"])
    torch.testing.assert_close(converted["optimizer"]["state"], full["optimizer"]["state"], rtol=0, atol=0)
    with pytest.raises(ValueError, match="exists; pass a new file name"):
        convert(str(chain["back"]), str(out))
    proc = run("sample.py", [f"ckpt={chain['two']}", "prompt=The", "max_new_tokens=4"])
    assert "The" in proc.stdout


@pytest.mark.distributed
@pytest.mark.slow
def test_a_dcp_write_past_the_file_size_limit_fails_cleanly(chain, tmp_path):
    """The shard write fails part-way (EFBIG, as ENOSPC would): one line naming the checkpoint, the
    temp directory removed, the earlier checkpoints untouched."""
    out = tmp_path / "run"
    copy_up_to(chain["two"], out, 4)
    before = {name: sorted(os.listdir(out / name)) for name in ("ckpt_2.dcp", "ckpt_4.dcp")}
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    args = [a for a in ARGS if not a.startswith("WANDB_MODE")]
    proc = subprocess.run([sys.executable, "train.py", *args, f"train.out_dir={out}", "train.ckpt_format=dcp",
                           "train.ckpt_interval=2"], cwd=ROOT, env=env, capture_output=True, text=True,
                          preexec_fn=file_size_limit(8 << 20), timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr and last.startswith(f"train.py: error: could not write {out / 'ckpt_6.dcp'}: "
                                                              "File too large"), proc.stderr[-3000:]
    assert sorted(n for n in os.listdir(out) if n.startswith("ckpt")) == ["ckpt_2.dcp", "ckpt_4.dcp"]
    assert {name: sorted(os.listdir(out / name)) for name in before} == before
    assert all(is_readable(str(out / name)) for name in before)


# ----------------------------------------------------------------------------- the checkpoint module

CONFIG = GPTConfig(n_layer=1, n_embd=16, n_head=2, head_dim=8, vocab_size=64, block_size=8, tokenizer_vocab_size=50)


def save_dcp(run_dir, step, config=CONFIG, keep_last=100, meta_config=None):
    """A one-process DCP checkpoint of a fresh GPT of `config` (meta.pt naming `meta_config`)."""
    model = GPT(config)
    contents = {"model_config": config_dict(meta_config or config), "config": {}, "loader": {"position": step}}
    save = DcpSave(str(run_dir), step, contents, keep_last, master=True)
    save.write({"model": model.state_dict(), "optimizer": {"state": {}, "param_groups": []}})
    return save.finish(), model


def steps_in(run_dir):
    return [int(os.path.basename(f)[5:].split(".")[0]) for f in checkpoint_files(str(run_dir))]


def test_a_dcp_directory_loads_in_full_in_one_process(tmp_path):
    path, model = save_dcp(tmp_path, 3)
    assert path == str(tmp_path / "ckpt_3.dcp") and sorted(os.listdir(tmp_path)) == ["ckpt_3.dcp"]
    file, ckpt = load_checkpoint(str(tmp_path))
    assert file == path and ckpt["format"] == CHECKPOINT_FORMAT and ckpt["step"] == 3 and "dcp" not in ckpt
    for name, tensor in model.state_dict().items():
        assert torch.equal(ckpt["model"][name], tensor)
    _, meta = load_checkpoint(path, dcp_parts=())
    assert meta["dcp"] == path and "model" not in meta
    _, weights = load_checkpoint(path, dcp_parts=("model",))           # what sample.py and eval.py read
    assert "optimizer" not in weights and torch.equal(weights["model"]["wte.weight"], model.wte.weight)


def test_rotation_and_discovery_treat_dcp_directories_like_files(tmp_path, capsys):
    for step in (2, 4):
        save_dcp(tmp_path, step)
    save_checkpoint(str(tmp_path), 6, {"model": {"w": torch.randn(3)}}, keep_last=100)
    broken, _ = save_dcp(tmp_path, 5)
    os.remove(os.path.join(broken, ".metadata"))
    save_dcp(tmp_path, 40)                               # a later run's, newer than anything written here
    (tmp_path / "ckpt_8.dcp.tmp").mkdir()                # a killed writer's
    (tmp_path / "ckpt_9.dcp").write_bytes(b"a file, not a checkpoint directory")
    save_dcp(tmp_path, 7, keep_last=3)                   # keeps 7 and the two newest readable older ones
    assert steps_in(tmp_path) == [4, 6, 7, 40]
    assert (tmp_path / "ckpt_9.dcp").is_file() and (tmp_path / "ckpt_8.dcp.tmp").is_dir()
    remove_stale_temp_files(str(tmp_path))
    assert not (tmp_path / "ckpt_8.dcp.tmp").exists() and "ckpt_8.dcp.tmp" in capsys.readouterr().err
    archive_newer_checkpoints(str(tmp_path), 7)          # resuming at 7 moves 40 aside, whole
    archived = [d for d in (tmp_path / "archive").iterdir()]
    assert len(archived) == 1 and is_readable(str(archived[0] / "ckpt_40.dcp"))
    assert steps_in(tmp_path) == [4, 6, 7]


def test_a_dcp_save_of_an_existing_step_archives_the_old_directory(tmp_path):
    """A directory cannot be replaced by one rename: the old one moves to archive/ first, so a crash between
    the two renames loses nothing (the new one is then a complete temp directory, the old one archived)."""
    old, old_model = save_dcp(tmp_path, 3)
    new, new_model = save_dcp(tmp_path, 3)
    assert new == old and steps_in(tmp_path) == [3]
    assert torch.equal(load_checkpoint(new)[1]["model"]["wte.weight"], new_model.wte.weight)
    (archived,) = (tmp_path / "archive").iterdir()
    assert archived.name.endswith("-replaced")
    _, ckpt = load_checkpoint(str(archived / "ckpt_3.dcp"))
    assert torch.equal(ckpt["model"]["wte.weight"], old_model.wte.weight)
    assert not torch.equal(old_model.wte.weight, new_model.wte.weight)


@pytest.mark.parametrize("missing", ["__0_0.distcp", ".metadata", DCP_META])
def test_an_incomplete_dcp_directory_is_named_and_skipped(tmp_path, capsys, missing):
    good, _ = save_dcp(tmp_path, 2)
    newest, _ = save_dcp(tmp_path, 4)
    os.remove(os.path.join(newest, missing))
    with pytest.raises(UnreadableCheckpoint, match=f"{os.path.join(newest, missing)} is missing.*"
                                                   f"the newest readable checkpoint beside it is {good}"):
        load_checkpoint(newest)
    file, ckpt = load_checkpoint(str(tmp_path))          # discovery: the newest readable one, with a warning
    assert file == good and ckpt["step"] == 2
    assert f"skipping {os.path.join(newest, missing)} is missing" in capsys.readouterr().err
    assert steps_in(tmp_path) == [2, 4]                  # nothing deleted


def test_a_cut_short_shard_is_named(tmp_path):
    path, _ = save_dcp(tmp_path, 2)
    shard = os.path.join(path, "__0_0.distcp")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    with pytest.raises(UnreadableCheckpoint, match=f"{shard} is cut short"):
        load_checkpoint(path)


def test_a_dcp_directory_of_another_model_is_refused(tmp_path):
    other = GPTConfig(**{**config_dict(CONFIG), "n_embd": 32, "n_head": 4})
    path, _ = save_dcp(tmp_path, 2, config=other, meta_config=CONFIG)     # shards of another model
    with pytest.raises(UnreadableCheckpoint, match=r"\.metadata holds model\.wte\.weight of shape \(64, 32\), "
                                                   r"but the model has \(64, 16\): it was written by another model"):
        load_model(path, device="cpu")
