"""Every Hydra config file composes, and the model configs build a GPT."""
import glob
import os

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from model.gpt import GPTConfig

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def group_options(group):
    return sorted(os.path.splitext(os.path.basename(f))[0]
                  for f in glob.glob(os.path.join(CONFIGS, group, "*.yaml")))


def compose_train(overrides):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


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
