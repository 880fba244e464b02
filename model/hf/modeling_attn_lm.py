"""attention-lm models for Hugging Face transformers: `AutoModelForCausalLM.from_pretrained(DIR,
trust_remote_code=True)`.

`python -m scripts.export_hf` copies this file next to the weights. It imports only torch and
transformers, so the model runs on CPU or GPU without attention-lm installed. One class covers every
variant of attention-lm's model/gpt.py, with the same parameter names:

- softmax attention in a LLaMA block (RMSNorm, SwiGLU, RoPE) or a GPT-2 block (LayerNorm, GELU,
  learned positions);
- Forgetting Attention, FoX (arXiv:2503.02130 §2): scores q_i.k_j / sqrt(d) + sum_{l=j+1..i} log f_l;
- the Pro block (arXiv:2503.02130 App. A, eqs. (15)-(23)): KV-shift, QK-norm, per-head output norm
  and sigmoid output gate;
- CASTLE and CASTLE-SWL (arXiv:2509.07301 Theorem 1, eqs. (10)-(12)): causal keys plus lookahead keys.

Attention runs in its plain materialized form with fp32 (fp64 for fp64 weights) math: L x L scores,
and for CASTLE the L x L x L product of the parallel form. `generate()` recomputes the whole sequence
at every step (no cache): exact, but each new token costs a full forward pass.

`attention_mask` (1 = token, 0 = padding) takes left padding (what batched `generate()` uses) and right
padding exactly: a padding token is never a key and enters KV-shift as zeros, and positions count real
tokens only. Padding before or after every real token never reaches a real query otherwise (its lookahead
contributions and forget gates only concern keys it precedes or follows); holes inside a row are not
supported.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

# attention-lm's GPTConfig fields (model/gpt.py) and their defaults; tie_embeddings is stored as
# transformers' own `tie_word_embeddings`
MODEL_DEFAULTS = dict(
    vocab_size=50304, tokenizer_vocab_size=None, block_size=1024, n_layer=12, n_head=12, n_embd=768,
    head_dim=None, bias=False, norm="rmsnorm", norm_eps=1e-5, mlp="swiglu", mlp_ratio=4.0, mlp_hidden=None,
    mlp_multiple_of=1, pos="rope", rope_theta=10000.0, attention="baseline", attention_window=None, dropout=0.0,
    init_std=0.02,
    scaled_residual_init=True, castle_window=None, castle_rope="qk", castle_match_heads=False,
    castle_causal_keys=True, castle_silu=True,
    fgate="data_dependent", fgate_bias_init=0.0, fgate_tmin=None, fgate_tmax=None, qk_norm=False,
    qk_norm_shared=True, kv_shift=False, output_gate=False, output_norm=False, ssm_state_size=128, gdn_expand_v=2.0)


class AttnLMConfig(PretrainedConfig):
    model_type = "attn_lm"
    attribute_map = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer",
                     "num_attention_heads": "n_head", "max_position_embeddings": "block_size"}

    def __init__(self, **kwargs):
        for name, default in MODEL_DEFAULTS.items():
            setattr(self, name, kwargs.pop(name, default))
        if self.head_dim is None:
            self.head_dim = self.n_embd // self.n_head
        super().__init__(**kwargs)


# ----------------------------------------------------------------------------- norms, MLPs, positions

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


def make_norm(config):
    if config.norm == "rmsnorm":
        return RMSNorm(config.n_embd, config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)


def mlp_hidden_size(config):
    """mlp_hidden, or 8/3 d (SwiGLU) / 4 d (GELU) at mlp_ratio 4, rounded up to mlp_multiple_of."""
    if config.mlp_hidden is not None:
        return config.mlp_hidden
    r, d = config.mlp_ratio, config.n_embd
    hidden = int(2 * r * d / 3) if config.mlp == "swiglu" else int(r * d)
    return config.mlp_multiple_of * math.ceil(hidden / config.mlp_multiple_of)


class MLP(nn.Module):
    """SwiGLU (w_down(silu(w_gate x) * w_up x)) or GELU (tanh approximation)."""

    def __init__(self, config):
        super().__init__()
        hidden = mlp_hidden_size(config)
        self.swiglu = config.mlp == "swiglu"
        if self.swiglu:
            self.w_gate = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.w_up = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.w_down = nn.Linear(hidden, config.n_embd, bias=config.bias)

    def forward(self, x):
        h = F.silu(self.w_gate(x)) * self.w_up(x) if self.swiglu else F.gelu(self.w_up(x), approximate="tanh")
        return self.w_down(h)


def rope_tables(head_dim, positions, theta, dtype):
    """cos/sin (B, 1, T, head_dim // 2) of the given (B, T) positions; angles taken in fp64."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float64) / head_dim)
    angles = positions.to(torch.float64)[:, None, :, None] * inv_freq
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x, rope):
    """Rotate (B, H, T, D) by (cos, sin), halves convention, in fp32 (fp64 for fp64) math."""
    if rope is None:
        return x
    cos, sin = rope
    ct = torch.promote_types(x.dtype, torch.float32)
    x1, x2 = x.to(ct).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


