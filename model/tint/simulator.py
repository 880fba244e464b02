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
import torch
from torch import nn

from model.gpt import mlp_hidden_size
from model.tint.auxiliary import check_aux_model, final_params, layer_params, loss_grad, make_masks
from model.tint.layers import BackwardLayer, ForwardLayer, ln_backward, ln_forward
from model.tint.primitives import ActivationMemory, PrefixMemory, SimConfig


# ---------------------------------------------------------------------------- prefix encoding

def encode_linear(W, b, cfg):
    """(D x D map, bias) -> K x D_s prefix contents (layout: primitives.SimConfig; the bias on every row, row 0's is used)."""
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
        self.fwd_lnf = ln_forward(cfg, dt, dev)
        self.bwd = nn.ModuleList(BackwardLayer(cfg, dt, dev) for _ in range(cfg.n_layers))
        self.bwd_lnf = ln_backward(cfg, dt, dev)
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
