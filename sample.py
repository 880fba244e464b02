"""Sample text from a checkpoint written by train.py, streaming tokens as they are generated.

    python sample.py ckpt=runs/baseline-4x128 prompt="The history of" max_new_tokens=100
"""
import sys

import hydra
import torch

from data.tokenizer import tokenizer_for
from model.gpt import load_model


def stream_text(model, tok, prompt_ids, cfg, device):
    """Print one sample as it is generated; return its text."""
    idx = torch.tensor([prompt_ids], device=device)
    new_ids, printed = [], ""
    eot = tok.eot_token if cfg.stop_at_eot else None
    for token in model.generate_stream(idx, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p, eot):
        if eot is not None and token.item() == eot:
            break
        new_ids.append(token.item())
        text = tok.decode(new_ids)
        if not text.endswith("\ufffd"):      # wait for the rest of a multi-byte character
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text
    print()
    return tok.decode(new_ids)


@hydra.main(version_base="1.3", config_path="configs", config_name="sample")
def main(cfg):
    torch.manual_seed(cfg.seed)
    model, train_cfg, device = load_model(cfg.ckpt, cfg.device, cfg.dtype)
    tok = tokenizer_for(train_cfg["data"])
    prompt_ids = tok.encode_ordinary(cfg.prompt) if cfg.prompt else [tok.eot_token]
    for i in range(cfg.num_samples):
        print(f"--- sample {i + 1}/{cfg.num_samples} ---")
        sys.stdout.write(cfg.prompt)
        stream_text(model, tok, prompt_ids, cfg, device)


if __name__ == "__main__":
    main()
