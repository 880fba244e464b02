"""Evaluations that eval.py runs on a checkpoint. Each module registers functions with
`@evaluation("name")`; a function takes (model, ctx: Context) and returns a JSON-able dict."""
from omegaconf import OmegaConf

from data.tokenizer import tokenizer_for

EVALUATIONS = {}


def evaluation(name):
    def register(fn):
        EVALUATIONS[name] = fn
        return fn
    return register


class Context:
    """What an evaluation needs besides the model.

    cfg: eval.py's Hydra config; train_cfg: the checkpoint's resolved training config (dict);
    device; ckpt_path; data_cfg: the data config (eval.py's `data=` override or the checkpoint's);
    seq_len: eval.seq_len or the training context; out_dir: where files (plots, CSV) go;
    tokenizer: the checkpoint's own.
    """

    def __init__(self, cfg, train_cfg, device, ckpt_path, out_dir):
        self.cfg, self.train_cfg, self.device, self.ckpt_path = cfg, train_cfg, device, ckpt_path
        self.data_cfg = cfg.data if cfg.get("data") else OmegaConf.create(train_cfg["data"])
        self.seq_len = cfg.eval.seq_len or train_cfg["train"]["seq_len"]
        self.out_dir = out_dir

    @property
    def tokenizer(self):
        """The tokenizer the checkpoint was trained with (gpt2, or gpt2_json for LongCrawl64)."""
        return tokenizer_for(self.train_cfg["data"])
