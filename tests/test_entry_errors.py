"""Bad input to train.py, sample.py and eval.py: every option's type and range is checked before any
work, the message names the option (or file) and the fix, and the entry points print it as one line
and exit 2 without a traceback (bugs keep theirs)."""
import os
import random
import socket
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf, open_dict

import eval as eval_script
import sample
import train
from model.checkpoint import CHECKPOINT_FORMAT, config_dict
from model.gpt import GPTConfig
from model.runtime import (
    CONFIG_DIR,
    checked,
    choose_device,
    entry_point,
    groups_with_option,
    integer,
    listed,
    number,
    one_of,
    optional,
    quote_literal,
)

ROOT = os.path.dirname(CONFIG_DIR)


def compose_config(name, overrides):
    """An entry point's config as its job sees it (the hydra: resolver of train.out_dir answers)."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name=name, overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def error_of(check, cfg):
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        check(cfg)
    return str(info.value)


# ----------------------------------------------------------------------------- the option rules

def refusal(value, rule):
    with pytest.raises(ValueError) as info:
        checked(value, "x.opt", rule)
    return str(info.value)


def test_checked_returns_what_keeps_the_rule_and_names_the_option_otherwise():
    low = random.randint(-5, 5)
    inside = random.randint(low, low + 10)
    assert checked(inside, "x.opt", integer(low)) == inside
    assert refusal(low - 1, integer(low)) == f"x.opt={low - 1} is invalid: it must be an integer >= {low}"
    assert refusal(True, integer(0)) == "x.opt=true is invalid: it must be an integer >= 0"   # bool is no int
    assert refusal(2.0, integer(0)).endswith("an integer >= 0")
    assert checked(None, "x.opt", optional(integer(1))) is None
    assert refusal(None, integer(1)) == "x.opt=null is invalid: it must be an integer >= 1"
    assert refusal(0, optional(integer(1))).endswith("an integer >= 1, or null")


def test_number_bounds_open_and_closed():
    frac = random.uniform(0.01, 0.99)
    assert checked(frac, "x.opt", number(above=0, below=1)) == frac
    for edge in (0, 1, 1.0):
        assert refusal(edge, number(above=0, below=1)).endswith("it must be a number > 0 and < 1")
    assert checked(1, "x.opt", number(0, 1)) == 1.0 and type(checked(1, "x.opt", number(0, 1))) is float
    assert refusal(False, number(0, 1)).endswith("a number >= 0 and <= 1")
    assert checked(None, "x.opt", optional(number(0))) is None


def test_listed_takes_a_list_or_one_item_and_checks_every_item():
    modes = listed(one_of("standard", "easy"))
    assert checked(["easy", "standard"], "x.opt", modes) == ["easy", "standard"]
    assert checked(OmegaConf.create(["easy"]), "x.opt", modes) == ["easy"]
    assert checked("easy", "x.opt", modes) == ["easy"]                    # one item: a one-item list
    assert refusal(["easy", "hard"], modes) == ("x.opt=[easy,hard] is invalid: it must be a non-empty list, "
                                                "each one of standard, easy")
    assert refusal([], modes).startswith("x.opt=[] is invalid: it must be a non-empty list")
    assert checked([], "x.opt", listed(number(), empty=True)) == []
    assert checked([0, 50], "x.opt", listed(number(0, 100))) == [0.0, 50.0]
    assert refusal([1, True], listed(integer(1))).endswith("a non-empty list, each an integer >= 1")
    depths = optional(listed(number(0, 100)))
    assert checked(None, "x.opt", depths) is None
    assert refusal([50, 150], depths).endswith("each a number >= 0 and <= 100, or null")


# ----------------------------------------------------------------------------- train.py

@pytest.mark.parametrize("override,expected", [
    ("train.max_steps=abc", "train.max_steps=abc is invalid: it must be an integer >= 1"),
    ("train.max_steps=0", "train.max_steps=0 is invalid: it must be an integer >= 1"),
    ("train.max_steps=2.5", "train.max_steps=2.5"),
    ("train.max_steps=true", "train.max_steps=true"),
    ("train.seq_len=-4", "train.seq_len=-4"),
    ("train.micro_batch_size=0", "train.micro_batch_size=0"),
    ("train.global_batch_tokens=0", "train.global_batch_tokens=0 is invalid: it must be an integer >= 1, or null"),
    ("train.keep_last=0", "train.keep_last=0"),
    ("train.ckpt_interval=x", "train.ckpt_interval=x"),
    ("train.log_interval=0", "train.log_interval=0"),
    ("train.eval_interval=-1", "train.eval_interval=-1"),
    ("train.eval_tokens=0", "train.eval_tokens=0"),
    ("train.sample_tokens=-1", "train.sample_tokens=-1 is invalid: it must be an integer >= 0"),
    ("train.seed=-1", "train.seed=-1"),
    ("train.peak_flops=0", "train.peak_flops=0 is invalid: it must be a number > 0"),
    ("train.dtype=fp16", "train.dtype=fp16 is invalid: it must be one of auto, bf16, fp32"),
    ("train.compile=maybe", "train.compile=maybe is invalid: it must be one of auto, true, false"),
    ("train.parallel=tp", "train.parallel=tp is invalid: it must be one of ddp, fsdp"),
    ("train.sdpa_backend=fast", "train.sdpa_backend=fast"),
    ("train.if_exists=overwrite", "train.if_exists=overwrite is invalid: it must be one of error, archive"),
    ("train.device=gpu", "train.device=gpu is invalid: it must be auto, cpu, cuda or cuda:N"),
    ("train.wandb.mode=on", "train.wandb.mode=on"),
    ("train.out_dir=", "train.out_dir= is invalid: it must be a non-empty string"),
    ("optim.lr=-1", "optim.lr=-1 is invalid: it must be a number > 0"),
    ("optim.lr=fast", "optim.lr=fast"),
    ("optim.betas=[0.9]", "optim.betas=[0.9] is invalid: it must be two values [a, b], each a number >= 0 and <= 1"),
    ("optim.betas=[0.9,1.5]", "optim.betas=[0.9,1.5]"),
    ("optim.eps=0", "optim.eps=0"),
    ("optim.weight_decay=-0.1", "optim.weight_decay=-0.1"),
    ("optim.grad_clip=0", "optim.grad_clip=0"),
    ("optim.warmup_steps=-1", "optim.warmup_steps=-1"),
    ("optim.min_lr_ratio=2", "optim.min_lr_ratio=2 is invalid: it must be a number >= 0 and <= 1"),
    ("optim.warmup_steps=null", "optim.warmup_steps and optim.warmup_tokens are both null; set one of them"),
    ("train.resume=/no/such/ckpt_3.pt", "train.resume=/no/such/ckpt_3.pt does not exist; use auto, never"),
])
def test_train_option_errors_name_the_option_and_what_it_takes(override, expected):
    assert expected in error_of(train.check_train_options, compose_config("config", [override]))


def test_every_train_and_optim_option_is_checked():
    cfg = compose_config("config", [])
    options = train.flatten(OmegaConf.to_container(cfg, resolve=True))
    assert set(train.OPTIONS) == {k for k in options if k.split(".")[0] in ("train", "optim")}
    train.check_train_options(cfg)                      # the defaults pass


def test_a_val_split_too_small_for_one_micro_batch_is_refused_before_training(tmp_path):
    """The bundled sample holds 24,576 validation tokens: a paper recipe's 16 x 2048 micro-batch is refused up
    front (it used to train to the end and fail at the final evaluation, before the last checkpoint)."""
    data = ["data=sample", f"data.dir={tmp_path}"]
    message = error_of(train.check_val_split, compose_config("config", data + ["train.seq_len=2048"]))
    assert "train.seq_len=2048 is out of range" in message and "choose train.seq_len in [1, 1535]" in message
    message = error_of(train.check_val_split, compose_config("config", data + ["train.micro_batch_size=30000"]))
    assert "train.micro_batch_size=30000 is too large" in message
    train.check_val_split(compose_config("config", data + ["train.seq_len=1535"]))        # one batch fits


@pytest.mark.parametrize("model", ["llama", "gpt2", "castle", "castle_swl", "fox_pro"])
def test_block_size_below_seq_len_is_refused_for_every_position_type(model):
    """RoPE tables, learned positions, CASTLE: a context longer than block_size never trains silently."""
    cfg = compose_config("config", [f"model={model}", "model.block_size=32", "train.seq_len=64"])
    message = error_of(train.build_model_config, cfg)
    assert "model.block_size=32 is smaller than train.seq_len=64" in message and "set it >= train.seq_len" in message


@pytest.mark.parametrize("override,expected", [
    ("model.n_layer=abc", "model.n_layer=abc is invalid: it must be an integer"),
    ("model.head_dim=1.5", "model.head_dim=1.5 is invalid: it must be an integer or null"),
    ("model.tie_embeddings=1", "model.tie_embeddings=1 is invalid: it must be true or false"),
    ("model.vocab_size=1000", "model.vocab_size=1000 is smaller than the tokenizer's 50257 tokens"),
    ("model.pos=alibi", "model.pos='alibi' is unknown"),
])
def test_model_option_errors(override, expected):
    assert expected in error_of(train.build_model_config, compose_config("config", [override]))


def test_train_sets_the_tokenizer_vocabulary_of_the_model():
    config = train.build_model_config(compose_config("config", []))
    assert config.tokenizer_vocab_size == 50257 < config.vocab_size


def fake_checkpoint(path, model_config):
    """A checkpoint file in train.py's format with an untrained model's config and no weights."""
    cfg = compose_config("config", [])
    torch.save({"format": CHECKPOINT_FORMAT, "step": 3, "model": {}, "model_config": model_config,
                "config": OmegaConf.to_container(cfg, resolve=True)}, path)


@pytest.mark.parametrize("resume", ["never", "elsewhere"])
def test_a_fresh_run_refuses_a_directory_that_holds_checkpoints(tmp_path, resume):
    out = tmp_path / "run"
    out.mkdir()
    (out / "ckpt_3.pt").write_bytes(b"an earlier run's checkpoint")
    if resume == "elsewhere":
        resume = str(tmp_path / "other" / "ckpt_7.pt")
        os.makedirs(tmp_path / "other")
        fake_checkpoint(resume, config_dict(GPTConfig()))
    cfg = compose_config("config", [f"train.out_dir={out}", f"train.resume={resume}"])
    message = error_of(train.resume_checkpoint, cfg)
    assert f"train.out_dir={out} holds checkpoints of an earlier run (ckpt_3.pt)" in message
    assert "train.resume=auto" in message and "train.if_exists=archive" in message
    assert (out / "ckpt_3.pt").read_bytes() == b"an earlier run's checkpoint"


def test_model_mismatch_names_the_fields_and_suggests_no_destructive_setting(tmp_path):
    saved = GPTConfig(n_layer=2, n_embd=64, n_head=4)
    ckpt = {"model_config": config_dict(saved), "config": {"data": {"tokenizer": "gpt2"}}}
    here = GPTConfig(n_layer=3, n_embd=64, n_head=4, tokenizer_vocab_size=50257)
    with pytest.raises(ValueError) as info:
        train.check_same_model(ckpt, here, "runs/x/ckpt_3.pt", ["model.n_layer=3", "train.max_steps=9"])
    message = str(info.value)
    assert "n_layer=2 in the checkpoint, 3 here" in message and "model.n_layer=3" in message
    assert "another train.out_dir" in message and "resume=never" not in message and "max_steps" not in message
    # a checkpoint that predates tokenizer_vocab_size is the same model
    train.check_same_model(ckpt, GPTConfig(n_layer=2, n_embd=64, n_head=4, tokenizer_vocab_size=50257), "f", [])


def test_resume_takes_model_and_data_settings_from_the_checkpoint():
    saved = compose_config("config", ["model=castle", "model.n_layer=2", "data=text"])
    ckpt = {"config": OmegaConf.to_container(saved, resolve=True)}
    cfg = compose_config("config", ["model.n_embd=256", "train.max_steps=9"])
    assert train.settings_from_checkpoint(cfg, ckpt, ["model.n_embd=256", "train.max_steps=9"]) == ["model", "data"]
    assert cfg.model.attention == "castle" and cfg.model.n_layer == 2 and cfg.model.n_embd == 256
    assert cfg.data.name == "text" and cfg.train.max_steps == 9
    cfg = compose_config("config", ["model=gpt2"])         # a group choice keeps the composed section
    assert train.settings_from_checkpoint(cfg, ckpt, ["model=gpt2"]) == ["data"]
    assert cfg.model.attention == "baseline" and cfg.model.pos == "learned"


# ----------------------------------------------------------------------------- sample.py, eval.py

@pytest.mark.parametrize("override,expected", [
    ("max_new_tokens=-5", "max_new_tokens=-5 is invalid: it must be an integer >= 1"),
    ("max_new_tokens=0", "max_new_tokens=0"),
    ("temperature=-1", "temperature=-1 is invalid: it must be a number >= 0"),
    ("top_k=-1", "top_k=-1 is invalid: it must be an integer >= 0, or null (null or 0: no top-k filtering)"),
    ("top_p=0", "top_p=0 is invalid: it must be a number > 0 and <= 1, or null"),
    ("top_p=1.5", "top_p=1.5"),
    ("num_samples=0", "num_samples=0"),
    ("prefill_chunk=0", "prefill_chunk=0"),
    ("seed=x", "seed=x"),
    ("sharded=yes", "sharded=yes is invalid: it must be true or false"),
    ("dtype=half", "dtype=half"),
    ("device=tpu9", "device=tpu9"),
])
def test_sample_option_errors(override, expected):
    assert expected in error_of(sample.check_sample_options, compose_config("sample", ["ckpt=x", override]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is visible")
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="device=cuda but no CUDA device is visible; use device=auto or cpu"):
        choose_device("cuda")


def test_sample_and_eval_need_a_checkpoint():
    for check, name in [(sample.check_sample_options, "sample"), (eval_script.check_eval_options, "evaluate")]:
        assert "ckpt is missing: pass ckpt=RUN_DIR" in error_of(check, compose_config(name, []))


@pytest.mark.parametrize("override,expected", [
    ("eval.tasks=[heldout,nope]", "eval.tasks=['heldout', 'nope'] names unknown or no evaluations; choose from"),
    ("eval.tasks=[]", "eval.tasks=[] names unknown or no evaluations"),
    ("dtype=fp8", "dtype=fp8"),
    ("lm_eval.preset=castle", "lm_eval.preset / lm_eval.tasks are set but eval.tasks has no lm_eval"),
])
def test_eval_option_errors(override, expected):
    assert expected in error_of(eval_script.check_eval_options, compose_config("evaluate", ["ckpt=x", override]))


@pytest.mark.parametrize("prompt", ["café", "héllo wörld 😀 日本語", "a,b", "[x]", "null", "123", "it's",
                                    'say "hi"', "${x} and \\${y}", "a=b", "end\\", "", " lead"])
def test_prompt_is_taken_literally(prompt):
    """sample.py's prompt= needs no Hydra quoting: Unicode, quotes, commas and ${ arrive unchanged."""
    cfg = compose_config("sample", ["ckpt=x", quote_literal("prompt=" + prompt, ("prompt",))])
    assert cfg.prompt == prompt