def split_heads(x, n_head):
    B, T, _ = x.shape
    return x.view(B, T, n_head, -1).transpose(1, 2)


def merge_heads(y):
    B, H, T, D = y.shape
    return y.transpose(1, 2).reshape(B, T, H * D)


def compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------- attention

class HeadRMSNorm(nn.Module):
    """RMSNorm over each head's channels of (B, H, T, D); one scale shared by all heads or one per head."""

    def __init__(self, n_head, head_dim, eps, shared):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(head_dim) if shared else torch.ones(n_head, 1, head_dim))

    def forward(self, x):
        return F.rms_norm(x, (x.size(-1),), None, self.eps) * self.weight.to(x.dtype)


class GateBias(nn.Module):
    """Data-independent forget-gate logits b^(h) at every position (fgate=bias_only: learned; fixed: a buffer)."""

    def __init__(self, n_head, learned):
        super().__init__()
        if learned:
            self.bias = nn.Parameter(torch.zeros(n_head))
        else:
            self.register_buffer("bias", torch.zeros(n_head))

    def forward(self, x):
        return self.bias.expand(*x.shape[:-1], -1)


def token_shift(x, alpha):
    """KV-shift (arXiv:2503.02130 App. A, eqs. (17), (19)): alpha_t x_{t-1} + (1 - alpha_t) x_t, x_0 = 0."""
    shifted = torch.cat([torch.zeros_like(x[:, :, :1]), x[:, :, :-1]], dim=2)
    return (alpha * shifted.to(alpha.dtype) + (1 - alpha) * x.to(alpha.dtype)).type_as(x)


def softmax_attend(scores, v, allowed):
    """softmax over the allowed keys of (B, H, T, T) fp32 scores, times v; returns the scores' dtype."""
    p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return p @ v.to(scores.dtype)


class SoftmaxAttention(nn.Module):
    """Softmax attention (Transformer) or Forgetting Attention (FoX), LLaMA or Pro block. Order:
    projections -> KV-shift -> QK-norm -> RoPE -> attention (+ forget-gate bias) -> output norm ->
    output gate -> output projection."""

    def __init__(self, config):
        super().__init__()
        self.n_head, self.head_dim = config.n_head, config.head_dim
        inner = config.n_head * config.head_dim
        self.qkv = nn.Linear(config.n_embd, 3 * inner, bias=config.bias)
        self.out = nn.Linear(inner, config.n_embd, bias=config.bias)
        self.fgate = None
        if config.attention == "fox":
            self.fgate = (nn.Linear(config.n_embd, config.n_head, bias=True) if config.fgate == "data_dependent"
                          else GateBias(config.n_head, learned=config.fgate == "bias_only"))
        self.shift = nn.Linear(config.n_embd, 2 * config.n_head, bias=False) if config.kv_shift else None
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = HeadRMSNorm(config.n_head, config.head_dim, 1e-5, config.qk_norm_shared)
            self.k_norm = HeadRMSNorm(config.n_head, config.head_dim, 1e-5, config.qk_norm_shared)
        self.out_norm = (HeadRMSNorm(config.n_head, config.head_dim, config.norm_eps, shared=False)
                         if config.output_norm else None)
        self.ogate = nn.Linear(config.n_embd, inner, bias=False) if config.output_gate else None

    def forward(self, x, rope, allowed, valid):
        q, k, v = (split_heads(t, self.n_head) for t in self.qkv(x).chunk(3, dim=-1))
        if self.shift is not None:
            alpha = torch.sigmoid(self.shift(x).to(compute_dtype(x.dtype)))
            alpha_k, alpha_v = alpha.transpose(1, 2).unsqueeze(-1).chunk(2, dim=1)
            keep = valid[:, None, :, None].to(k.dtype)       # padding enters the shift as zeros
            k, v = token_shift(k * keep, alpha_k), token_shift(v * keep, alpha_v)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        ct = compute_dtype(x.dtype)
        scores = (q.to(ct) @ k.to(ct).transpose(-1, -2)) * self.head_dim ** -0.5
        if self.fgate is not None:
            c = torch.cumsum(F.logsigmoid(self.fgate(x).float()).transpose(1, 2).to(torch.float64), dim=-1)
            scores = scores + (c[..., :, None] - c[..., None, :]).to(ct)
        y = softmax_attend(scores, v, allowed).to(x.dtype)
        if self.out_norm is not None:
            y = self.out_norm(y)
        y = merge_heads(y)
        if self.ogate is not None:
            y = y * torch.sigmoid(self.ogate(x))
        return self.out(y)


