"""Every Hydra config file composes, the model configs build a GPT, the default run directory names
the model group, shape and data, and `train.py --help` lists train.py's groups."""
import glob
import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf, open_dict

from model.gpt import GPTConfig

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def group_options(group):
    return sorted(os.path.splitext(os.path.basename(f))[0]
                  for f in glob.glob(os.path.join(CONFIGS, group, "*.yaml")))


def compose_train(overrides):
    """train.py's config as its job sees it (the hydra: resolver of train.out_dir answers)."""
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


TRAIN_GROUPS = ["model", "size", "data", "optim", "train"]
CASES = [f"{g}={o}" for g in TRAIN_GROUPS for o in group_options(g)]
CASES += [f"+experiment={o}" for o in group_options("experiment")]
# the groups of eval.py: every config directory that is not one of train.py's
EVAL_GROUPS = sorted({os.path.basename(os.path.dirname(f)) for f in glob.glob(os.path.join(CONFIGS, "*", "*.yaml"))}
                     - set(TRAIN_GROUPS + ["experiment"]))
EVAL_CASES = [f"{g}={o}" for g in EVAL_GROUPS for o in group_options(g)]


@pytest.mark.parametrize("override", CASES)
def test_train_config_composes_and_builds_model_config(override):
    override = override.replace("+experiment", "experiment")
    cfg = compose_train([override])
    OmegaConf.resolve(cfg)
    config = GPTConfig.from_dict(OmegaConf.to_container(cfg.model))
    assert config.block_size == cfg.train.seq_len
    for key in ["train.max_steps", "train.out_dir", "train.resume", "model.attention"]:
        assert OmegaConf.select(cfg, key) is not None


@pytest.mark.parametrize("name", ["sample", "evaluate"])
def test_entry_configs_compose(name):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose(config_name=name, overrides=["ckpt=somewhere"])
    assert cfg.ckpt == "somewhere"


@pytest.mark.parametrize("override", EVAL_CASES)
def test_eval_config_composes(override):
    """Every other group's files (eval, lm_eval, niah, ...) compose with eval.py's config."""
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose(config_name="evaluate", overrides=["ckpt=x", override])
    assert OmegaConf.select(cfg, override.split("=")[0]) is not None


@pytest.mark.parametrize("overrides,out_dir", [
    ([], "runs/llama-4x128-sample"),
    (["data=text"], "runs/llama-4x128-text"),
    (["model=transformer_pro"], "runs/transformer_pro-4x128-sample"),
    (["model=fox_pro", "size=S"], "runs/fox_pro-12x896-sample"),
])
def test_default_run_directory_names_model_group_shape_and_data(overrides, out_dir):
    """`python train.py data=text` after the quickstart must not resume the quickstart's run, nor
    transformer_pro land in llama's directory."""
    assert compose_train(overrides).train.out_dir == out_dir


@pytest.mark.slow
def test_train_help_lists_train_groups_only():
    proc = subprocess.run([sys.executable, "train.py", "--help"], cwd=os.path.dirname(CONFIGS), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    groups = proc.stdout.split("Groups (GROUP=OPTION):")[1].split("Options (KEY=VALUE)")[0]
    for group in TRAIN_GROUPS:
        assert f"\n  {group} " in groups, group
        assert all(option in groups for option in group_options(group)), (group, groups)
    assert "\n  experiment " in groups
    for eval_group in EVAL_GROUPS:
        assert f"  {eval_group} " not in groups, eval_group
