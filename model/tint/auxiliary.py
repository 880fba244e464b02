"""What both TinT levels read from the auxiliary GPT, and the pieces of its math they share.

The reference update (reference.py) and the simulator (simulator.py) must compute the same thing, so
the auxiliary model's weights, its normaliser and activation, the training / loss masks and the loss
gradient at the head are written once, here.
"""
import torch
import torch.nn.functional as F

UNSUPPORTED_FLAGS = ("qk_norm", "kv_shift", "output_gate", "output_norm")


def check_aux_model(model):
    """TinT needs a plain softmax-attention GPT (`attention="baseline"`, no Pro options)."""
    c = model.config
    if c.attention != "baseline":
        raise ValueError(f"TinT wraps GPTs with attention='baseline', got {c.attention!r}")
    bad = [f for f in UNSUPPORTED_FLAGS if getattr(c, f, False)]
    if bad:
        raise ValueError(f"TinT does not support the Pro options {bad} of the auxiliary model")
    if c.norm not in ("layernorm", "rmsnorm") or c.mlp not in ("gelu", "swiglu"):
        raise ValueError(f"unsupported norm/mlp {c.norm}/{c.mlp}")
    if model.training and c.dropout > 0:
        raise ValueError("put the auxiliary model in eval mode (dropout must be off)")


def layer_params(model, i):
    """Layer i's weights as a dict (None where the model has no such tensor), views of the model's."""
    blk = model.blocks[i]
    inner = blk.attn.n_head * blk.attn.head_dim
    qkv_w = blk.attn.qkv.weight
    qkv_b = blk.attn.qkv.bias
    p = {"ln1_w": blk.norm_attn.weight, "ln1_b": getattr(blk.norm_attn, "bias", None),
         "wq": qkv_w[:inner], "wk": qkv_w[inner:2 * inner], "wv": qkv_w[2 * inner:],
         "bq": None if qkv_b is None else qkv_b[:inner], "bk": None if qkv_b is None else qkv_b[inner:2 * inner],
         "bv": None if qkv_b is None else qkv_b[2 * inner:],
         "wo": blk.attn.out.weight, "bo": blk.attn.out.bias,
         "ln2_w": blk.norm_mlp.weight, "ln2_b": getattr(blk.norm_mlp, "bias", None),
         "w_up": blk.mlp.w_up.weight, "b_up": blk.mlp.w_up.bias,
         "w_down": blk.mlp.w_down.weight, "b_down": blk.mlp.w_down.bias,
         "w_gate": getattr(getattr(blk.mlp, "w_gate", None), "weight", None),
         "b_gate": getattr(getattr(blk.mlp, "w_gate", None), "bias", None)}
    return p


def final_params(model):
    return {"lnf_w": model.norm_f.weight, "lnf_b": getattr(model.norm_f, "bias", None)}


def make_masks(idx, n_train, label_mask=None):
    """train mask m (B, T) (1 on the training segment) and loss weights c (B, T): c_t = m_{t+1} lambda_{t+1}
    for t < T - 1 and c_{T-1} = 0. The label mask lambda selects label words (TinT, arXiv:2307.01189 §3.1,
    "label loss"); masking the last position, whose target lies outside the sequence, is the repo's choice."""
    B, T = idx.shape
    if not 1 <= n_train <= T:
        raise ValueError(f"n_train={n_train} must be in [1, {T}]")
    m = torch.zeros(B, T, device=idx.device)
    m[:, :n_train] = 1
    lam = torch.ones(B, T, device=idx.device) if label_mask is None else label_mask.to(idx.device).float()
    c = torch.zeros(B, T, device=idx.device)
    c[:, :-1] = m[:, 1:] * lam[:, 1:]
    return m, c


def normalize(x, kind, eps):
    """The norm without its affine part: N(x) (LayerNorm) or x / rms(x) (RMSNorm)."""
    if kind == "layernorm":
        return F.layer_norm(x, (x.size(-1),), eps=eps)
    return F.rms_norm(x, (x.size(-1),), eps=eps)


def gelu(z):
    """The auxiliary GELU MLP's activation (tanh form, as model.gpt's). The finite-difference backward is
    exact only if the simulator's activation is this very function (arXiv:2307.01189 App. F)."""
    return F.gelu(z, approximate="tanh")


def loss_grad(f, head, idx, c):
    """delta f_t = c_t W^T (softmax(W f_t) - onehot(x_{t+1})) for the final-norm output f (B, T, D) and the
    frozen LM head W (V, D): the gradient of the c-weighted, summed next-token loss (arXiv:2307.01189 App. G,
    Def. G.1)."""
    logits = f @ head.t()
    target = torch.zeros_like(logits).scatter_(-1, idx.roll(-1, 1)[..., None], 1.0)
    return c[..., None] * (torch.softmax(logits, -1) - target) @ head
