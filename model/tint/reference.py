"""TinT's approximate update computed directly in PyTorch ("TinT-Ref"), with the exact-gradient baselines.

TinT (Panigrahi, Malladi, Xia, Arora; arXiv:2307.01189) runs, inside one forward pass, one or a few
approximate SGD steps of an auxiliary GPT on the next-token loss of a sequence's first `n_train` tokens
and scores the rest with the updated model. This module computes that update explicitly, for GPT-2-style
(LayerNorm, GELU, learned positions, biases) and LLaMA-style (RMSNorm, SwiGLU, RoPE, no biases) models.
The approximations (section, appendix and definition numbers in this module refer to arXiv:2307.01189):
  * gradients flow through attention only via the values: W_Q, W_K frozen, the attention probabilities
    A treated as given (§2.5, Def. 2.12);
  * the backward of the norms and of the activation is a first-order finite difference
    FD_f(x, d) = (f(x + eps*d) - f(x)) / eps (§2.4, Def. 2.8; App. F, Def. F.3; for SwiGLU App. I.3,
    Def. I.7);
  * of the norms only the biases are updated, never the gains (the gain update of App. E, Def. E.2 needs
    an elementwise product; the authors' code leaves gains frozen); embeddings and head stay frozen
    (App. G);
with all updates taken from the pre-update weights. The update is implemented twice, independently, and
the tests check they agree in fp64 (the second recipe is the repo's own cross-check):
  * recipe "explicit" (A): a hand-written backward using the forward cache;
  * recipe "autograd" (B): the forward with surrogate autograd functions (finite-difference backward for
    norm and activation, detached attention probabilities), then torch.autograd.
Recipe B also gives the exact-gradient dynamic-evaluation baselines (`dyn_eval_reference`).
"""
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model.gpt import apply_rope
from model.tint.auxiliary import (
    check_aux_model,
    final_params,
    gelu,
    layer_params,
    loss_grad,
    make_masks,
    normalize,
)


@dataclass
class AuxArch:
    """What the update needs to know about the auxiliary architecture."""
    norm: str
    mlp: str
    pos: str
    n_head: int
    head_dim: int
    eps: float
    n_layer: int

    @classmethod
    def of(cls, model):
        c = model.config
        return cls(c.norm, c.mlp, c.pos, c.n_head, c.head_dim, c.norm_eps, c.n_layer)


# names of the per-layer weights in the dicts of layer_params
LAYER_KEYS = ("ln1_w", "ln1_b", "wq", "bq", "wk", "bk", "wv", "bv", "wo", "bo", "ln2_w", "ln2_b",
              "w_up", "b_up", "w_gate", "b_gate", "w_down", "b_down")
# what TinT updates (W_V, W_O, the MLP, norm biases; for SwiGLU also W_gate, App. I.3, Def. I.8);
# gains, W_Q, W_K, embeddings and head stay frozen
TINT_UPDATE = ("wv", "bv", "wo", "bo", "ln1_b", "ln2_b", "w_up", "b_up", "w_gate", "b_gate",
               "w_down", "b_down")


def _batched(p, B):
    """Per-sequence copies (B, ...) of a dict of tensors (None stays None)."""
    return {k: None if v is None else v.detach().unsqueeze(0).expand(B, *v.shape).clone() for k, v in p.items()}


def to_module_state(model, layers, final, start):
    """Functional dict {parameter name: tensor} for `torch.func.functional_call` from our layer dicts
    (unbatched, one sequence); `layers[k]` is auxiliary layer start + k."""
    out = {}
    for k, p in enumerate(layers):
        i = start + k
        pre = f"blocks.{i}."
        out[pre + "norm_attn.weight"] = p["ln1_w"]
        out[pre + "attn.qkv.weight"] = torch.cat([p["wq"], p["wk"], p["wv"]], 0)
        out[pre + "attn.out.weight"] = p["wo"]
        out[pre + "norm_mlp.weight"] = p["ln2_w"]
        out[pre + "mlp.w_up.weight"] = p["w_up"]
        out[pre + "mlp.w_down.weight"] = p["w_down"]
        if p["w_gate"] is not None:
            out[pre + "mlp.w_gate.weight"] = p["w_gate"]
        for key, name in (("ln1_b", "norm_attn.bias"), ("bo", "attn.out.bias"), ("ln2_b", "norm_mlp.bias"),
                          ("b_up", "mlp.w_up.bias"), ("b_down", "mlp.w_down.bias"), ("b_gate", "mlp.w_gate.bias")):
            if p[key] is not None:
                out[pre + name] = p[key]
        if p["bq"] is not None:
            out[pre + "attn.qkv.bias"] = torch.cat([p["bq"], p["bk"], p["bv"]], 0)
    out["norm_f.weight"] = final["lnf_w"]
    if final["lnf_b"] is not None:
        out["norm_f.bias"] = final["lnf_b"]
    return out


