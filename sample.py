"""Sample text from a checkpoint written by train.py, streaming tokens as they are generated.

    python sample.py ckpt=runs/baseline-4x128 prompt="The history of" max_new_tokens=100

Sharded decoding (tree attention, kernels/tree.py): every layer's cache is split along the
sequence axis over the N processes, which all run the same tokens; only rank 0 prints.

    torchrun --nproc_per_node=N sample.py ckpt=... prompt=... sharded=true
"""
import os
import sys

import hydra
import torch
import torch.distributed as dist

from data.tokenizer import tokenizer_for
from model.gpt import load_model
from train import Dist


# Characters at the end of the decoded text that a later token can still change: the rest of a
# multi-byte UTF-8 character, or of a JSON escape such as \u00e9 (gpt2_json tokenizer).
UNSETTLED_CHARS = 6


def stream_text(model, tok, prompt_ids, cfg, device, group=None, show=True):
    """Print one sample as it is generated (when `show`); return its text."""
    idx = torch.tensor([prompt_ids], device=device)
    new_ids, printed = [], 0
    eot = tok.eot_token if cfg.stop_at_eot else None
    chunk = cfg.prefill_chunk if group is not None else None
    for token in model.generate_stream(idx, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p, eot,
                                       group=group, prefill_chunk=chunk):
        if eot is not None and token.item() == eot:
            break
        new_ids.append(token.item())
        text = tok.decode(new_ids)
        if show and len(text) - UNSETTLED_CHARS > printed:
            printed = write(text[:len(text) - UNSETTLED_CHARS], printed)
    text = tok.decode(new_ids)
    if show:
        write(text, printed)
        print()
    return text


def write(text, printed):
    """Print text[printed:]; return len(text)."""
    sys.stdout.write(text[printed:])
    sys.stdout.flush()
    return len(text)


def init_sharding(cfg):
    """(ranks, group): the processes and devices (train.Dist: one GPU per local rank, NCCL on GPUs,
    gloo on CPU); group is the process group over all torchrun ranks with sharded=true, else None."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not cfg.sharded:
        raise ValueError(f"sample.py runs on {world} processes: pass sharded=true to split the cache "
                         "over them, or start it with python instead of torchrun")
    ranks = Dist(cfg.device)
    return ranks, dist.group.WORLD if ranks.world > 1 else None


@hydra.main(version_base="1.3", config_path="configs", config_name="sample")
def main(cfg):
    ranks, group = init_sharding(cfg)
    torch.manual_seed(cfg.seed)
    model, train_cfg, device = load_model(cfg.ckpt, ranks.device, cfg.dtype)
    tok = tokenizer_for(train_cfg["data"])
    # training documents start after an end-of-text token, so prompts do too (bos=false: raw prompt)
    prompt_ids = [tok.eot_token] * (cfg.bos or not cfg.prompt) + tok.encode_ordinary(cfg.prompt)
    for i in range(cfg.num_samples):
        if ranks.master:
            print(f"--- sample {i + 1}/{cfg.num_samples} ---")
            sys.stdout.write(cfg.prompt)
        stream_text(model, tok, prompt_ids, cfg, device, group, show=ranks.master)
    ranks.close()


if __name__ == "__main__":
    main()
