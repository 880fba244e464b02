"""The TinT simulator's building blocks (arXiv:2307.01189 §2, App. B-C): the row layout and its
configuration (`SimConfig`), the copy-only side channels, and the primitives every layer is made of:
H-split linear maps (App. C.1, Defs. C.4 and C.5), gates and TinT attention.
"""
from dataclasses import dataclass, field

import torch
from torch import nn

from model.gpt import apply_rope, mlp_hidden_size


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
