"""Evaluations that eval.py runs on a checkpoint. Each module registers functions with
`@evaluation("name", check=settings)`; the evaluation takes (model, ctx: Context) and returns a
JSON-able dict, its `settings(model, ctx)` validates and resolves that evaluation's options.

Bad options are user errors (ValueError / FileNotFoundError naming the option and the fix), found
before any evaluation runs: `check_options` runs the `settings` of every evaluation in eval.tasks
first, and each evaluation calls its own `settings` again when it starts.

Held-out sequences are never read twice. When the val split holds fewer distinct sequences than
an option asks for, the evaluation uses all it holds, warns, naming the option, and records the
count it used next to the requested one in its results.
"""
import warnings

from omegaconf import OmegaConf

from data.loader import build_loader
from data.longcrawl64 import DOC_LEN, LongCrawl64Loader
from data.tokenizer import tokenizer_for
from model.runtime import checked, integer, optional

EVALUATIONS = {}
CHECKS = {}


def evaluation(name, check):
    def register(fn):
        EVALUATIONS[name], CHECKS[name] = fn, check
        return fn
    return register


def check_options(model, ctx):
    """The options of every evaluation in eval.tasks, checked before the first one starts."""
    for name in ctx.cfg.eval.tasks:
        CHECKS[name](model, ctx)


class Context:
    """What an evaluation needs besides the model.

    cfg: eval.py's Hydra config; train_cfg: the checkpoint's resolved training config (dict);
    device; ckpt_path; data_cfg: the data config (eval.py's `data=` override, tokenized like the
    checkpoint's data, or the checkpoint's own); seq_len: eval.seq_len or the training context;
    out_dir: where files (plots, CSV) go; tokenizer: the checkpoint's own.
    """

    def __init__(self, cfg, train_cfg, device, ckpt_path, out_dir):
        self.cfg, self.train_cfg, self.device, self.ckpt_path = cfg, train_cfg, device, ckpt_path
        self.data_cfg = cfg.data if cfg.get("data") else OmegaConf.create(train_cfg["data"])
        trained_on = train_cfg["data"].get("tokenizer", "gpt2")
        if self.data_cfg.get("tokenizer", "gpt2") != trained_on:
            raise ValueError(f"data={self.data_cfg.name} is tokenized with {self.data_cfg.get('tokenizer', 'gpt2')}, "
                             f"but the checkpoint was trained on {trained_on} tokens; evaluate on data tokenized "
                             f"with {trained_on} (or leave data= out: the checkpoint's own data)")
        self.seq_len = (checked(cfg.eval.seq_len, "eval.seq_len", optional(integer(1)))
                        or train_cfg["train"]["seq_len"])
        self.out_dir = out_dir

    @property
    def tokenizer(self):
        """The tokenizer the checkpoint was trained with (gpt2, or gpt2_json for LongCrawl64)."""
        return tokenizer_for(self.train_cfg["data"])


# ----------------------------------------------------------------------------- option checks

def check_positions(model, seq_len, option):
    """A model with learned positions reads at most block_size tokens."""
    block = model.config.block_size
    if model.config.pos == "learned" and seq_len > block:
        raise ValueError(f"{option}={seq_len} is out of range: the model's learned positions stop at "
                         f"block_size={block}; choose {option} in [1, {block}]")


# ----------------------------------------------------------------------------- the val split

class ValSplit:
    """The val split of a data config: how many distinct sequences of a length it holds, and a loader
    that serves them (data.loader wraps around at the end of the split; evaluations never let it)."""

    def __init__(self, data_cfg):
        self.data_cfg = data_cfg
        probe = build_loader(data_cfg, "val", 1, 1)
        if isinstance(probe, LongCrawl64Loader):    # documents of 65536 tokens; a sequence is a chunk of one
            self.documents, self.doc_len = probe.rows, DOC_LEN
            self.size = f"{self.documents:,} documents of {DOC_LEN:,} tokens"
        else:                                       # shard tokens: one folder, or a weighted mix
            self.tokens, self.doc_len = probe.distinct_tokens(), None
            self.size = f"{self.tokens:,} tokens"

    def sequences(self, seq_len, batch_size):
        """Distinct sequences of seq_len tokens the loader serves, in whole batches, before it wraps."""
        if self.doc_len:
            return self.documents // batch_size * batch_size * (self.doc_len // seq_len)
        return (self.tokens - 1) // (batch_size * seq_len) * batch_size     # +1 token for the targets

    def check(self, seq_len, batch_size, seq_option, batch_option):
        """seq_len must fit one batch of the split; the error names the option and the valid range."""
        longest = self.doc_len if self.doc_len else (self.tokens - 1) // batch_size
        if self.sequences(1, batch_size) == 0:
            raise ValueError(f"{batch_option}={batch_size} is too large: the val split of data "
                             f"'{self.data_cfg.name}' holds {self.size}; lower {batch_option}")
        if not 1 <= seq_len <= longest:
            raise ValueError(f"{seq_option}={seq_len} is out of range: the val split of data '{self.data_cfg.name}' "
                             f"holds {self.size}, so with {batch_option}={batch_size} a sequence has 1 to "
                             f"{longest:,} tokens; choose {seq_option} in [1, {longest}]")

    def batches(self, wanted, seq_len, batch_size, option):
        """(loader, batch count, sequence count) for at most `wanted` distinct sequences; fewer, with
        a warning naming `option`, when the split holds fewer."""
        available = self.sequences(seq_len, batch_size)
        if wanted > available:
            warnings.warn(f"{option} asks for {wanted} sequences of {seq_len} tokens but the val split of data "
                          f"'{self.data_cfg.name}' holds {available} distinct ones ({self.size}); evaluating "
                          f"those {available} (none twice)", stacklevel=2)
        count = min(wanted, available)
        loader = build_loader(self.data_cfg, "val", batch_size, seq_len)
        return loader, -(-count // batch_size), count
