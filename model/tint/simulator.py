"""The TinT simulator ("TinT-Sim"; arXiv:2307.01189 §2 and App. B-H): a transformer whose own parameters
do not depend on the auxiliary weights.

The auxiliary weights are *data*: they sit on K prefix rows placed before the token rows (§2.2,
Def. 2.1), and linear-attention heads between token rows and prefix rows compute every auxiliary linear
map: forward W x + b, backward W^T d, descent W <- W - lr * sum_t d_t x_t^T (§2.3, App. C). All its maps
are H-split (split-wise / dimension-wise) linear maps (App. C.1, Defs. C.4 and C.5).

The simulator is modular, as the paper's sizes and the authors' code imply: state travels from a module
to a much later one only through two explicit side channels, `ActivationMemory` and `PrefixMemory`, whose
only methods are `put` and `get` and which only clone. (Keeping every layer's memory and updated weights
in one residual stream instead would need a stream about 20 D wide per simulated layer; making the side
channels explicit, copy-only classes that a test can audit is the repo's choice.) Everything the
simulator does to auxiliary data happens in its primitive layers (TinT attention, H-split linear maps,
group norm, row-wise MLP / GLU, gates) except two declared ops, as in the authors' code (App. G,
Remark G.3): the embedding lookup at the input and the LM head / loss gradient at the top.

Supported auxiliary models: GPT-2 style (the paper's construction: LayerNorm, GELU, learned or no
positions, with or without biases) and, as the repo's own extension of the paper's sketches in App. I,
LLaMA style (group-RMSNorm, a GLU primitive for SwiGLU, RoPE inside the softmax heads; S = D / K >= 4 for
the extra memory). Both need n_head * head_dim == n_embd and a tied or untied head; not the Pro / FoX /
CASTLE options.

Section, appendix, definition and figure numbers below refer to arXiv:2307.01189.
"""
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from model.gpt import apply_rope, mlp_hidden_size, rope_tables
from model.tint.auxiliary import (
    check_aux_model,
    final_params,
    gelu,
    layer_params,
    loss_grad,
    make_masks,
    normalize,
)


# ---------------------------------------------------------------------------- layout and configuration
#
# Layout (§2.2-2.3, App. C). D = n_embd, K prefix rows, S = D / K >= 3, D_s = (S + 1) D.
# A row is a D_s vector seen as D_s / D channel blocks B0 .. BS of width D, each made of S shards of
# K channels (shard index = channel // K; the grid of the linear modules is H_L = (S + 1) S rows of K).
#   token rows:  B0 = the auxiliary signal; B1 .. BS = scratch and the memory a backward module needs
#                (linear layer input x: BS; norm (N(x), x): (B_{S-1}, BS); attention (q, k, u): B_{S-2..S}).
#   prefix row j, for a D x D map (W, b): slot s < S (channels [sD, (s+1)D)) holds row w_{sK + j};
#                the bias slot BS holds b (only row 0's copy is read and updated). A norm (gamma, beta) is
#                the map diag(gamma) with bias beta. (The authors' code puts row jS + s in slot s of prefix
#                row j; rows sK + j are the repo's choice: they make every re-ordering of the linear modules
#                a whole-shard move, so each of their maps is a single "dim" H-split stage.)
# Heads of the linear modules (H_L heads of size K): weight head (s, r) = s S + r reads shard s S + r of
# the prefix row; bias head s = S^2 + s reads the bias shard S^2 + s.

class SideChannel:
    """Copy-only store between simulator modules: `put` stores a clone, `get` returns a clone. It holds no
    arithmetic, so a test can prove that all computation is in the modules."""

    def __init__(self):
        self._store = {}

    def put(self, key, value):
        self._store[key] = value.detach().clone()

    def get(self, key):
        return self._store[key].clone()


class ActivationMemory(SideChannel):
    """(layer, op) -> the memory channels of the token rows written by a forward module."""


class PrefixMemory(SideChannel):
    """(layer, param) -> the K x D_s prefix contents (the auxiliary weights, current version)."""