@dataclass
class UpdateOptions:
    """Options of the reference update. The defaults are TinT's; the others select the exact-gradient
    baselines."""
    lr: float = 1e-4
    n_layers: int | None = None           # top n_sim layers updated; None: all
    n_steps: int = 1
    fd_eps: float = 1e-3
    method: str = "explicit"              # "explicit" (recipe A) | "autograd" (recipe B)
    attn_grad: str = "value_only"         # "value_only" (TinT) | "full"         (autograd only)
    norm_grad: str = "fd"                 # "fd" (TinT) | "exact"                 (autograd only)
    act_grad: str = "fd"                  # "fd" (TinT) | "exact"                 (autograd only)
    update_set: str = "tint"              # "tint" (TINT_UPDATE) | "all" (every weight of the top blocks + norm_f)
    mlp_out_bias_lr_mult: float = 1.0     # kappa: 1, or 4 as the authors' code (its b_2 learns 4x)

    def __post_init__(self):
        for name, allowed in (("method", ("explicit", "autograd")), ("attn_grad", ("value_only", "full")),
                              ("norm_grad", ("fd", "exact")), ("act_grad", ("fd", "exact")),
                              ("update_set", ("tint", "all"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}; choose one of {allowed}")
        if self.method == "explicit" and (self.attn_grad, self.norm_grad, self.act_grad, self.update_set) != \
                ("value_only", "fd", "fd", "tint"):
            raise ValueError("the explicit recipe computes TinT's update only; use method='autograd' for the "
                             "exact-gradient variants")
        if self.n_steps < 1:
            raise ValueError("n_steps must be >= 1")
        if self.fd_eps <= 0:
            raise ValueError("fd_eps must be > 0")


def fd(f, x, d, eps):
    """First-order finite difference (f(x + eps d) - f(x)) / eps (§2.4, Def. 2.8)."""
    return (f(x + eps * d) - f(x)) / eps


class _FDNorm(torch.autograd.Function):
    """N(x) whose backward is the finite difference FD_N(x, grad) (recipe B)."""

    @staticmethod
    def forward(ctx, x, kind, eps, fd_eps):
        ctx.save_for_backward(x)
        ctx.cfg = (kind, eps, fd_eps)
        return normalize(x, kind, eps)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        kind, eps, fd_eps = ctx.cfg
        return fd(lambda t: normalize(t, kind, eps), x, g, fd_eps), None, None, None


class _FDAct(torch.autograd.Function):
    """GELU (tanh) whose backward is FD_sigma(z, grad)."""

    @staticmethod
    def forward(ctx, z, fd_eps):
        ctx.save_for_backward(z)
        ctx.fd_eps = fd_eps
        return gelu(z)

    @staticmethod
    def backward(ctx, g):
        (z,) = ctx.saved_tensors
        return fd(gelu, z, g, ctx.fd_eps), None


class _FDGLU(torch.autograd.Function):
    """silu(a) * b with d_b = g silu(a) (exact) and d_a = [silu(a + eps g) - silu(a)] b / eps
    (App. I.3, Def. I.7)."""

    @staticmethod
    def forward(ctx, a, b, fd_eps):
        ctx.save_for_backward(a, b)
        ctx.fd_eps = fd_eps
        return F.silu(a) * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return fd(F.silu, a, g, ctx.fd_eps) * b, g * F.silu(a), None


class _Ops:
    """The pieces of the forward that TinT's backward approximates; `surrogate` picks recipe B's versions."""

    def __init__(self, arch, opts=None, surrogate=False):
        self.arch, self.opts, self.surrogate = arch, opts, surrogate

    def norm(self, x):
        if self.surrogate and self.opts.norm_grad == "fd":
            return _FDNorm.apply(x, self.arch.norm, self.arch.eps, self.opts.fd_eps)
        return normalize(x, self.arch.norm, self.arch.eps)

    def act(self, z):
        if self.surrogate and self.opts.act_grad == "fd":
            return _FDAct.apply(z, self.opts.fd_eps)
        return gelu(z)

    def glu(self, a, b):
        if self.surrogate and self.opts.act_grad == "fd":
            return _FDGLU.apply(a, b, self.opts.fd_eps)
        return F.silu(a) * b

    def probs(self, A):
        if self.surrogate and self.opts.attn_grad == "value_only":
            return A.detach()
        return A


def _lin(x, w, b):
    """x (B, T, in) with per-sequence weights w (B, out, in), b (B, out) or None."""
    y = torch.matmul(x, w.transpose(1, 2))
    return y if b is None else y + b[:, None, :]


def _affine(n, w, b):
    y = n * w[:, None, :]
    return y if b is None else y + b[:, None, :]


def _block_forward(p, h, arch, rope, ops):
    """One auxiliary block with per-sequence weights; returns (output, cache)."""
    B, T, _ = h.shape
    H, dh = arch.n_head, arch.head_dim
    c = {"h": h}
    c["n1"] = n1 = ops.norm(h)
    c["u"] = u = _affine(n1, p["ln1_w"], p["ln1_b"])
    q, k, v = (_lin(u, p[w], p[b]).view(B, T, H, dh).transpose(1, 2)
               for w, b in (("wq", "bq"), ("wk", "bk"), ("wv", "bv")))
    q, k = apply_rope(q, rope), apply_rope(k, rope)
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(dh)
    causal = torch.ones(T, T, dtype=torch.bool, device=h.device).tril()
    c["A"] = A = ops.probs(torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1))
    c["a"] = a = torch.matmul(A, v).transpose(1, 2).reshape(B, T, H * dh)
    c["h1"] = h1 = h + _lin(a, p["wo"], p["bo"])
    c["n2"] = n2 = ops.norm(h1)
    c["r"] = r = _affine(n2, p["ln2_w"], p["ln2_b"])
    if arch.mlp == "gelu":
        c["z"] = z = _lin(r, p["w_up"], p["b_up"])
        c["g"] = g = ops.act(z)
    else:
        c["za"] = za = _lin(r, p["w_gate"], p["b_gate"])
        c["zb"] = zb = _lin(r, p["w_up"], p["b_up"])
        c["g"] = g = ops.glu(za, zb)
    return h1 + _lin(g, p["w_down"], p["b_down"]), c


def _embed(model, idx):
    x = model.wte.weight[idx]
    if model.wpe is not None:
        x = x + model.wpe.weight[: idx.size(1)]
    return x


def _lower_forward(model, idx, start):
    """Input of layer `start` (the first simulated one), computed with the frozen lower layers."""
    x = _embed(model, idx)
    rope = model._rope(0, idx.size(1), idx.device)
    for blk in model.blocks[:start]:
        x = blk(x, rope)
    return x.detach()


def _descent_sum(d, x, m):
    """sum_t m_t d_t x_t^T per sequence: (B, out, in)."""
    return torch.einsum("bto,bti->boi", d * m[..., None], x)


def _bias_sum(d, m):
    return (d * m[..., None]).sum(1)


def _explicit_grads(model, arch, layers, final, h_in, idx, m, c, opts, rope):
    """Recipe A: forward with cache, then the hand-written approximate backward (App. C-F:
    linear layers, attention values, norms, activation).
    Returns gradients {layer k: {key: grad}}, {"lnf_b": grad} (descent directions, before -lr)."""
    ops = _Ops(arch)
    eps = opts.fd_eps
    norm = lambda x: normalize(x, arch.norm, arch.eps)
    h, caches = h_in, []
    for p in layers:
        h, cache = _block_forward(p, h, arch, rope, ops)
        caches.append(cache)
    nf = norm(h)
    f = _affine(nf, final["lnf_w"], final["lnf_b"])
    df = loss_grad(f, model.lm_head.weight, idx, c)
    grads_final = {"lnf_b": _bias_sum(df, m) if final["lnf_b"] is not None else None}
    dh = fd(norm, h, final["lnf_w"][:, None] * df, eps)
    grads = [None] * len(layers)
    for k in reversed(range(len(layers))):
        p, cc = layers[k], caches[k]
        g = {}
        # MLP branch
        dy = torch.matmul(dh, p["w_down"])                       # dL/d(MLP hidden output)
        g["w_down"] = _descent_sum(dh, cc["g"], m)
        g["b_down"] = _bias_sum(dh, m) * opts.mlp_out_bias_lr_mult if p["b_down"] is not None else None
        if arch.mlp == "gelu":
            dz = fd(gelu, cc["z"], dy, eps)                      # FD through the activation
            dr = torch.matmul(dz, p["w_up"])
            g["w_up"], g["b_up"] = _descent_sum(dz, cc["r"], m), _bias_sum(dz, m) if p["b_up"] is not None else None
        else:
            d_up = dy * F.silu(cc["za"])
            d_gate = fd(F.silu, cc["za"], dy, eps) * cc["zb"]
            dr = torch.matmul(d_gate, p["w_gate"]) + torch.matmul(d_up, p["w_up"])
            g["w_up"], g["w_gate"] = _descent_sum(d_up, cc["r"], m), _descent_sum(d_gate, cc["r"], m)
            g["b_up"] = _bias_sum(d_up, m) if p["b_up"] is not None else None
            g["b_gate"] = _bias_sum(d_gate, m) if p["b_gate"] is not None else None
        g["ln2_b"] = _bias_sum(dr, m) if p["ln2_b"] is not None else None
        dh1 = dh + fd(norm, cc["h1"], p["ln2_w"][:, None] * dr, eps)   # FD through the norm
        # attention branch: value path only
        da = torch.matmul(dh1, p["wo"])
        g["wo"], g["bo"] = _descent_sum(dh1, cc["a"], m), _bias_sum(dh1, m) if p["bo"] is not None else None
        B, T, _ = da.shape
        da_h = da.view(B, T, arch.n_head, arch.head_dim).transpose(1, 2)
        eye = torch.eye(T, dtype=torch.bool, device=da.device)
        use = (eye | m.bool()[:, :, None])[:, None]              # A_{j,t} used iff j == t or m_j = 1
        dv = torch.matmul((cc["A"] * use).transpose(-1, -2), da_h).transpose(1, 2).reshape(B, T, -1)
        g["wv"], g["bv"] = _descent_sum(dv, cc["u"], m), _bias_sum(dv, m) if p["bv"] is not None else None
        du = torch.matmul(dv, p["wv"])
        g["ln1_b"] = _bias_sum(du, m) if p["ln1_b"] is not None else None
        dh = dh1 + fd(norm, cc["h"], p["ln1_w"][:, None] * du, eps)
        grads[k] = g
    return grads, grads_final


def _autograd_grads(model, arch, layers, final, h_in, idx, m, c, opts, rope):
    """Recipe B: surrogate forward + torch.autograd on the masked summed loss."""
    ops = _Ops(arch, opts, surrogate=True)
    keys = TINT_UPDATE if opts.update_set == "tint" else LAYER_KEYS
    with torch.enable_grad():
        leaves = []
        layers = [dict(p) for p in layers]
        for p in layers:
            for key in keys:
                if p[key] is not None:
                    p[key] = p[key].detach().requires_grad_(True)
                    leaves.append(p[key])
        final = dict(final)
        fkeys = ("lnf_b",) if opts.update_set == "tint" else ("lnf_w", "lnf_b")
        for key in fkeys:
            if final[key] is not None:
                final[key] = final[key].detach().requires_grad_(True)
                leaves.append(final[key])
        h = h_in
        for p in layers:
            h, _ = _block_forward(p, h, arch, rope, ops)
        f = _affine(ops.norm(h), final["lnf_w"], final["lnf_b"])
        logits = f @ model.lm_head.weight.t()
        nll = F.cross_entropy(logits.flatten(0, 1), idx.roll(-1, 1).flatten(), reduction="none")
        loss = (nll * c.flatten()).sum()
        gl = torch.autograd.grad(loss, leaves, allow_unused=True)
    it = iter(gl)
    grads = []
    for p in layers:
        g = {}
        for key in keys:
            if p[key] is not None:
                gk = next(it)
                g[key] = torch.zeros_like(p[key]) if gk is None else gk
        if g.get("b_down") is not None:
            g["b_down"] = g["b_down"] * opts.mlp_out_bias_lr_mult
        grads.append(g)
    gf = {}
    for key in fkeys:
        if final[key] is not None:
            gk = next(it)
            gf[key] = torch.zeros_like(final[key]) if gk is None else gk
    return grads, gf


def tint_update(aux_model, idx, n_train, lr=None, label_mask=None, **options):
    """TinT's approximate update for every sequence of idx (B, L) on its first n_train tokens.

    Returns (layers, final, start): `layers[k]` holds the per-sequence (B, ...) weights of auxiliary
    layer start + k after n_steps steps, `final` the final norm's. Never mutates the model.
    """
    opts = UpdateOptions(**({} if lr is None else {"lr": lr}), **options)
    check_aux_model(aux_model)
    arch = AuxArch.of(aux_model)
    B, T = idx.shape
    n_sim = arch.n_layer if opts.n_layers is None else opts.n_layers
    if not 1 <= n_sim <= arch.n_layer:
        raise ValueError(f"n_layers={n_sim} must be in [1, {arch.n_layer}]")
    start = arch.n_layer - n_sim
    m, c = make_masks(idx, n_train, label_mask)
    dtype = aux_model.wte.weight.dtype
    m, c = m.to(dtype), c.to(dtype)
    with torch.no_grad():
        h_in = _lower_forward(aux_model, idx, start)
        rope = aux_model._rope(0, T, idx.device)
        layers = [_batched(layer_params(aux_model, i), B) for i in range(start, arch.n_layer)]
        final = _batched(final_params(aux_model), B)
        grad_fn = _explicit_grads if opts.method == "explicit" else _autograd_grads
        for _ in range(opts.n_steps):
            grads, gfinal = grad_fn(aux_model, arch, layers, final, h_in, idx, m, c, opts, rope)
            # all updates together, from the pre-update weights
            layers = [{k: (v - opts.lr * g[k] if g.get(k) is not None else v) for k, v in p.items()}
                      for p, g in zip(layers, grads)]
            final = {k: (v - opts.lr * gfinal[k] if gfinal.get(k) is not None else v) for k, v in final.items()}
    return layers, final, start


def score_updated(aux_model, layers, final, start, idx, n_train):
    """Forward the updated auxiliary model (its own code, `functional_call`) per sequence; return the
    test-segment logits (B, L - n_train, V)."""
    outs = []
    with torch.no_grad():
        for b in range(idx.size(0)):
            state = to_module_state(aux_model, [{k: None if v is None else v[b] for k, v in p.items()}
                                                for p in layers],
                                    {k: None if v is None else v[b] for k, v in final.items()}, start)
            logits, _ = torch.func.functional_call(aux_model, state, (idx[b:b + 1],))
            outs.append(logits[:, n_train - 1: idx.size(1) - 1])
    return torch.cat(outs, 0)


def tint_reference(aux_model, idx, n_train, lr=None, label_mask=None, **options):
    """Test-segment logits (B, L - n_train, V) of the auxiliary model after TinT's update."""
    layers, final, start = tint_update(aux_model, idx, n_train, lr=lr, label_mask=label_mask, **options)
    return score_updated(aux_model, layers, final, start, idx, n_train)


def dyn_eval_reference(aux_model, idx, n_train, lr, full=False, **options):
    """Exact-gradient dynamic evaluation, the paper's baseline (§3.1): 'matched' (TinT's
    parameter set, summed loss, same lr; the repo's addition, to isolate the approximations) or `full=True`
    (every weight of the top blocks and the final norm; embeddings frozen)."""
    return tint_reference(aux_model, idx, n_train, lr=lr, method="autograd", attn_grad="full", norm_grad="exact",
                          act_grad="exact", update_set="all" if full else "tint", **options)

