"""Needle in a haystack (FoX, arXiv:2503.02130 §4.3, App. B.3): find one sentence hidden at some depth of a
long text.

    python eval.py ckpt=RUN eval.tasks=[niah]                                  # easy + standard, 11 x 11
    python eval.py ckpt=RUN eval.tasks=[niah] niah.lengths=[2000,4000] niah.depths=[0,50,100]

Prompts follow the FoX paper: the needle sentence (standard mode) or question + needle (easy
mode) inserted at a depth of the haystack, moved back to just after the nearest preceding "."
token (at the end for 100%); 200 tokens kept free for the question; <|endoftext|> first. Lengths
count the model's own tokens (JSON-escaped GPT-2 for LongCrawl64 models). Two deliberate
differences: the haystack is the ELTeC novels of ../shared/data/books (in file-name order) instead
of Paul Graham's essays, and the prompt is assembled from token ids, so every depth of one length
has the same token count. Scoring is offline and NOT the paper's GPT-4o judge (an external service):
a prompt passes when the greedy continuation contains the needle's answer verbatim; the heatmap shows
10 for a pass and 1 for a fail on the paper's 1-10 scale. Writes niah_<mode>.json and niah_<mode>.png.
"""
import json
import os
from pathlib import Path

import numpy as np
import torch

from data.sample.tei_to_text import tei_to_text
from evaluation import evaluation
from evaluation.lm_eval_adapter import REPO
from model.checkpoint import atomic_write
from model.runtime import checked, integer, listed, number, one_of, optional, shown

QUESTION = "What is the best thing to do in San Francisco?"
NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
ANSWER = "eat a sandwich and sit in Dolores Park on a sunny day"
NEEDLES = {"standard": f"\n{NEEDLE}\n", "easy": f"\n{QUESTION} Answer: {NEEDLE}\n"}
PROMPT_END = ("\n\nThere is an important piece of information hidden inside the above document. Now that you've "
              f"read the document, I will quiz you about it. Answer the following question: {QUESTION} "
              "Answer: The best thing to do in San Francisco is")
PAPER_LENGTHS = np.linspace(1000, 32000, 11)     # for a 16384-token training context
DEFAULT_BOOKS = REPO.parent / "shared" / "data" / "books" / "eltec_eng"


def haystack(tokenizer, books_dir, n_tokens):
    """The first n_tokens tokens of the novels in books_dir (TEI .xml.gz, file-name order), blank-line separated."""
    ids = []
    for path in sorted(Path(books_dir).glob("*.xml.gz")):
        ids += tokenizer.encode_ordinary(tei_to_text(str(path)) + "\n\n")
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
    raise ValueError(f"the novels in niah.books_dir={books_dir} hold {len(ids)} tokens, fewer than the {n_tokens} the "
                     "longest of niah.lengths needs; add novels or use shorter niah.lengths")


def build_prompt(hay, needle, end, bos, depth, period_ids):
    """bos + haystack with the needle at `depth` % (moved back to after a "." token) + the question."""
    pos = len(hay) if depth >= 100 else int(len(hay) * depth / 100)
    while 0 < pos < len(hay) and hay[pos - 1] not in period_ids:
        pos -= 1
    return [bos] + hay[:pos] + needle + hay[pos:] + end


@torch.no_grad()
def greedy_continuations(model, tokenizer, prompts, max_new_tokens, batch_size, device):
    """Greedy continuations of equal-length prompts, decoded up to the first <|endoftext|>."""
    answers = []
    for start in range(0, len(prompts), batch_size):
        idx = torch.tensor(prompts[start:start + batch_size], device=device)
        new = model.generate(idx, max_new_tokens, temperature=0, eot_token=tokenizer.eot_token)[:, idx.size(1):]
        for row in new.tolist():
            end = row.index(tokenizer.eot_token) if tokenizer.eot_token in row else len(row)
            answers.append(tokenizer.decode(row[:end]))
    return answers


def run_mode(model, tokenizer, hay, mode, lengths, depths, c, device):
    """One record per (length, depth): the prompt's token count, the continuation and whether it holds ANSWER."""
    needle, end = tokenizer.encode_ordinary(NEEDLES[mode]), tokenizer.encode_ordinary(PROMPT_END)
    period_ids = set(tokenizer.encode_ordinary("."))
    records = []
    for length in lengths:
        n_hay = length - c.question_reserve - len(needle)
        prompts = [build_prompt(hay[:n_hay], needle, end, tokenizer.eot_token, d, period_ids) for d in depths]
        answers = greedy_continuations(model, tokenizer, prompts, c.max_new_tokens, c.batch_size, device)
        records += [{"length": length, "depth": d, "prompt_tokens": len(p), "answer": a.strip(), "match": ANSWER in a}
                    for d, p, a in zip(depths, prompts, answers)]
    return records