@dataclass
class SimConfig:
    """Sizes of the simulator built around one auxiliary configuration, by the sizing rule of the authors'
    code: K divides D, S = D / K weight rows per prefix row, D_s = (S + 1) D, H_L = (S + 1) S linear-attention
    heads of size K."""
    n_embd: int
    n_head: int
    head_dim: int
    n_layer: int
    vocab_size: int
    block_size: int            # T_max: longest auxiliary sequence (position one-hots)
    mlp_hidden: int
    bias: bool
    norm_eps: float
    pos: str
    lr: float
    n_layers: int              # n_sim
    n_steps: int = 1
    fd_eps: float = 1e-3
    mlp_out_bias_lr_mult: float = 1.0
    K: int = 0                 # prefix rows; 0: D / S with the smallest S >= 3 dividing D
    H_soft: int = 0            # heads of the softmax modules; 0: H_L when K >= head_dim
    gate_scale: float = 100.0  # tanh(100) == 1.0 exactly even in fp64
    norm: str = "layernorm"    # "layernorm" | "rmsnorm"
    mlp: str = "gelu"          # "gelu" | "swiglu"
    rope_theta: float = 10000.0
    S: int = field(init=False)
    D_s: int = field(init=False)
    H_L: int = field(init=False)
    P: int = field(init=False)
    n_chunks: int = field(init=False)

    def __post_init__(self):
        D = self.n_embd
        if self.n_head * self.head_dim != D:
            raise ValueError("the simulator needs n_head * head_dim == n_embd (square D x D maps)")
        if self.pos == "rope" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}; use pos=learned or none")
        min_S = 4 if self.mlp == "swiglu" else 3   # SwiGLU keeps (a, b) in memory next to dh and the sum
        if not self.K:
            S = next((s for s in range(min_S, D + 1) if D % s == 0), None)
            if S is None:
                raise ValueError(f"n_embd={D} has no divisor S >= {min_S}")
            self.K = D // S
        if D % self.K or D // self.K < min_S:
            raise ValueError(f"K={self.K} must divide n_embd={D} with S = D / K >= {min_S} (scratch blocks)")
        self.S = D // self.K
        self.D_s = (self.S + 1) * D
        self.H_L = (self.S + 1) * self.S
        if not self.H_soft:
            cands = [self.H_L] + list(range(self.n_head, self.D_s + 1))
            self.H_soft = next(h for h in cands if self.D_s % h == 0 and self.D_s // h >= self.head_dim
                               and h >= self.n_head)
        if self.D_s % self.H_soft or self.D_s // self.H_soft < self.head_dim or self.H_soft < self.n_head:
            raise ValueError(f"H_soft={self.H_soft} must divide D_s={self.D_s}, be >= n_head and give heads "
                             f">= head_dim={self.head_dim}")
        self.P = self.block_size + self.K
        self.n_chunks = -(-self.mlp_hidden // D)
        if not 1 <= self.n_layers <= self.n_layer:
            raise ValueError(f"n_layers={self.n_layers} must be in [1, {self.n_layer}]")

    @classmethod
    def from_aux(cls, config, lr, n_layers=None, **kw):
        return cls(n_embd=config.n_embd, n_head=config.n_head, head_dim=config.head_dim, n_layer=config.n_layer,
                   vocab_size=config.vocab_size, block_size=config.block_size,
                   mlp_hidden=mlp_hidden_size(config), bias=config.bias, norm_eps=config.norm_eps, pos=config.pos,
                   norm=config.norm, mlp=config.mlp, rope_theta=config.rope_theta,
                   lr=lr, n_layers=config.n_layer if n_layers is None else n_layers, **kw)


# ---------------------------------------------------------------------------- primitives

class HSplitLinear(nn.Module):
    """A linear map of R^{D_s} seen as an H x d grid (row h = head h), as a product of H-split stages
    (App. C.1, Defs. C.4 and C.5): "dim" (dimension-wise: per column c an H x H matrix, d H^2 parameters)
    and "split" (split-wise: per row h a d x d matrix, H d^2 parameters). ("dim",) moves and mixes whole
    rows; ("dim", "split", "dim") realises any re-ordering of the grid cells (three-pass permutation)."""

    def __init__(self, H, d, stages, dtype=None, device=None):
        super().__init__()
        self.H, self.d, self.stages = H, d, tuple(stages)
        self.weights = nn.ParameterList(
            nn.Parameter(torch.zeros((d, H, H) if s == "dim" else (H, d, d), dtype=dtype, device=device),
                         requires_grad=False) for s in self.stages)

    def forward(self, x):
        g = x.unflatten(-1, (self.H, self.d))
        for s, w in zip(self.stages, self.weights):
            if s == "dim":      # out[g, c] = sum_h w[c, g, h] x[h, c]
                g = torch.einsum("...hc,cgh->...gc", g, w)
            else:               # out[h, f] = sum_c w[h, f, c] x[h, c]
                g = torch.einsum("...hc,hfc->...hf", g, w)
        return g.flatten(-2)

    @torch.no_grad()
    def set_row_mixing(self, A):
        """("dim",) stage: output row g = sum_h A[g][h] * input row h."""
        assert self.stages == ("dim",)
        self.weights[0].copy_(torch.as_tensor(A, dtype=self.weights[0].dtype).expand(self.d, self.H, self.H))

    @torch.no_grad()
    def set_routes(self, routes):
        """("dim", "split", "dim") stages moving input cell (h, c) to output cell (h', c') times w, for a list
        of routes ((h, c), (h', c'), w) with distinct sources and distinct destinations."""
        assert self.stages == ("dim", "split", "dim")
        W1, W2, W3 = compile_routes(self.H, self.d, routes)
        for p, W in zip(self.weights, (W1, W2, W3)):
            p.copy_(W)


_ROUTE_CACHE = {}


def _augment(u, adj, match_r, seen):
    """Kuhn's augmenting path from input column u (bipartite matching)."""
    for v in adj[u]:
        if not seen[v]:
            seen[v] = True
            if match_r[v] < 0 or _augment(match_r[v], adj, match_r, seen):
                match_r[v] = u
                return True
    return False


def compile_routes(H, d, routes):
    """Three-pass grid permutation (the repo's construction; that three passes realise any re-ordering
    follows from König's edge-colouring theorem): complete the partial permutation, colour the H-regular
    bipartite multigraph (input column -> output column) with H perfect matchings; colour k is the middle
    row. Returns float64 (W1 dim, W2 split, W3 dim)."""
    key = (H, d, tuple(routes))
    if key in _ROUTE_CACHE:
        return _ROUTE_CACHE[key]
    src = {r[0] for r in routes}
    dst = {r[1] for r in routes}
    if len(src) != len(routes) or len(dst) != len(routes):
        raise ValueError("routes must have distinct sources and destinations")
    free_s = [(h, c) for h in range(H) for c in range(d) if (h, c) not in src]
    free_d = [(h, c) for h in range(H) for c in range(d) if (h, c) not in dst]
    edges = list(routes) + [(s, t, 0.0) for s, t in zip(free_s, free_d)]
    pair_edges = {}
    for i, ((_, cs), (_, cd), _) in enumerate(edges):
        pair_edges.setdefault((cs, cd), []).append(i)
    count = {}
    for (cs, cd), ids in pair_edges.items():
        count[(cs, cd)] = len(ids)
    W1 = torch.zeros(d, H, H, dtype=torch.float64)
    W2 = torch.zeros(H, d, d, dtype=torch.float64)
    W3 = torch.zeros(d, H, H, dtype=torch.float64)
    for k in range(H):
        adj = [[] for _ in range(d)]
        for (cs, cd), n in count.items():
            if n:
                adj[cs].append(cd)
        match_r = [-1] * d          # output column -> input column

        for u in range(d):
            if not _augment(u, adj, match_r, [False] * d):
                raise RuntimeError("no perfect matching (not a regular multigraph?)")
        for cd, cs in enumerate(match_r):
            i = pair_edges[(cs, cd)].pop()
            count[(cs, cd)] -= 1
            (hs, _), (hd, _), w = edges[i]
            W1[cs, k, hs] = w
            W2[k, cd, cs] = 1.0
            W3[cd, hd, k] = 1.0
    _ROUTE_CACHE[key] = (W1, W2, W3)
    return W1, W2, W3


class Gate(nn.Module):
    """Position-dependent gated combination (as in the authors' code): new = sum_i G_i * x_i over the
    inputs (x_0 = the old state, then module outputs), G_i[row, ch] = tanh(scale * (rho(row) c_i[ch] +
    b_i[ch])) with rho = one-hot . w_rho (1 on prefix rows, 0 on token rows). Gates are exactly 0 or 1."""

    def __init__(self, cfg, n_in, dtype=None, device=None):
        super().__init__()
        self.scale = cfg.gate_scale
        self.w_rho = nn.Parameter(torch.zeros(cfg.P, dtype=dtype, device=device), requires_grad=False)
        self.c = nn.Parameter(torch.zeros(n_in, cfg.D_s, dtype=dtype, device=device), requires_grad=False)
        self.b = nn.Parameter(torch.zeros(n_in, cfg.D_s, dtype=dtype, device=device), requires_grad=False)
        with torch.no_grad():
            self.w_rho[cfg.block_size:] = 1.0   # prefix one-hot coordinates

    @torch.no_grad()
    def set(self, i, token, prefix):
        """Input i's gate: 0/1 channel vectors (or scalars) on token rows and on prefix rows."""
        token = torch.as_tensor(token, dtype=self.b.dtype).expand(self.b.size(1))
        prefix = torch.as_tensor(prefix, dtype=self.b.dtype).expand(self.b.size(1))
        self.b[i] = token
        self.c[i] = prefix - token

    def forward(self, ctx, xs):
        rho = ctx.onehot @ self.w_rho                                           # (N,)
        G = torch.tanh(self.scale * (rho[None, :, None] * self.c[:, None, :] + self.b[:, None, :]))
        out = G[0] * xs[0]
        for g, x in zip(G[1:], xs[1:]):
            out = out + g * x
        return out


class TinTAttention(nn.Module):
    """TinT attention (paper Def. B.1): H heads of size d = D_s / H; q, k, v = H-split map of the row plus
    lambda_h * (one-hot . W^p) (W^p shared by the heads, gated per head); scores linear (q . k, times the
    0/1 mask) or softmax (masked). `transpose` mixes the values with A^T, with a second 0/1 mask applied to
    A^T: the dv backward in one module, as the authors' code does it (App. D uses two). Output: concatenated
    heads through an H-split map."""

    def __init__(self, cfg, H, kind, stages, transpose=False, dtype=None, device=None):
        super().__init__()
        self.H, self.d, self.kind, self.transpose = H, cfg.D_s // H, kind, transpose
        mk = lambda: HSplitLinear(H, self.d, stages, dtype, device)
        self.q_map, self.k_map, self.v_map, self.o_map = mk(), mk(), mk(), mk()
        z = lambda *s: nn.Parameter(torch.zeros(*s, dtype=dtype, device=device), requires_grad=False)
        self.pos_q, self.pos_k, self.pos_v = z(cfg.P, self.d), z(cfg.P, self.d), z(cfg.P, self.d)
        self.lam = z(3, H)
        self.score_scale = 1.0                 # a constant of the softmax (1/sqrt(d_a) for the aux heads)
        # RoPE inside the softmax heads, (P, d_rot / 2) tables (the repo's extension; App. I.2 says "likewise")
        self.rope_cos = self.rope_sin = None

    def forward(self, e, ctx, mask, mask_t=None):
        B, N, _ = e.shape

        def proj(m, pos, lam):
            x = m(e).view(B, N, self.H, self.d) + lam[None, None, :, None] * (ctx.onehot @ pos)[None, :, None, :]
            return x.transpose(1, 2)

        q, k, v = proj(self.q_map, self.pos_q, self.lam[0]), proj(self.k_map, self.pos_k, self.lam[1]), \
            proj(self.v_map, self.pos_v, self.lam[2])
        if self.rope_cos is not None:
            # rotate the first d_rot coordinates of every head by the row's position (tables indexed by the
            # one-hot; prefix rows: no rotation), as model.gpt.apply_rope does
            rot = 2 * self.rope_cos.size(1)
            cs = (ctx.onehot @ self.rope_cos, ctx.onehot @ self.rope_sin)
            q = torch.cat([apply_rope(q[..., :rot], cs), q[..., rot:]], -1)
            k = torch.cat([apply_rope(k[..., :rot], cs), k[..., rot:]], -1)
        s = torch.matmul(q, k.transpose(-1, -2))
        if self.score_scale != 1.0:
            s = s * self.score_scale
        if self.kind == "linear":
            A = s * mask
        else:
            A = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
            if self.transpose:
                A = A.transpose(-1, -2) * mask_t
        y = torch.matmul(A, v).transpose(1, 2).reshape(B, N, -1)
        return self.o_map(y)


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

def _ln_forward(cfg, dt, dev):
    """LayerNorm forward (App. E): tap x -> BS and B_{S-1}; group-norm B0 and B_{S-1}; Linear Forward
    (diag gamma, beta). Memory: (N(x), x) in (B_{S-1}, BS)."""
    S = cfg.S
    return Seq([RouteLayer(cfg, {S - 1: [(0, 1.0)], S: [(0, 1.0)]}, dt, dev), NormLayer(cfg, [0, S - 1], dt, dev),
                LinearLayer(cfg, dt, dev)])


def _ln_backward(cfg, dt, dev):
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
        self.ln1 = _ln_forward(cfg, dt, dev)
        self.attn_tap = _tap(cfg, dt, dev)                       # u -> BS
        self.qkv = LinearLayer(cfg, dt, dev)                     # one Linear Forward for Q, K and V
        self.route_q = RouteLayer(cfg, {S - 2: [(0, 1.0)], 0: [(S, 1.0)]}, dt, dev)
        self.route_k = RouteLayer(cfg, {S - 1: [(0, 1.0)], 0: [(S, 1.0)]}, dt, dev)
        self.softmax = SoftmaxLayer(cfg, S - 2, S - 1, dtype=dt, device=dev)
        self.o = Seq([_tap(cfg, dt, dev), LinearLayer(cfg, dt, dev)])
        self.res_attn = ResidualGate(cfg, dt, dev)
        self.ln2 = _ln_forward(cfg, dt, dev)
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
        self.ln2 = _ln_backward(cfg, dt, dev)
        self.res_mlp = ResidualGate(cfg, dt, dev)
        self.o = BackwardDescentLayer(cfg, lr, lr_b, True, dt, dev)
        self.softmax = SoftmaxLayer(cfg, cfg.S - 2, cfg.S - 1, transpose=True, dtype=dt, device=dev)
        self.v = BackwardDescentLayer(cfg, lr, lr_b, True, dt, dev)
        self.ln1 = _ln_backward(cfg, dt, dev)
        self.res_attn = ResidualGate(cfg, dt, dev)


# ---------------------------------------------------------------------------- prefix encoding

def encode_linear(W, b, cfg):
    """(D x D map, bias) -> K x D_s prefix contents (layout above; the bias on every row, row 0's is used)."""
    K, S, D = cfg.K, cfg.S, cfg.n_embd
    out = W.new_zeros(K, cfg.D_s)
    out[:, :S * D] = W.reshape(S, K, D).permute(1, 0, 2).reshape(K, S * D)
    if b is not None:
        out[:, S * D:] = b
    return out


def decode_linear(P, cfg):
    """(B, K, D_s) prefix contents -> W (B, D, D), b (B, D) (row 0's bias)."""
    B, K, S, D = P.size(0), cfg.K, cfg.S, cfg.n_embd
    W = P[:, :, :S * D].reshape(B, K, S, D).permute(0, 2, 1, 3).reshape(B, D, D)
    return W, P[:, 0, S * D:]


def prefix_keys(cfg):
    keys = []
    for i in range(cfg.n_layer):
        keys += [(i, "ln1"), (i, "q"), (i, "k"), (i, "v"), (i, "o"), (i, "ln2")]
        for name in (("up", "down") if cfg.mlp == "gelu" else ("gate", "up", "down")):
            keys += [(i, name, c) for c in range(cfg.n_chunks)]
    return keys + [("lnf",)]


class _Ctx:
    def __init__(self, onehot, masks):
        self.onehot, self.masks = onehot, masks


class TinT(nn.Module):
    """The TinT simulator for an auxiliary GPT.

    Its parameters (`parameters()`) are the construction: they depend on the auxiliary *configuration*
    (sizes), on lr and fd_eps, never on the auxiliary weights, which are buffers (`load_aux`). One call
    runs, for every sequence of the batch with its own prefix rows: the auxiliary forward on all tokens,
    the loss gradient on the training segment (declared op), the approximate backward || descent
    through the top n_layers blocks, n_steps times, each followed by a forward of those blocks with the
    updated prefix contents; then the LM head (declared op) on the test segment.
    """

    def __init__(self, cfg: SimConfig, dtype=torch.float32, device=None):
        super().__init__()
        self.cfg = cfg
        dt, dev = dtype, device
        self.fwd = nn.ModuleList(ForwardLayer(cfg, dt, dev) for _ in range(cfg.n_layer))
        self.fwd_lnf = _ln_forward(cfg, dt, dev)
        self.bwd = nn.ModuleList(BackwardLayer(cfg, dt, dev) for _ in range(cfg.n_layers))
        self.bwd_lnf = _ln_backward(cfg, dt, dev)
        self.keys = prefix_keys(cfg)
        self.key_index = {k: i for i, k in enumerate(self.keys)}
        D = cfg.n_embd
        # auxiliary weights as data: not parameters, not saved with the simulator (one instance serves every
        # auxiliary model of its configuration)
        self.register_buffer("prefix_bank", torch.zeros(len(self.keys), cfg.K, cfg.D_s, dtype=dt, device=dev),
                             persistent=False)
        self.register_buffer("wte", torch.zeros(cfg.vocab_size, D, dtype=dt, device=dev), persistent=False)
        self.register_buffer("wpe", torch.zeros(cfg.block_size if cfg.pos == "learned" else 0, D, dtype=dt,
                                                device=dev), persistent=False)
        self.register_buffer("head", torch.zeros(cfg.vocab_size, D, dtype=dt, device=dev), persistent=False)
        self.side_channel_types = (ActivationMemory, PrefixMemory)   # tests may swap in recording versions
        self.last_prefix_memory = None

    @classmethod
    def from_model(cls, aux_model, lr, n_layers=None, n_steps=1, fd_eps=1e-3, mlp_out_bias_lr_mult=1.0, K=0,
                   H_soft=0):
        check_aux_model(aux_model)
        cfg = SimConfig.from_aux(aux_model.config, lr=lr, n_layers=n_layers, n_steps=n_steps, fd_eps=fd_eps,
                                 mlp_out_bias_lr_mult=mlp_out_bias_lr_mult, K=K, H_soft=H_soft)
        w = aux_model.wte.weight
        sim = cls(cfg, dtype=w.dtype, device=w.device)
        sim.load_aux(aux_model)
        return sim

    @torch.no_grad()
    def load_aux(self, aux_model):
        """Copy an auxiliary model's weights into the prefix bank, embeddings and head (data, not parameters)."""
        check_aux_model(aux_model)
        cfg, D = self.cfg, self.cfg.n_embd
        c = aux_model.config
        if (c.n_embd, c.n_layer, c.n_head, c.vocab_size, c.block_size, mlp_hidden_size(c), c.bias, c.norm_eps,
                c.norm, c.mlp, c.pos) != \
                (cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.vocab_size, cfg.block_size, cfg.mlp_hidden, cfg.bias,
                 cfg.norm_eps, cfg.norm, cfg.mlp, cfg.pos) or (c.pos == "rope" and c.rope_theta != cfg.rope_theta):
            raise ValueError("auxiliary model does not match the simulator's configuration")
        bank = {}
        Fp = cfg.n_chunks * D
        for i in range(cfg.n_layer):
            p = layer_params(aux_model, i)
            bank[(i, "ln1")] = encode_linear(torch.diag(p["ln1_w"]), p["ln1_b"], cfg)
            bank[(i, "ln2")] = encode_linear(torch.diag(p["ln2_w"]), p["ln2_b"], cfg)
            for name in ("q", "k", "v", "o"):
                bank[(i, name)] = encode_linear(p["w" + name], p["b" + name], cfg)
            # the FFN width padded with zero rows / columns to n_chunks * D (they stay zero under descent)
            w_down = p["w_down"].new_zeros(D, Fp)
            w_down[:, : p["w_down"].size(1)] = p["w_down"]
            ins = {}
            for name, w, b in (("up", p["w_up"], p["b_up"]), ("gate", p["w_gate"], p["b_gate"])):
                if w is None:
                    continue
                wp = w.new_zeros(Fp, D)
                wp[: w.size(0)] = w
                bp = None
                if b is not None:
                    bp = b.new_zeros(Fp)
                    bp[: b.size(0)] = b
                ins[name] = (wp, bp)
            for ch in range(cfg.n_chunks):
                sl = slice(ch * D, (ch + 1) * D)
                for name, (wp, bp) in ins.items():
                    bank[(i, name, ch)] = encode_linear(wp[sl], None if bp is None else bp[sl], cfg)
                # b_2 lives in chunk 0; every chunk's bias descends with lr / n_chunks: kappa = 1 (the repo's
                # choice; the authors' code stores b_2 / 4 in each of four chunks, so b_2 learns 4x: kappa = 4)
                b2 = None if p["b_down"] is None else (p["b_down"] if ch == 0 else torch.zeros_like(p["b_down"]))
                bank[(i, "down", ch)] = encode_linear(w_down[:, sl], b2, cfg)
        fp = final_params(aux_model)
        bank[("lnf",)] = encode_linear(torch.diag(fp["lnf_w"]), fp["lnf_b"], cfg)
        for k, i in self.key_index.items():
            self.prefix_bank[i].copy_(bank[k])
        self.wte.copy_(aux_model.wte.weight)
        if aux_model.wpe is not None:
            self.wpe.copy_(aux_model.wpe.weight)
        self.head.copy_(aux_model.lm_head.weight)

    # ------------------------------------------------------------------ inputs

    def _context(self, B, T, m):
        cfg, K = self.cfg, self.cfg.K
        N, dev, dt = K + T, self.wte.device, self.wte.dtype
        onehot = torch.zeros(N, cfg.P, dtype=dt, device=dev)
        onehot[torch.arange(K, device=dev), cfg.block_size + torch.arange(K, device=dev)] = 1
        onehot[K + torch.arange(T, device=dev), torch.arange(T, device=dev)] = 1
        is_tok = torch.arange(N, device=dev) >= K
        tok2pre = (is_tok[:, None] & ~is_tok[None, :]).to(dt)[None, None]
        train_col = torch.cat([torch.zeros(B, K, dtype=torch.bool, device=dev), m.bool()], 1)   # (B, N)
        pre2train = ((~is_tok)[None, :, None] & train_col[:, None, :]).to(dt)[:, None]
        pos = torch.arange(N, device=dev)
        causal = (is_tok[:, None] & is_tok[None, :] & (pos[None, :] <= pos[:, None])) | \
                 (~is_tok[:, None] & ~is_tok[None, :])
        # A^T usage: token row t, token column j: j == t or (j > t and m_j = 1)
        vg = is_tok[:, None] & is_tok[None, :] & ((pos[None, :] == pos[:, None]) |
                                                    (pos[None, :] > pos[:, None]))
        vgrad = (vg[None] & ((pos[None, :] == pos[:, None])[None] | train_col[:, None, :])).to(dt)[:, None]
        return _Ctx(onehot, {"tok2pre": tok2pre, "pre2train": pre2train, "causal": causal[None, None],
                             "vgrad": vgrad})

    # ------------------------------------------------------------------ declared ops (authors' code, Remark G.3)

    def _embed(self, idx):
        x = self.wte[idx]
        if self.wpe.numel():
            x = x + self.wpe[: idx.size(1)]
        return x

    def _loss_grad(self, f, idx, c):
        return loss_grad(f, self.head, idx, c)

    # ------------------------------------------------------------------ the program

    def _blk(self, b):
        D = self.cfg.n_embd
        return slice(b * D, (b + 1) * D)

    def _mem_slice(self, first, last):
        D = self.cfg.n_embd
        return slice(first * D, (last + 1) * D)

    def _prefix_in(self, e, PM, key):
        e = e.clone()
        e[:, : self.cfg.K] = PM.get(key)
        return e

    def _memory_in(self, e, AM, key, sl):
        e = e.clone()
        e[:, self.cfg.K:, sl] = AM.get(key)
        return e

    def _memory_out(self, e, AM, key, sl, record):
        if record:
            AM.put(key, e[:, self.cfg.K:, sl])

    def _forward_block(self, i, e, ctx, AM, PM, record):
        cfg, S = self.cfg, self.cfg.S
        F_ = self.fwd[i]
        mem_ln, mem_attn, mem_x = self._mem_slice(S - 1, S), self._mem_slice(S - 2, S), self._mem_slice(S, S)
        e_in = e
        e = F_.ln1(self._prefix_in(e, PM, (i, "ln1")), ctx)
        self._memory_out(e, AM, (i, "ln1"), mem_ln, record)
        e = F_.attn_tap(e, ctx)
        e = F_.qkv(self._prefix_in(e, PM, (i, "q")), ctx)
        e = F_.route_q(e, ctx)
        e = F_.qkv(self._prefix_in(e, PM, (i, "k")), ctx)
        e = F_.route_k(e, ctx)
        e = F_.qkv(self._prefix_in(e, PM, (i, "v")), ctx)
        e = F_.softmax(e, ctx)
        self._memory_out(e, AM, (i, "attn"), mem_attn, record)
        e = F_.o(self._prefix_in(e, PM, (i, "o")), ctx)
        self._memory_out(e, AM, (i, "o"), mem_x, record)
        e = F_.res_attn(e_in, e, ctx)
        e_in = e
        e = F_.ln2(self._prefix_in(e, PM, (i, "ln2")), ctx)
        self._memory_out(e, AM, (i, "ln2"), mem_ln, record)
        e = F_.ffn_init(e, ctx)
        for c in range(cfg.n_chunks):
            if cfg.mlp == "gelu":
                e = F_.up(self._prefix_in(e, PM, (i, "up", c)), ctx)
                self._memory_out(e, AM, (i, "up", c), mem_x, record)
                e = F_.act(e, ctx)
                self._memory_out(e, AM, (i, "act", c), mem_x, record)
            else:
                e = F_.gate_lin(self._prefix_in(e, PM, (i, "gate", c)), ctx)
                self._memory_out(e, AM, (i, "gate", c), mem_x, record)
                e = F_.route_a(e, ctx)
                e = F_.up(self._prefix_in(e, PM, (i, "up", c)), ctx)
                e = F_.glu(e, ctx)
                self._memory_out(e, AM, (i, "glu", c), mem_ln, record)
            e = F_.down(self._prefix_in(e, PM, (i, "down", c)), ctx)
            self._memory_out(e, AM, (i, "down", c), mem_x, record)
            e = F_.ffn_acc(e, ctx)
        e = F_.ffn_out(e, ctx)
        return F_.res_mlp(e_in, e, ctx)

    def _backward_block(self, i, e, ctx, AM, PM):
        cfg, S = self.cfg, self.cfg.S
        B_ = self.bwd[i - (cfg.n_layer - cfg.n_layers)]
        K = cfg.K
        mem_ln, mem_attn, mem_x = self._mem_slice(S - 1, S), self._mem_slice(S - 2, S), self._mem_slice(S, S)

        def bwd_desc(module, e, key):
            e = module(self._prefix_in(e, PM, key), ctx)
            PM.put(key, e[:, :K])
            return e

        e_in = e
        e = B_.ffn_init(e, ctx)
        for c in range(cfg.n_chunks):
            e = bwd_desc(B_.down, self._memory_in(e, AM, (i, "down", c), mem_x), (i, "down", c))
            if cfg.mlp == "gelu":
                e = B_.act(self._memory_in(e, AM, (i, "act", c), mem_x), ctx)
                e = bwd_desc(B_.up, self._memory_in(e, AM, (i, "up", c), mem_x), (i, "up", c))
            else:
                e = B_.glu(self._memory_in(e, AM, (i, "glu", c), mem_ln), ctx)
                e = bwd_desc(B_.gate_lin, self._memory_in(e, AM, (i, "gate", c), mem_x), (i, "gate", c))
                e = B_.route_gu(e, ctx)
                e = bwd_desc(B_.up, e, (i, "up", c))                # r is still in BS
            e = B_.ffn_acc(e, ctx)
        e = B_.ffn_out(e, ctx)
        e = self._memory_in(e, AM, (i, "ln2"), mem_ln)
        e = B_.ln2(self._prefix_in(e, PM, (i, "ln2")), ctx)
        PM.put((i, "ln2"), e[:, :K])
        e = B_.res_mlp(e_in, e, ctx)
        e_in = e
        e = bwd_desc(B_.o, self._memory_in(e, AM, (i, "o"), mem_x), (i, "o"))
        e = B_.softmax(self._memory_in(e, AM, (i, "attn"), mem_attn), ctx)
        e = bwd_desc(B_.v, e, (i, "v"))                  # u is in BS (attention memory)
        e = self._memory_in(e, AM, (i, "ln1"), mem_ln)
        e = B_.ln1(self._prefix_in(e, PM, (i, "ln1")), ctx)
        PM.put((i, "ln1"), e[:, :K])
        return B_.res_attn(e_in, e, ctx)

    @torch.no_grad()
    def forward(self, idx, n_train, label_mask=None, return_all_logits=False):
        """idx (B, T) -> test-segment logits (B, T - n_train, V) after the in-forward update."""
        cfg, K = self.cfg, self.cfg.K
        B, T = idx.shape
        if T > cfg.block_size:
            raise ValueError(f"sequence of {T} tokens exceeds block_size={cfg.block_size}")
        m, c = make_masks(idx, n_train, label_mask)
        m, c = m.to(self.wte.dtype), c.to(self.wte.dtype)
        ctx = self._context(B, T, m)
        AM_t, PM_t = self.side_channel_types
        AM, PM = AM_t(), PM_t()
        for key, i in self.key_index.items():          # per-sequence copy of the auxiliary weights
            PM.put(key, self.prefix_bank[i].expand(B, -1, -1))
        start = cfg.n_layer - cfg.n_layers
        S, B0 = cfg.S, self._blk(0)
        mem_ln = self._mem_slice(S - 1, S)

        def fresh(x):
            e = x.new_zeros(B, K + T, cfg.D_s)
            e[:, K:, B0] = x
            return e

        e = fresh(self._embed(idx))
        for i in range(cfg.n_layer):
            if i == start:
                AM.put(("input",), e[:, K:, B0])
            e = self._forward_block(i, e, ctx, AM, PM, record=i >= start)
        e = self.fwd_lnf(self._prefix_in(e, PM, ("lnf",)), ctx)
        AM.put(("lnf",), e[:, K:, mem_ln])
        for _ in range(cfg.n_steps):
            e = e.clone()
            e[:, K:, B0] = self._loss_grad(e[:, K:, B0], idx, c)
            e = self._memory_in(e, AM, ("lnf",), mem_ln)
            e = self.bwd_lnf(self._prefix_in(e, PM, ("lnf",)), ctx)
            PM.put(("lnf",), e[:, :K])
            for i in reversed(range(start, cfg.n_layer)):
                e = self._backward_block(i, e, ctx, AM, PM)
            e = fresh(AM.get(("input",)))
            for i in range(start, cfg.n_layer):
                e = self._forward_block(i, e, ctx, AM, PM, record=True)
            e = self.fwd_lnf(self._prefix_in(e, PM, ("lnf",)), ctx)
            AM.put(("lnf",), e[:, K:, mem_ln])
        self.last_prefix_memory = PM
        logits = e[:, K:, B0] @ self.head.t()
        return logits if return_all_logits else logits[:, n_train - 1: T - 1]

    # ------------------------------------------------------------------ read-back

    def updated_weights(self):
        """The auxiliary weights after the last call, decoded from the PrefixMemory: (layers, final, start)
        in tint_update's format (per-sequence tensors)."""
        cfg, PM = self.cfg, self.last_prefix_memory
        Fh = cfg.mlp_hidden
        start = cfg.n_layer - cfg.n_layers
        dec = lambda key: decode_linear(PM.get(key), cfg)
        layers = []
        for i in range(start, cfg.n_layer):
            p = {}
            for name in ("q", "k", "v", "o"):
                p["w" + name], p["b" + name] = dec((i, name))
            for ln, key in (("ln1", (i, "ln1")), ("ln2", (i, "ln2"))):
                W, b = dec(key)
                p[ln + "_w"], p[ln + "_b"] = torch.diagonal(W, dim1=1, dim2=2), b
            p["w_gate"] = p["b_gate"] = None
            for name in (("up",) if cfg.mlp == "gelu" else ("up", "gate")):
                chunks = [dec((i, name, c)) for c in range(cfg.n_chunks)]
                p["w_" + name] = torch.cat([w for w, _ in chunks], 1)[:, :Fh]
                p["b_" + name] = torch.cat([b for _, b in chunks], 1)[:, :Fh]
            downs = [dec((i, "down", c)) for c in range(cfg.n_chunks)]
            p["w_down"] = torch.cat([w for w, _ in downs], 2)[:, :, :Fh]
            p["b_down"] = sum(b for _, b in downs)
            if not cfg.bias:
                for k in ("bq", "bk", "bv", "bo", "b_up", "b_down", "b_gate"):
                    p[k] = None
            if not cfg.bias or cfg.norm == "rmsnorm":
                p["ln1_b"] = p["ln2_b"] = None
            layers.append(p)
        W, b = dec(("lnf",))
        final = {"lnf_w": torch.diagonal(W, dim1=1, dim2=2),
                 "lnf_b": b if cfg.bias and cfg.norm == "layernorm" else None}
        return layers, final, start

    def num_params(self):
        return sum(p.numel() for p in self.parameters())