class CastleAttention(nn.Module):
    """CASTLE (window None) or CASTLE-SWL (lookahead contributors i with j < i <= j + W), parallel form
    (arXiv:2509.07301 eqs. (11), (12)), s = d ** -0.5:

        S^U = ((s Qc Vu^T) causal) @ (sigmoid(s Qu Ku^T) lookahead)^T
        out = softmax(s Qc Kc^T - SiLU(S^U), causal) @ Vc

    The ablations of §5.2: castle_causal_keys=False drops Kc and its term (no k^C projection; Table 5),
    castle_silu=False takes -S^U for -SiLU(S^U) (Table 10).
    """

    def __init__(self, config):
        super().__init__()
        self.n_head, self.head_dim = config.n_head, config.head_dim
        self.window = config.castle_window if config.attention == "castle_swl" else None
        self.rope_mode = config.castle_rope
        self.causal_keys, self.silu = config.castle_causal_keys, config.castle_silu
        self.n_proj = 6 if self.causal_keys else 5
        inner = config.n_head * config.head_dim
        self.proj = nn.Linear(config.n_embd, self.n_proj * inner, bias=config.bias)
        self.out = nn.Linear(inner, config.n_embd, bias=config.bias)

    def forward(self, x, rope, allowed, valid):
        parts = [split_heads(t, self.n_head) for t in self.proj(x).chunk(self.n_proj, dim=-1)]
        if not self.causal_keys:
            parts.insert(1, None)
        qc, kc, vc, qu, ku, vu = parts
        qc, kc = apply_rope(qc, rope), kc if kc is None else apply_rope(kc, rope)
        if self.rope_mode in ("qk", "qkv"):
            qu, ku = apply_rope(qu, rope), apply_rope(ku, rope)
        if self.rope_mode == "qkv":
            vu = apply_rope(vu, rope)
        ct = compute_dtype(x.dtype)
        qc, kc, vc, qu, ku, vu = (t if t is None else t.to(ct) for t in (qc, kc, vc, qu, ku, vu))
        s = self.head_dim ** -0.5
        T = x.size(1)
        idx = torch.arange(T, device=x.device)
        causal = idx[:, None] >= idx[None, :]                              # (query t, key j)
        ahead = idx[:, None] < idx[None, :]                                # (owner j, contributor i)
        if self.window is not None:
            ahead = ahead & (idx[None, :] <= idx[:, None] + self.window)
        a_u = torch.sigmoid(s * qu @ ku.transpose(-1, -2)).masked_fill(~ahead, 0.0)
        r = (s * qc @ vu.transpose(-1, -2)).masked_fill(~causal, 0.0)
        s_u = r @ a_u.transpose(-1, -2)
        logits = -F.silu(s_u) if self.silu else -s_u
        if kc is not None:
            logits = logits + s * qc @ kc.transpose(-1, -2)
        y = softmax_attend(logits, vc, allowed).to(x.dtype)
        return self.out(merge_heads(y))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm_attn = make_norm(config)
        self.attn = (CastleAttention if config.attention in ("castle", "castle_swl") else SoftmaxAttention)(config)
        self.norm_mlp = make_norm(config)
        self.mlp = MLP(config)

    def forward(self, x, rope, allowed, valid):
        x = x + self.attn(self.norm_attn(x), rope, allowed, valid)
        return x + self.mlp(self.norm_mlp(x))


# ----------------------------------------------------------------------------- model

class AttnLMForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = AttnLMConfig
    base_model_prefix = "attn_lm"
    _no_split_modules = ["Block"]
    _tied_weights_keys = {"lm_head.weight": "wte.weight"}

    def __init__(self, config):
        super().__init__(config)
        if config.attention not in ("baseline", "fox", "castle", "castle_swl"):
            raise ValueError(f"attention={config.attention!r} is not one of baseline, fox, castle, castle_swl")
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd) if config.pos == "learned" else None
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm_f = make_norm(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.wte

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
        B, T = input_ids.shape
        valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)            # real tokens only
        if self.wpe is not None and int(positions.max()) >= self.config.block_size:
            raise ValueError(f"sequence of {int(positions.max()) + 1} tokens exceeds block_size="
                             f"{self.config.block_size} of a model with learned positions")
        idx = torch.arange(T, device=input_ids.device)
        # causal; padding is never a key, and a padding query sees itself so its row stays finite
        allowed = (idx[:, None] >= idx[None, :]) & (valid[:, None, None, :] | (idx[:, None] == idx[None, :]))
        if self.config.attention_window is not None:   # sliding window: the last W positions (padding is outside)
            allowed = allowed & (idx[:, None] - idx[None, :] < self.config.attention_window)
        x = self.wte(input_ids)
        if self.wpe is not None:
            x = x + self.wpe(positions)
        rope = None
        if self.config.pos == "rope":
            rope = rope_tables(self.config.head_dim, positions, self.config.rope_theta, compute_dtype(x.dtype))
        for block in self.blocks:
            x = block(x, rope, allowed, valid)
        logits = self.lm_head(self.norm_f(x))
        loss = None
        if labels is not None:   # transformers' convention: labels are the inputs, shifted here
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)),
                                   labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)

    @classmethod
    def _supports_default_dynamic_cache(cls):
        return False    # no cache: every step recomputes the sequence

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        return {"input_ids": input_ids, "attention_mask": attention_mask}