# ----------------------------------------------------------------------------- the entry-point wrapper

def run_entry(task, argv, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["prog.py"] + argv)
    GlobalHydra.instance().clear()
    entry_point("sample", literal_keys=("prompt",))(task)()


def test_entry_point_prints_a_user_error_as_one_line_and_exits_2(monkeypatch, capsys):
    def task(cfg):
        raise ValueError(f"prompt={cfg.prompt} is\nwrong; fix it")
    with pytest.raises(SystemExit) as info:
        run_entry(task, ["ckpt=x", "prompt=héllo, wörld"], monkeypatch)
    assert info.value.code == 2
    assert capsys.readouterr().err == "prog.py: error: prompt=héllo, wörld is wrong; fix it\n"


def test_entry_point_reports_hydra_errors_as_one_line(monkeypatch, capsys):
    with pytest.raises(SystemExit) as info:
        run_entry(lambda cfg: None, ["ckpt=x", "nonexistent_option=3"], monkeypatch)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and "nonexistent_option" in err


def test_entry_point_keeps_the_traceback_of_a_bug(monkeypatch):
    def task(cfg):
        raise RuntimeError("a bug")
    with pytest.raises(RuntimeError, match="a bug"):
        run_entry(task, ["ckpt=x"], monkeypatch)


# ----------------------------------------------------------------------------- end to end

