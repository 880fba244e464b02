"""Import a Hugging Face model directory as a run directory of this repo.

    python -m scripts.import_hf --src path/to/gpt2 --out runs/gpt2-hf
    python sample.py ckpt=runs/gpt2-hf prompt="The history of"
    python eval.py ckpt=runs/gpt2-hf eval.tasks=[lm_eval,tint]

Takes a local GPT2LMHeadModel, a LlamaForCausalLM with one key/value head per query head (grouped-query
attention is refused), or a directory written by scripts/export_hf.py; the vocabulary must be GPT-2's
50257 tokens (plus padding rows), and tokenizer files, when present, must be GPT-2's. The run directory
gets ckpt_0.pt (fp32 weights, step 0, no optimizer, loader or RNG state) and config.yaml: train.py's
full configuration (the model group nearest to the model, data=sample) with overrides that rebuild
exactly this model. Those overrides are printed: train.py with them and train.resume=PATH continues
pretraining. Written under a temporary name and renamed at the end: nothing half-written is left.
"""
import argparse
from dataclasses import asdict, fields
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from model.gpt import GPTConfig
from model.hf.convert import read_hf_model, write_imported_run
from model.runtime import user_errors

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def model_group(config):
    """The configs/model group closest to `config` (its other settings become overrides)."""
    pro = any(getattr(config, k) for k in ("qk_norm", "kv_shift", "output_gate", "output_norm"))
    if config.attention in ("castle", "castle_swl"):
        return config.attention
    if config.attention == "fox":
        return "fox_pro" if pro else "fox_llama"
    if pro:
        return "transformer_pro"
    return "gpt2" if config.norm == "layernorm" else "llama"


def hydra_value(v):
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def training_config(config, out):
    """(train.py's resolved config dict for `config`, the command-line overrides that give it)."""
    base = [f"model={model_group(config)}", f"train.seq_len={config.block_size}"]
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        group = OmegaConf.to_container(compose(config_name="config", overrides=base).model, resolve=True)
        current = {**{f.name: f.default for f in fields(GPTConfig)}, **group}   # before GPTConfig.__post_init__
        overrides = base + [f"++model.{k}={hydra_value(v)}" for k, v in asdict(config).items() if current[k] != v]
        cfg = OmegaConf.to_container(compose(config_name="config", overrides=overrides + [f"train.out_dir={out}"]),
                                     resolve=True)
    if GPTConfig.from_dict(cfg["model"]) != config:
        raise RuntimeError(f"the overrides {overrides} do not rebuild the imported model config {config}")
    return cfg, overrides


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", required=True, help="local Hugging Face model directory (config.json + weights)")
    p.add_argument("--out", required=True, help="new run directory to write (must not exist, or be empty)")
    args = p.parse_args(argv)
    with user_errors():
        config, state = read_hf_model(args.src)
        train_cfg, overrides = training_config(config, args.out)
        path = write_imported_run(args.out, config, state, train_cfg)
    n_params = sum(v.numel() for k, v in state.items() if k != "lm_head.weight" or not config.tie_embeddings)
    print(f"wrote {path} ({n_params / 1e6:.1f}M parameters)\n"
          f"continue pretraining: python train.py {' '.join(overrides)} train.resume={path}")


if __name__ == "__main__":
    main()
