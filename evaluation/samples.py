"""Text samples of a model, printed as they are generated: sample.py and the sample at the end of
train.py go through `stream_text`, so both decode with the same generation path."""
import sys

import torch

# Characters at the end of the decoded text that a later token can still change: the rest of a
# multi-byte UTF-8 character, or of a JSON escape such as \u00e9 (gpt2_json tokenizer).
UNSETTLED_CHARS = 6


def stream_text(model, tok, prompt_ids, device, *, max_new_tokens, temperature=0.8, top_k=None, top_p=None,
                stop_at_eot=True, group=None, prefill_chunk=None, cuda_graph=False, show=True):
    """Generate after `prompt_ids`, printing the text as it settles (when `show`); return the text.

    group / prefill_chunk: split the cache over this process group and prefill the prompt in chunks
    (GPT.generate_stream); every rank of the group calls this with the same prompt."""
    idx = torch.tensor([prompt_ids], device=device)
    new_ids, printed = [], 0
    eot = tok.eot_token if stop_at_eot else None
    for token in model.generate_stream(idx, max_new_tokens, temperature, top_k, top_p, eot,
                                       group=group, prefill_chunk=prefill_chunk, cuda_graph=cuda_graph):
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
