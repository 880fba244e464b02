"""Checks the loaders apply to what they read, so bad data stop with a message naming the file and the fix.

Token ids. A shard or array can hold ids the tokenizer cannot decode: it was made with another
tokenizer, or is not token data at all. An id at or above the model's vocabulary crashes the
embedding lookup far from its cause, and one between the tokenizer's vocabulary and the model's
padded one (GPT-2: 50257..50303) trains silently on a token no text ever produces. Both are
refused with the file and the position of the first such id.
"""
import numpy as np

SCAN_BLOCK = 1 << 24  # tokens per block when searching a shard: no full-size temporary array


def first_out_of_vocab(tokens, vocab_size):
    """Index of the first id of the 1-D array `tokens` outside [0, vocab_size), or None."""
    for start in range(0, len(tokens), SCAN_BLOCK):
        block = np.asarray(tokens[start:start + SCAN_BLOCK])
        if block.max() >= vocab_size or block.min() < 0:
            return start + int(np.argmax((block >= vocab_size) | (block < 0)))
    return None


def out_of_vocab_error(where, token_id, vocab_size):
    """The error for token id `token_id` found at `where` (a file and a position in it)."""
    return ValueError(
        f"{where} holds token id {token_id}, outside the tokenizer's vocabulary [0, {vocab_size}): these tokens "
        "were not made by this repository's prepare scripts with the configured tokenizer. Fix: check "
        "data.tokenizer, or prepare the data again (python -m data.prepare_text, data.prepare_fineweb_edu or "
        "data.prepare_longcrawl64; see configs/data/)")


def step_from_position(position, tokens_per_step):
    """The micro-step a loader resumes at from its checkpointed `position` (stream tokens of all ranks)."""
    if position % tokens_per_step:
        raise ValueError(f"loader position {position} is not a multiple of the tokens one step of all ranks "
                         f"reads ({tokens_per_step}): resume with the batch size, sequence length and world "
                         "size of the run that saved it, or with ones that divide it evenly")
    return position // tokens_per_step
