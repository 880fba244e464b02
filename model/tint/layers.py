"""The TinT simulator's layers (arXiv:2307.01189 App. C-H): each a primitive with its gate (route, norm,
activation, GLU, linear forward / backward / descent, softmax attention), and the Forward and Backward
modules of one simulated layer built from them.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from model.gpt import rope_tables
from model.tint.auxiliary import gelu, normalize
from model.tint.primitives import Gate, HSplitLinear, TinTAttention


# ---------------------------------------------------------------------------- layers (primitive + gate)

def _blocks_vec(cfg, blocks, dtype):
    v = torch.zeros(cfg.D_s, dtype=dtype)
    for b in blocks:
        v[b * cfg.n_embd:(b + 1) * cfg.n_embd] = 1
    return v


def _token_write_gate(cfg, blocks, n_in=2, dtype=None, device=None):
    """The gate of a layer that writes the D-blocks `blocks` of the token rows from its output (input 1)
    and keeps the other channels and the prefix rows from its input (input 0)."""
    gate = Gate(cfg, n_in, dtype, device)
    out = _blocks_vec(cfg, blocks, torch.float64)
    gate.set(0, 1 - out, 1)
    gate.set(1, out, 0)
    return gate


def _row_mixing_map(cfg, spec, dtype, device):
    """A "dim" H-split map on the H_L x K grid that mixes whole D-blocks, shard by shard:
    spec {out_block: [(in_block, coef), ...]} (an empty list gives a zero block)."""
    m = HSplitLinear(cfg.H_L, cfg.K, ("dim",), dtype, device)
    A = torch.zeros(cfg.H_L, cfg.H_L, dtype=torch.float64)
    for ob, terms in spec.items():
        for ib, coef in terms:
            for s in range(cfg.S):
                A[ob * cfg.S + s, ib * cfg.S + s] += coef
    m.set_row_mixing(A)
    return m


class RouteLayer(nn.Module):
    """Row-wise linear layer ("dim" H-split map on the H_L x K grid) writing whole blocks of the token
    rows: spec {out_block: [(in_block, coef), ...]} (an empty list writes zeros). Other channels and
    the prefix rows are kept. Used for memory taps, moves, accumulations and the finite-difference maps."""

    def __init__(self, cfg, spec, dtype=None, device=None):
        super().__init__()
        self.map = _row_mixing_map(cfg, spec, dtype, device)
        self.gate = _token_write_gate(cfg, spec, dtype=dtype, device=device)

    def forward(self, e, ctx):
        return self.gate(ctx, [e, self.map(e)])


class NormLayer(nn.Module):
    """Group normalisation (App. E, Def. E.3): each listed D-block of the token rows normalised on its own
    (LayerNorm's normaliser, or RMSNorm's for LLaMA-style models, App. I.1, Def. I.2)."""

    def __init__(self, cfg, blocks, dtype=None, device=None):
        super().__init__()
        self.blocks, self.D, self.eps, self.kind = tuple(blocks), cfg.n_embd, cfg.norm_eps, cfg.norm
        self.gate = _token_write_gate(cfg, blocks, dtype=dtype, device=device)

    def forward(self, e, ctx):
        y = e.clone()
        for b in self.blocks:
            sl = slice(b * self.D, (b + 1) * self.D)
            y[..., sl] = normalize(e[..., sl], self.kind, self.eps)
        return self.gate(ctx, [e, y])


class ActLayer(nn.Module):
    """Row-wise MLP whose nonlinearity is the auxiliary activation (App. F): out = M_out sigma(M_in e),
    maps optional (identity when absent); writes block B0 of the token rows."""

    def __init__(self, cfg, in_spec=None, out_spec=None, dtype=None, device=None):
        super().__init__()
        self.in_map = self.out_map = None
        for name, spec in (("in_map", in_spec), ("out_map", out_spec)):
            if spec is not None:
                setattr(self, name, _row_mixing_map(cfg, spec, dtype, device))
        self.gate = _token_write_gate(cfg, [0], dtype=dtype, device=device)

    def forward(self, e, ctx):
        h = e if self.in_map is None else self.in_map(e)
        y = gelu(h)
        y = y if self.out_map is None else self.out_map(y)
        return self.gate(ctx, [e, y])


class GLULayer(nn.Module):
    """GLU primitive (the repo's realisation of App. I.3): out = M_out (silu(M_a e) * M_b e), M_* "dim" H-split maps
    (M_out optional); writes the blocks `out_blocks` of the token rows."""

    def __init__(self, cfg, a_spec, b_spec, out_spec=None, out_blocks=(0,), dtype=None, device=None):
        super().__init__()
        self.a_map = _row_mixing_map(cfg, a_spec, dtype, device)
        self.b_map = _row_mixing_map(cfg, b_spec, dtype, device)
        self.out_map = None if out_spec is None else _row_mixing_map(cfg, out_spec, dtype, device)
        self.gate = _token_write_gate(cfg, out_blocks, dtype=dtype, device=device)

    def forward(self, e, ctx):
        y = F.silu(self.a_map(e)) * self.b_map(e)
        y = y if self.out_map is None else self.out_map(y)
        return self.gate(ctx, [e, y])


def _lin_heads(cfg):
    S = cfg.S
    weight = [(s, r, s * S + r) for s in range(S) for r in range(S)]
    bias = [(s, S * S + s) for s in range(S)]
    return weight, bias


def _set_row_mixings(att, *mats):
    """The q, k, v and output maps of a linear-attention layer as row mixings of the H_L heads."""
    for m, A in zip((att.q_map, att.k_map, att.v_map, att.o_map), mats):
        m.set_row_mixing(A)


def _set_linear_forward(att, cfg):
    """Linear Forward (§2.3, App. C, Fig. 2): token t, weight head (s, r): query x_t^(r) (shard r of B0),
    key shard sS+r of prefix row j, value e_j -> sum_j <x^(r), w^(r)_{sK+j}> e_j; bias head s: query e_0,
    key e_j, value the bias shard s -> b^(s). Output: B0 shard s = sum_r head (s, r) + bias head s."""
    Tm = cfg.block_size
    weight, bias = _lin_heads(cfg)
    H = cfg.H_L
    Aq, Ak, Av, Ao = (torch.zeros(H, H, dtype=torch.float64) for _ in range(4))
    with torch.no_grad():
        for s, r, h in weight:
            Aq[h, r] = 1
            Ak[h, h] = 1
            att.lam[2, h] = 1
            Ao[s, h] = 1
        for s, h in bias:
            Av[h, h] = 1
            att.lam[0, h] = 1
            att.lam[1, h] = 1
            Ao[s, h] = 1
        att.pos_q[:Tm, 0] = 1                          # token rows -> e_0
        for j in range(cfg.K):
            att.pos_k[Tm + j, j] = 1                   # prefix row j -> e_j
            att.pos_v[Tm + j, j] = 1
    _set_row_mixings(att, Aq, Ak, Av, Ao)


def _set_linear_backward(att, cfg):
    """Linear Backward (App. C, Def. C.2, Fig. 4): head (s, r): query pi_s(dy) (shard s of B0), key e_j,
    value w^(r)_{sK+j} (prefix shard sS+r); output B0 shard r = sum_s head (s, r) = (W^T dy)^(r)."""
    Tm = cfg.block_size
    weight, _ = _lin_heads(cfg)
    H = cfg.H_L
    Aq, Ak, Av, Ao = (torch.zeros(H, H, dtype=torch.float64) for _ in range(4))
    with torch.no_grad():
        for s, r, h in weight:
            Aq[h, s] = 1
            att.lam[1, h] = 1
            Av[h, h] = 1
            Ao[r, h] = 1
        for j in range(cfg.K):
            att.pos_k[Tm + j, j] = 1
    _set_row_mixings(att, Aq, Ak, Av, Ao)


def _set_linear_descent(att, cfg, lr_weight, lr_bias):
    """Linear Descent (App. C, Def. C.3, Fig. 5): prefix row j is the query (e_j); weight head (s, r): key
    pi_s(dy_t), value -lr x_t^(r) (x in BS) -> adds -lr sum_t dy_t[sK+j] x_t^(r) to slot s shard r; bias
    head s: key e_0, value -lr dy_t^(s) -> adds -lr sum_t dy_t^(s) to the bias shard of row 0 only. lr is
    folded into the value maps (a construction constant); lr_weight = 0 gives the bias-only descent of the
    norms."""
    S, Tm = cfg.S, cfg.block_size
    weight, bias = _lin_heads(cfg)
    H = cfg.H_L
    Aq, Ak, Av, Ao = (torch.zeros(H, H, dtype=torch.float64) for _ in range(4))
    with torch.no_grad():
        att.lam[0, :] = 1
        for j in range(cfg.K):
            att.pos_q[Tm + j, j] = 1
        att.pos_k[:Tm, 0] = 1
        for s, r, h in weight:
            Ak[h, s] = 1
            Av[h, S * S + r] = -lr_weight
            Ao[h, h] = 1
        for s, h in bias:
            att.lam[1, h] = 1
            Av[h, s] = -lr_bias
            Ao[h, h] = 1
    _set_row_mixings(att, Aq, Ak, Av, Ao)


class LinearLayer(nn.Module):
    """Linear Forward as a layer: token rows get y = W x + b in B0; prefix rows kept."""

    def __init__(self, cfg, dtype=None, device=None):
        super().__init__()
        self.att = TinTAttention(cfg, cfg.H_L, "linear", ("dim",), dtype=dtype, device=device)
        _set_linear_forward(self.att, cfg)
        self.gate = _token_write_gate(cfg, [0], dtype=dtype, device=device)

    def forward(self, e, ctx):
        return self.gate(ctx, [e, self.att(e, ctx, ctx.masks["tok2pre"])])


class BackwardDescentLayer(nn.Module):
    """[Linear Backward || Linear Descent] on the same input (App. C; one layer, as the
    authors' code's Linear_Descent_Backward):
    token rows get W^T dy in B0, prefix rows get W - lr sum dy x^T (and b - lr sum dy). Both read the
    pre-update W. descent=False: backward only (norms without a bias)."""

    def __init__(self, cfg, lr_weight, lr_bias, descent=True, dtype=None, device=None):
        super().__init__()
        self.bwd = TinTAttention(cfg, cfg.H_L, "linear", ("dim",), dtype=dtype, device=device)
        _set_linear_backward(self.bwd, cfg)
        self.desc = None
        if descent:
            self.desc = TinTAttention(cfg, cfg.H_L, "linear", ("dim",), dtype=dtype, device=device)
            _set_linear_descent(self.desc, cfg, lr_weight, lr_bias)
        self.gate = _token_write_gate(cfg, [0], 3 if descent else 2, dtype, device)
        if descent:
            self.gate.set(2, 0, 1)              # input 2 (the descent) is added to the prefix rows

    def forward(self, e, ctx):
        xs = [e, self.bwd(e, ctx, ctx.masks["tok2pre"])]
        if self.desc is not None:
            xs.append(self.desc(e, ctx, ctx.masks["pre2train"]))
        return self.gate(ctx, xs)


class SoftmaxLayer(nn.Module):
    """The auxiliary softmax attention (§2.5, App. D) with H_soft heads: head h takes q^h (from block q_block),
    k^h (k_block) and v^h (B0) into its first d_a coordinates (three-pass H-split maps), scores scaled by
    1/sqrt(d_a) (after RoPE for LLaMA-style models); causal among tokens, prefix columns masked.
    transpose=True: the dv backward, A^T mixing the values (row t uses column j iff j == t or j > t
    with m_j = 1)."""

    def __init__(self, cfg, q_block, k_block, transpose=False, dtype=None, device=None):
        super().__init__()
        H = cfg.H_soft
        self.att = TinTAttention(cfg, H, "softmax", ("dim", "split", "dim"), transpose, dtype, device)
        d, da, D = cfg.D_s // H, cfg.head_dim, cfg.n_embd
        cell = lambda ch: (ch // d, ch % d)

        def routes(block, w):
            return tuple((cell(block * D + h * da + i), (h, i), w) for h in range(cfg.n_head) for i in range(da))

        self.att.q_map.set_routes(routes(q_block, 1.0))
        self.att.score_scale = 1 / math.sqrt(da)
        if cfg.pos == "rope":
            cos, sin = rope_tables(da, cfg.block_size, cfg.rope_theta, dtype=dtype)
            z = lambda: nn.Parameter(torch.zeros(cfg.P, da // 2, dtype=dtype, device=device),
                                     requires_grad=False)
            self.att.rope_cos, self.att.rope_sin = z(), z()
            with torch.no_grad():
                self.att.rope_cos[:cfg.block_size] = cos
                self.att.rope_cos[cfg.block_size:] = 1.0
                self.att.rope_sin[:cfg.block_size] = sin
        self.att.k_map.set_routes(routes(k_block, 1.0))
        self.att.v_map.set_routes(routes(0, 1.0))
        self.att.o_map.set_routes(tuple(((h, i), cell(h * da + i), 1.0) for h in range(cfg.n_head)
                                        for i in range(da)))
        self.gate = _token_write_gate(cfg, [0], dtype=dtype, device=device)

    def forward(self, e, ctx):
        y = self.att(e, ctx, ctx.masks["causal"], ctx.masks["vgrad"] if self.att.transpose else None)
        return self.gate(ctx, [e, y])


class ResidualGate(nn.Module):
    """The block-level residual connection (the simulator's only one, mirroring the auxiliary block's):
    token rows B0 = input + chain output, other channels and prefix rows from the chain."""

    def __init__(self, cfg, dtype=None, device=None):
        super().__init__()
        self.gate = Gate(cfg, 2, dtype, device)
        self.gate.set(0, _blocks_vec(cfg, [0], torch.float64), 0)
        self.gate.set(1, 1, 1)

    def forward(self, e_in, e, ctx):
        return self.gate(ctx, [e_in, e])


class Seq(nn.ModuleList):
    def forward(self, e, ctx):
        for layer in self:
            e = layer(e, ctx)
        return e


# ---------------------------------------------------------------------------- modules (App. C-H)

def ln_forward(cfg, dt, dev):
    """LayerNorm forward (App. E): tap x -> BS and B_{S-1}; group-norm B0 and B_{S-1}; Linear Forward
    (diag gamma, beta). Memory: (N(x), x) in (B_{S-1}, BS)."""
    S = cfg.S
    return Seq([RouteLayer(cfg, {S - 1: [(0, 1.0)], S: [(0, 1.0)]}, dt, dev), NormLayer(cfg, [0, S - 1], dt, dev),
                LinearLayer(cfg, dt, dev)])


def ln_backward(cfg, dt, dev):
    """LayerNorm backward || bias descent (§2.4, App. E, Def. E.2): gamma * dy (Linear Backward with
    diag gamma) || beta -= lr sum dy; then x + eps gamma dy; group norm; (N(x + eps gamma dy) - N(x)) / eps."""
    S, eps = cfg.S, cfg.fd_eps
    has_beta = cfg.norm == "layernorm" and cfg.bias        # RMSNorm / bias-free LayerNorm: nothing to update
    return Seq([BackwardDescentLayer(cfg, 0.0, cfg.lr, descent=has_beta, dtype=dt, device=dev),
                RouteLayer(cfg, {0: [(S, 1.0), (0, eps)]}, dt, dev), NormLayer(cfg, [0], dt, dev),
                RouteLayer(cfg, {0: [(0, 1.0 / eps), (S - 1, -1.0 / eps)]}, dt, dev)])


def _tap(cfg, dt, dev):
    return RouteLayer(cfg, {cfg.S: [(0, 1.0)]}, dt, dev)


class ForwardLayer(nn.Module):
    """The modules that simulate the forward of one auxiliary block (Fig. 1)."""

    def __init__(self, cfg, dt, dev):
        super().__init__()
        S = cfg.S
        self.ln1 = ln_forward(cfg, dt, dev)
        self.attn_tap = _tap(cfg, dt, dev)                       # u -> BS
        self.qkv = LinearLayer(cfg, dt, dev)                     # one Linear Forward for Q, K and V
        self.route_q = RouteLayer(cfg, {S - 2: [(0, 1.0)], 0: [(S, 1.0)]}, dt, dev)
        self.route_k = RouteLayer(cfg, {S - 1: [(0, 1.0)], 0: [(S, 1.0)]}, dt, dev)
        self.softmax = SoftmaxLayer(cfg, S - 2, S - 1, dtype=dt, device=dev)
        self.o = Seq([_tap(cfg, dt, dev), LinearLayer(cfg, dt, dev)])
        self.res_attn = ResidualGate(cfg, dt, dev)
        self.ln2 = ln_forward(cfg, dt, dev)
        self.ffn_init = RouteLayer(cfg, {1: [(0, 1.0)], 2: []}, dt, dev)        # r -> B1, accumulator B2 = 0
        # one set of modules shared by the FFN chunks (App. H)
        if cfg.mlp == "gelu":
            self.up = Seq([_tap(cfg, dt, dev), LinearLayer(cfg, dt, dev)])       # z = W_1 r + b_1 (memory r)
            self.act = Seq([_tap(cfg, dt, dev), ActLayer(cfg, dtype=dt, device=dev)])   # g = gelu(z) (memory z)
        else:
            self.gate_lin = Seq([_tap(cfg, dt, dev), LinearLayer(cfg, dt, dev)])  # a = W_gate r (memory r)
            self.route_a = RouteLayer(cfg, {S - 1: [(0, 1.0)], 0: [(1, 1.0)]}, dt, dev)
            self.up = LinearLayer(cfg, dt, dev)                                  # b = W_up r
            self.glu = Seq([_tap(cfg, dt, dev),                                  # memory (a, b)
                            GLULayer(cfg, {0: [(S - 1, 1.0)]}, {0: [(0, 1.0)]}, dtype=dt, device=dev)])
        self.down = Seq([_tap(cfg, dt, dev), LinearLayer(cfg, dt, dev)])         # y = W_2 g + b_2 (memory g)
        self.ffn_acc = RouteLayer(cfg, {2: [(2, 1.0), (0, 1.0)], 0: [(1, 1.0)]}, dt, dev)
        self.ffn_out = RouteLayer(cfg, {0: [(2, 1.0)]}, dt, dev)
        self.res_mlp = ResidualGate(cfg, dt, dev)


class BackwardLayer(nn.Module):
    """The [Backward || Descent] modules of one simulated auxiliary block (Fig. 1)."""

    def __init__(self, cfg, dt, dev):
        super().__init__()
        lr = cfg.lr
        S, eps = cfg.S, cfg.fd_eps
        lr_b = lr if cfg.bias else 0.0                  # bias-free models: bias descent off
        self.down = BackwardDescentLayer(cfg, lr, lr_b * cfg.mlp_out_bias_lr_mult / cfg.n_chunks, True, dt, dev)
        if cfg.mlp == "gelu":
            # dz = (gelu(z + eps dg) - gelu(z)) / eps: one MLP, z from memory (App. F)
            self.act = ActLayer(cfg, {0: [(S, 1.0), (0, eps)], 1: [(S, 1.0)]},
                                {0: [(0, 1.0 / eps), (1, -1.0 / eps)]}, dt, dev)
            self.up = BackwardDescentLayer(cfg, lr, lr_b, True, dt, dev)
        else:
            # (a, b) from memory, dm in B0: d_gate = silu(a + eps dm) b/eps - silu(a) b/eps -> B0,
            # d_up = silu(a) dm -> B_{S-1}: one GLU layer with three hidden blocks (Def. I.7)
            self.glu = GLULayer(cfg, {0: [(S - 1, 1.0), (0, eps)], 1: [(S - 1, 1.0)], 2: [(S - 1, 1.0)]},
                                {0: [(S, 1.0 / eps)], 1: [(S, -1.0 / eps)], 2: [(0, 1.0)]},
                                {0: [(0, 1.0), (1, 1.0)], S - 1: [(2, 1.0)]}, out_blocks=(0, S - 1),
                                dtype=dt, device=dev)
            self.gate_lin = BackwardDescentLayer(cfg, lr, lr_b, True, dt, dev)
            self.route_gu = RouteLayer(cfg, {2: [(2, 1.0), (0, 1.0)], 0: [(S - 1, 1.0)]}, dt, dev)
            self.up = BackwardDescentLayer(cfg, lr, lr_b, True, dt, dev)
        self.ffn_init = RouteLayer(cfg, {1: [(0, 1.0)], 2: []}, dt, dev)        # dh -> B1, accumulator B2 = 0
        self.ffn_acc = RouteLayer(cfg, {2: [(2, 1.0), (0, 1.0)], 0: [(1, 1.0)]}, dt, dev)
        self.ffn_out = RouteLayer(cfg, {0: [(2, 1.0)]}, dt, dev)
        self.ln2 = ln_backward(cfg, dt, dev)
        self.res_mlp = ResidualGate(cfg, dt, dev)
        self.o = BackwardDescentLayer(cfg, lr, lr_b, True, dt, dev)
        self.softmax = SoftmaxLayer(cfg, cfg.S - 2, cfg.S - 1, transpose=True, dtype=dt, device=dev)
        self.v = BackwardDescentLayer(cfg, lr, lr_b, True, dt, dev)
        self.ln1 = ln_backward(cfg, dt, dev)
        self.res_attn = ResidualGate(cfg, dt, dev)