def plot_heatmap(grid, lengths, depths, train_len, title, png):
    """grid (depths x lengths) of scores 1..10 as the paper's heatmap; dashed line at the training context."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(3 + 0.6 * len(lengths), 2 + 0.4 * len(depths)))
    image = ax.imshow(grid, cmap="RdYlGn", vmin=1, vmax=10, aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(l) for l in lengths], rotation=45)
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    if lengths[0] <= train_len <= lengths[-1]:
        ax.axvline(np.interp(train_len, lengths, range(len(lengths))), ls="--", c="black", lw=1)
    ax.set(xlabel="context length (tokens)", ylabel="needle depth (%)", title=title)
    fig.colorbar(image, ax=ax, label="score (10: answer found, 1: not)")
    atomic_write(str(png), lambda f: fig.savefig(f, format="png", dpi=150, bbox_inches="tight"))
    plt.close(fig)


def settings(model, ctx):
    """(modes, lengths, depths, books_dir) from the niah options, every one checked."""
    c = ctx.cfg.niah
    modes = checked(c.modes, "niah.modes", listed(one_of(*NEEDLES)))
    for option in ("max_new_tokens", "batch_size"):
        checked(c[option], f"niah.{option}", integer(1))
    checked(c.question_reserve, "niah.question_reserve", integer(0))
    depths = (checked(c.depths, "niah.depths", optional(listed(number(0, 100))))
              or np.linspace(0, 100, 11).round().tolist())
    needle = max(len(ctx.tokenizer.encode_ordinary(NEEDLES[mode])) for mode in modes)
    lengths = prompt_lengths(model, c, needle, ctx.train_cfg["train"]["seq_len"])
    books_dir = Path(c.books_dir or os.environ.get("BOOKS_DIR") or DEFAULT_BOOKS).expanduser()
    if not any(books_dir.glob("*.xml.gz")):
        raise FileNotFoundError(f"niah.books_dir={books_dir} holds no novels (*.xml.gz, TEI); point niah.books_dir "
                                "(or $BOOKS_DIR) at a folder of them, e.g. ../shared/data/books/eltec_eng")
    return modes, lengths, depths, books_dir


def prompt_lengths(model, c, needle, train_len):
    """niah.lengths, else the paper's grid scaled to the training context (from 512). A length must
    leave a haystack after niah.question_reserve and the `needle` tokens; with learned positions it
    must also leave niah.max_new_tokens before block_size: the default grid drops the lengths that
    do not, explicit lengths must all fit."""
    lengths = checked(c.lengths, "niah.lengths", optional(listed(integer(1)))) or []
    shortest = c.question_reserve + needle + 1
    if lengths and min(lengths) < shortest:
        raise ValueError(f"niah.lengths={shown(c.lengths)} holds {min(lengths)}, which leaves no haystack after "
                         f"niah.question_reserve={c.question_reserve} tokens and a {needle}-token needle; "
                         f"use lengths >= {shortest} or a smaller niah.question_reserve")
    block, room = model.config.block_size, model.config.block_size - c.max_new_tokens
    learned = model.config.pos == "learned"
    if learned and room < shortest:
        raise ValueError(f"niah does not fit this model: its learned positions stop at block_size={block}, but a "
                         f"prompt needs >= {shortest} tokens (niah.question_reserve={c.question_reserve} + a {needle}-"
                         f"token needle + 1) and niah.max_new_tokens={c.max_new_tokens} more; lower "
                         "niah.question_reserve or niah.max_new_tokens, or drop niah from eval.tasks")
    if learned and lengths and max(lengths) > room:
        raise ValueError(f"niah.lengths={shown(c.lengths)} holds {max(lengths)}, but the model's learned positions "
                         f"stop at block_size={block}, so with niah.max_new_tokens={c.max_new_tokens} a prompt has "
                         f"at most {room} tokens; choose lengths in [{shortest}, {room}]")
    if lengths:
        return lengths
    grid = sorted({round(float(l)) for l in np.maximum(PAPER_LENGTHS * train_len / 16384, 512)})
    lengths = [l for l in grid if shortest <= l and (not learned or l <= room)]
    if not lengths:
        raise ValueError(f"none of the default niah lengths {grid} fits this model and niah.question_reserve; "
                         f"set niah.lengths=[...] to lengths >= {shortest}" + (f" and <= {room}" if learned else ""))
    return lengths


@evaluation("niah", check=settings)
def needle_in_a_haystack(model, ctx):
    c = ctx.cfg.niah
    modes, lengths, depths, books_dir = settings(model, ctx)
    train_len = ctx.train_cfg["train"]["seq_len"]
    tokenizer = ctx.tokenizer
    hay = haystack(tokenizer, books_dir, max(lengths))
    out = Path(ctx.out_dir)
    result = {"metric": "exact match of the needle's answer in the greedy continuation (not the paper's GPT-4o judge)",
              "lengths": lengths, "depths": depths, "train_seq_len": train_len}
    for mode in modes:
        records = run_mode(model, tokenizer, hay, mode, lengths, depths, c, ctx.device)
        atomic_write(str(out / f"niah_{mode}.json"), lambda f: f.write(json.dumps(records, indent=1).encode()))
        match = np.array([r["match"] for r in records], dtype=float).reshape(len(lengths), len(depths)).T
        plot_heatmap(1 + 9 * match, lengths, depths, train_len, f"needle in a haystack, {mode} mode",
                     out / f"niah_{mode}.png")
        within = [r["match"] for r in records if r["length"] <= train_len]
        result[mode] = {"accuracy": float(match.mean()),
                        "accuracy_within_train_len": float(np.mean(within)) if within else None,
                        "match": match.astype(int).tolist(), "png": str(out / f"niah_{mode}.png")}
    return result