def run(script, args):
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, script] + args, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


def assert_one_line_error(proc, *words):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "Error executing job" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(os.path.basename(proc.args[1]) + ": error: "), proc.stderr
    assert all(w in lines[0] for w in words), (words, lines[0])


@pytest.mark.slow
def test_train_bad_value_exits_2_and_leaves_no_run_directory(tmp_path):
    out = tmp_path / "new_run"
    assert_one_line_error(run("train.py", [f"train.out_dir={out}", "train.max_steps=abc"]), "train.max_steps=abc")
    assert_one_line_error(run("train.py", [f"train.out_dir={out}", "model=nonexistent"]), "model/nonexistent",
                          "castle")
    # fails after taking the run directory: no shards of this data set
    assert_one_line_error(run("train.py", [f"train.out_dir={out}", "data=text", f"data.dir={tmp_path / 'no_data'}"]),
                          "data.dir", "prepare it first")
    assert not out.exists()


def test_train_refuses_a_directory_locked_by_a_live_run(tmp_path):
    (tmp_path / ".lock").write_text(f'{{"pid": 1, "host": "{socket.gethostname()}"}}')   # init never dies
    assert_one_line_error(run("train.py", [f"train.out_dir={tmp_path}"]), "is in use by another training run",
                          "pid 1 on host", "another train.out_dir")
    assert sorted(os.listdir(tmp_path)) == [".lock"]


@pytest.mark.slow
def test_sample_and_eval_errors_exit_2(tmp_path):
    assert_one_line_error(run("sample.py", [f"ckpt={tmp_path}", "top_p=0"]), "top_p=0", "> 0 and <= 1")
    assert_one_line_error(run("eval.py", [f"ckpt={tmp_path / 'none'}"]), "does not exist", "pass a run directory")


@pytest.mark.parametrize("message, expected", [
    ("Could not override 'model.fgate'. To append ...",
     " (model.fgate is an option of model=fox_llama|fox_pro: choose one of them first)"),
    ("Could not override 'model.castle_window'. ...",
     " (model.castle_window is an option of model=castle_swl: choose one of them first)"),
    ("Could not override 'model.nonsense'. ...", " (model.nonsense is not an option of any model group)"),
    ("Could not override 'nogroup.key'. ...", ""),
    ("Could not load 'model/nope'", "")])
def test_an_option_of_another_model_group_names_the_groups_that_have_it(message, expected):
    assert groups_with_option(message) == expected
