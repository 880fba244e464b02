"""Sample text from a checkpoint written by train.py, streaming tokens as they are generated.

    python sample.py ckpt=runs/llama-4x128-sample prompt="The history of" max_new_tokens=100

`ckpt` is a run directory (its newest readable checkpoint) or a checkpoint file. `prompt=` is taken
literally: any Unicode text, quotes, commas or `${`, with the shell's quoting only.

Sharded decoding (tree attention, kernels/tree.py): every layer's cache is split along the
sequence axis over the N processes, which all run the same tokens; only rank 0 prints.

    torchrun --nproc_per_node=N sample.py ckpt=... prompt=... sharded=true

cuda_graph=auto (the default) is fused for LLaMA blocks on one Hopper (or newer) GPU, true on other single CUDA
devices and models and on sharded models, and false on the CPU.
cuda_graph=true (every attention, on one GPU or sharded): after the prompt, every token is one replay of a
CUDA graph of the decode step (GPT.generate_stream), not hundreds of kernel launches; cuda_graph=compiled
torch.compiles the step first (fewer, fused kernels; compiling takes a minute); cuda_graph=autotuned also
tunes its matmuls and kernels (minutes more, ~18% faster per token at batch 1); cuda_graph=fused (LLaMA
blocks only) runs the whole step as one kernel launch (kernels/llama_step), the fastest at batch 1.
"""
import os
import sys

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from data.tokenizer import tokenizer_for
from evaluation.samples import stream_text
from model.checkpoint import load_model
from model.gpt import CUDA_GRAPH_MODES
from model.sampling import fused_step_unsupported
from model.runtime import (DEVICE, Dist, Rule, boolean, check_options, entry_point, integer, number, one_of,
                           optional, text)

TOP_K = optional(integer(0))
OPTIONS = {"ckpt": text(), "prompt": text(nonempty=False), "bos": boolean(), "max_new_tokens": integer(1),
           "num_samples": integer(1), "temperature": number(0), "seed": integer(0),
           "top_k": Rule(TOP_K.ok, TOP_K.expected + " (null or 0: no top-k filtering)"),
           "top_p": optional(number(above=0, high=1)), "device": DEVICE, "dtype": one_of("auto", "bf16", "fp32"),
           "stop_at_eot": boolean(), "sharded": boolean(), "prefill_chunk": integer(1),
           "cuda_graph": one_of("auto", *CUDA_GRAPH_MODES)}


def check_sample_options(cfg):
    """Every option's type and range, before the model is loaded."""
    if OmegaConf.is_missing(cfg, "ckpt"):
        raise ValueError("ckpt is missing: pass ckpt=RUN_DIR (its newest readable checkpoint) or ckpt=FILE.pt")
    check_options(OmegaConf.to_container(cfg), OPTIONS)
    if cfg.cuda_graph not in (False, "auto"):
        asked = f"cuda_graph={str(cfg.cuda_graph).lower()}"
        if cfg.sharded and cfg.cuda_graph is not True:
            raise ValueError(f"{asked} decodes on one GPU: with sharded=true pass cuda_graph=true (a graph of the "
                             "sharded step) or auto")
        if cfg.device == "cpu":
            raise ValueError(f"{asked} needs a CUDA device, not device=cpu: pass cuda_graph=auto or false")


def graph_mode(cfg, device, config, group):
    """cuda_graph as GPT.generate_stream takes it for a model of GPTConfig `config`; any value but auto as given. auto: none on the CPU;
    sharded (a process group), a graph of the sharded step (True); on one CUDA device the single-launch step
    ("fused", 4x a graph of the step at batch 1) where it applies (LLaMA blocks) on Hopper or newer, the GPUs it
    is tested and timed on; else True."""
    if cfg.cuda_graph != "auto":
        return cfg.cuda_graph
    if device.type != "cuda":
        return False
    if group is not None:
        return True
    hopper = torch.cuda.get_device_capability(device) >= (9, 0)
    return "fused" if hopper and fused_step_unsupported(config) is None else True


def init_sharding(cfg):
    """(ranks, group): the processes and devices (one GPU per local rank, NCCL on GPUs, gloo on
    CPU); group is the process group over all torchrun ranks with sharded=true, else None."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not cfg.sharded:
        raise ValueError(f"sample.py runs on {world} processes: pass sharded=true to split the cache "
                         "over them, or start it with python instead of torchrun")
    ranks = Dist(cfg.device)
    return ranks, dist.group.WORLD if ranks.world > 1 else None


@entry_point("sample", literal_keys=("prompt",))
def main(cfg):
    check_sample_options(cfg)
    ranks, group = init_sharding(cfg)
    torch.manual_seed(cfg.seed)
    model, train_cfg, device, _ = load_model(cfg.ckpt, ranks.device, cfg.dtype)
    tok = tokenizer_for(train_cfg["data"])
    # training documents start after an end-of-text token, so prompts do too (bos=false: raw prompt)
    prompt_ids = [tok.eot_token] * (cfg.bos or not cfg.prompt) + tok.encode_ordinary(cfg.prompt)
    for i in range(cfg.num_samples):
        if ranks.master:
            print(f"--- sample {i + 1}/{cfg.num_samples} ---")
            sys.stdout.write(cfg.prompt)
        stream_text(model, tok, prompt_ids, device, max_new_tokens=cfg.max_new_tokens,
                    temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, stop_at_eot=cfg.stop_at_eot,
                    group=group, prefill_chunk=cfg.prefill_chunk if group is not None else None,
                    cuda_graph=graph_mode(cfg, device, model.config, group), show=ranks.master)
    ranks.close()


if __name__ == "__main__":
    main()
