"""The GPT: config, norms, MLPs, positions, every attention module, Block, GPT and generation. The decode
caches live in model/cache.py, token choice and the CUDA-graph step in model/sampling.py.

Attention is a config switch (`GPTConfig.attention`). Every attention module has the same
interface, so Block and GPT never change when a variant is added:

    forward(x, rope, cache=None) -> y     x: (B, T, n_embd); rope: (cos, sin) for these T positions
    new_cache(batch_size, max_len, device, dtype, group=None) -> cache object for cached decoding
    flops_per_token(seq_len) -> attention-core FLOPs per token (forward + backward), for MFU

With a cache, `forward` appends the T new positions to it and attends over everything cached.
With a process group of p > 1 ranks, `new_cache` splits every layer's cache along the sequence
axis over the ranks (tree attention, kernels/tree.py): every rank runs the same tokens, stores the
positions it owns and merges its partial attention with the others' exactly (`GPT.new_cache`).
"""
import math
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from kernels.castle import CastleCache, castle_attn, castle_decode, castle_prefill
from kernels.forgetting import forgetting_attn, forgetting_decode
from kernels.forgetting.op import check_prune_log_eps
from kernels.fused import DEFAULT_CHUNK, LOSS_IMPLS, add_rms_norm, linear_cross_entropy, rms_norm, swiglu_linear
from kernels.fused import reference as fused_reference
from kernels.llama_step import MAX_BATCH as FUSED_MAX_BATCH
from kernels.sdpa import causal_attention, decode_sdpa
from model.cache import InferenceCache, SoftmaxCache, WindowCache, attend_rows
from model.recurrent import LAYERS as RECURRENT_LAYERS
from model.recurrent import RECURRENT_ATTENTIONS, check_widths
from model.sampling import (GraphedDecodeStep, check_sampling_options, fused_step_unsupported, replay_stream,
                            sample_token)


@dataclass
class GPTConfig:
    vocab_size: int = 50304          # GPT-2's 50257 padded to a multiple of 64
    tokenizer_vocab_size: int | None = None   # ids >= this are padding rows, never generated (None: vocab_size)
    block_size: int = 1024           # training context length
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    head_dim: int | None = None      # None: n_embd // n_head (CASTLE's n_head * head_dim != n_embd)
    bias: bool = False
    norm: str = "rmsnorm"            # "rmsnorm" | "layernorm"
    norm_eps: float = 1e-5
    mlp: str = "swiglu"              # "swiglu" (hidden 8/3 d) | "gelu" (hidden 4 d) | "none" (no MLP: Mamba-2)
    mlp_ratio: float = 4.0           # hidden = ratio * d (gelu) or 2/3 * ratio * d (swiglu: 8/3 d at 4)
    mlp_hidden: int | None = None    # None: derived from mlp_ratio, rounded up to `mlp_multiple_of`
    mlp_multiple_of: int = 1         # 1 keeps 8/3 d unrounded (CASTLE paper); LLaMA/FoX use 256
    pos: str = "rope"                # "rope" | "learned" | "none"
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    attention: str = "baseline"
    attention_window: int | None = None  # sliding window W of softmax / forgetting attention: query t sees
                                         # keys t-W+1 .. t (Transformer-SWA, arXiv:2503.02130 §F.4); None: all
    dropout: float = 0.0
    init_std: float = 0.02
    scaled_residual_init: bool = True   # GPT-2's std / sqrt(2 n_layer) on residual outputs (FoX: off)
    # CASTLE / CASTLE-SWL (arXiv:2509.07301)
    castle_window: int | None = None    # W of CASTLE-SWL (attention=castle_swl)
    castle_rope: str = "qk"             # RoPE on "causal" q^C,k^C | "qk" + q^U,k^U | "qkv" + v^U (paper: unstated)
    castle_match_heads: bool = False    # n_head <- floor(4/7 n_head): CASTLE's parameter-matching rule
    castle_causal_keys: bool = True     # False: no W^C_K, logits -SiLU(s^U) alone (ablation, §5.2.1 Table 5)
    castle_silu: bool = True            # False: logits s^C - s^U, no SiLU gate (ablation, §5.2.3 Table 10)
    # Forgetting Transformer and the Pro block (arXiv:2503.02130 §3, App. A)
    fgate: str = "data_dependent"       # forget gate f_t^(h): "data_dependent" sigmoid(w_f.x_t + b_f) (§3) |
                                        # "bias_only" sigmoid(b^(h)), learned | "fixed" sigmoid(b^(h)), frozen (§4.5)
    fgate_bias_init: float = 0.0        # forget-gate bias at init (FoX: 0, App. D)
    fgate_tmin: float | None = None     # T_min, T_max: per-head bias init with decay times log-spaced over the
    fgate_tmax: float | None = None     # heads (App. D; replaces fgate_bias_init); null: fgate_bias_init
    fgate_prune_log_eps: float | None = None  # log eps < 0: Adaptive Computation Pruning (arXiv:2504.06949) skips
                                        # attention blocks whose weight per row sums below eps; null: exact
    qk_norm: bool = False               # per-head RMSNorm of q and k (Pro)
    qk_norm_shared: bool = True         # one d_h scale shared by all heads, as in the paper's runs (App. A, fn. 4)
    kv_shift: bool = False              # data-dependent token shift of k and v (Pro, eq 17/19)
    output_gate: bool = False           # sigmoid output gate (Pro, eq 21)
    output_norm: bool = False           # per-head RMSNorm of the attention output (Pro, eq 23)
    # Fused kernels (kernels/fused): how the model computes, not what (outputs and gradients match the unfused path
    # to rounding); off is the unfused reference path
    fused_loss: str = "auto"            # "none" | "chunked" | "liger": linear + cross-entropy without the full logits
    fused_norm: bool | str = "auto"     # true: Triton RMSNorm, the block's attention residual add fused into its MLP norm
    fused_swiglu: str = "auto"          # "none" | "packed": one [gate | up] matmul | "triton": packed + Triton kernel
                                        # "auto" (each): fused on CUDA, unfused elsewhere (fused_setting)
    fused_loss_chunk: int = DEFAULT_CHUNK   # tokens per chunk of the chunked loss: on CUDA a chunk in flight takes
                                            # ~2 bytes x chunk x vocab (memory_plan); smaller: less memory, more launches
    # Recurrent baselines (FoX arXiv:2503.02130 §4.1), fla's layers (model/recurrent.py): attention=mamba2|hgrn2|
    # deltanet|gated_deltanet
    ssm_state_size: int = 128           # Mamba-2's d_state (attention=mamba2)
    gdn_expand_v: float = 2.0           # Gated DeltaNet's value width / key width (attention=gated_deltanet)

    def __post_init__(self):
        if self.castle_match_heads:       # applied once: the saved config then holds the real count
            self.n_head, self.castle_match_heads = max(1, 4 * self.n_head // 7), False
        if self.head_dim is None:
            if self.n_embd % self.n_head:
                raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                                 "set head_dim explicitly")
            self.head_dim = self.n_embd // self.n_head
        for name, allowed in [("norm", NORMS), ("mlp", MLPS), ("pos", ("rope", "learned", "none")),
                              ("attention", ATTENTIONS), ("fgate", FGATES)]:
            if getattr(self, name) not in allowed:
                raise ValueError(f"model.{name}={getattr(self, name)!r} is unknown; "
                                 f"choose one of {sorted(allowed)}")
        if self.pos == "rope" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}; use pos=learned or none")
        if self.attention == "castle_swl" and (self.castle_window is None or self.castle_window < 1):
            raise ValueError("attention=castle_swl needs model.castle_window >= 1 (paper: 128 for S, 512 else)")
        if self.castle_rope not in ("causal", "qk", "qkv"):
            raise ValueError(f"model.castle_rope={self.castle_rope!r}; choose causal, qk or qkv")
        self._check_castle_ablations()
        self._check_forget_gate()
        self._check_attention_window()
        self._check_fused()
        self._check_recurrent()
        if self.tokenizer_vocab_size is not None and not 1 <= self.tokenizer_vocab_size <= self.vocab_size:
            raise ValueError(f"tokenizer_vocab_size={self.tokenizer_vocab_size} must be in [1, model.vocab_size="
                             f"{self.vocab_size}]; model.vocab_size must hold every token of the tokenizer")

    def _check_castle_ablations(self):
        if self.attention not in ("castle", "castle_swl"):
            changed = [f"model.{name}=false" for name in ("castle_causal_keys", "castle_silu")
                       if not getattr(self, name)]
            if changed:
                raise ValueError(f"{', '.join(changed)} only applies to attention=castle or castle_swl "
                                 f"(model=castle or model=castle_swl), not attention={self.attention}")

    def _check_forget_gate(self):
        if self.attention != "fox":
            changed = [f"model.{f.name}={getattr(self, f.name)}" for f in fields(self)
                       if f.name.startswith("fgate") and getattr(self, f.name) != f.default]
            if changed:
                raise ValueError(f"{', '.join(changed)} only applies to attention=fox (model=fox_llama or "
                                 f"model=fox_pro), not attention={self.attention}")
        tmin, tmax = self.fgate_tmin, self.fgate_tmax
        if (tmin is None) != (tmax is None):
            raise ValueError("model.fgate_tmin and model.fgate_tmax go together: set both (e.g. 2 and 128) or neither")
        if tmin is not None and not 0 < tmin < tmax:
            raise ValueError(f"model.fgate_tmin={tmin}, model.fgate_tmax={tmax}: the decay times must satisfy "
                             "0 < fgate_tmin < fgate_tmax")
        check_prune_log_eps(self.fgate_prune_log_eps, "model.fgate_prune_log_eps")
        if tmin is not None and self.fgate_bias_init != 0:
            raise ValueError(f"model.fgate_bias_init={self.fgate_bias_init} and model.fgate_tmin/fgate_tmax both "
                             "set the forget-gate bias at init; set one of them")

    def _check_attention_window(self):
        w = self.attention_window
        if w is None:
            return
        if self.attention not in WINDOWED_ATTENTIONS:
            raise ValueError(f"model.attention_window={w} only applies to softmax and forgetting attention "
                             "(model=llama, gpt2, transformer_llama, transformer_pro, fox_llama or fox_pro), not "
                             f"attention={self.attention}" + (" (CASTLE-SWL's window is model.castle_window)"
                                                             if self.attention.startswith("castle") else ""))
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ValueError(f"model.attention_window={w!r} must be an integer >= 1 (null: full causal attention)")
        if self.dropout:
            raise ValueError(f"model.attention_window={w} has no attention dropout (the sliding-window kernels "
                             f"do not drop); set model.dropout=0 (got {self.dropout})")

    def _check_fused(self):
        for name, allowed in [("fused_loss", LOSS_CHOICES), ("fused_norm", (True, False, "auto")),
                              ("fused_swiglu", FUSED_SWIGLU)]:
            if getattr(self, name) not in allowed:
                raise ValueError(f"model.{name}={getattr(self, name)!r} is unknown; choose one of {list(allowed)}")
        chunk = self.fused_loss_chunk
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"model.fused_loss_chunk={chunk!r} must be a positive number of tokens "
                             f"(default {DEFAULT_CHUNK})")
        # "auto" leaves a LayerNorm or GELU model unfused; only an explicit request is refused
        if self.fused_norm is True and self.norm != "rmsnorm":
            raise ValueError(f"model.fused_norm=true fuses RMSNorm, but model.norm={self.norm}; "
                             "set model.fused_norm=false")
        if self.fused_swiglu not in ("none", "auto") and self.mlp != "swiglu":
            raise ValueError(f"model.fused_swiglu={self.fused_swiglu} fuses SwiGLU, but model.mlp={self.mlp}; "
                             "set model.fused_swiglu=none")

    def _check_recurrent(self):
        defaults = {f.name: f.default for f in fields(self)}
        for name, variant in (("ssm_state_size", "mamba2"), ("gdn_expand_v", "gated_deltanet")):
            if getattr(self, name) != defaults[name] and self.attention != variant:
                raise ValueError(f"model.{name}={getattr(self, name)} only applies to attention={variant} "
                                 f"(model={variant}), not attention={self.attention}")
        if self.attention not in RECURRENT_ATTENTIONS:
            return
        if self.pos != "none":
            raise ValueError(f"model.pos={self.pos!r} with the recurrent attention={self.attention}: its recurrence "
                             "orders the positions; set model.pos=none (as model=" + self.attention + " does)")
        changed = [f"model.{k}={getattr(self, k)}" for k in ("qk_norm", "qk_norm_shared", "kv_shift", "output_gate",
                   "output_norm", "castle_window", "castle_rope") if getattr(self, k) != defaults[k]]
        if changed:
            raise ValueError(f"{', '.join(changed)} only apply to softmax/forgetting attention or CASTLE, not to "
                             f"the recurrent attention={self.attention}; drop them")
        check_widths(self)

    @classmethod
    def from_dict(cls, d):
        """Build from a (Hydra) mapping, ignoring keys that are not model fields; unknown keys error."""
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown model config keys {sorted(unknown)}; valid keys: {sorted(known)}")
        return cls(**dict(d))


# ----------------------------------------------------------------------------- norms, MLPs

FUSED_OPTIONS = ("fused_loss", "fused_norm", "fused_swiglu")   # the fused kernels' switches (each has "auto")
# GPTConfig fields that change no result (pruning: by less than eps of each attention row's weight), so a run may
# resume with them changed and an exported model runs without them
NEUTRAL_OPTIONS = FUSED_OPTIONS + ("fused_loss_chunk", "fgate_prune_log_eps")
FUSED_SWIGLU = ("none", "packed", "triton", "auto")
PACK_ALIGN = 64   # the packed SwiGLU's halves start on multiples of 64 units (SwiGLU)
LOSS_CHOICES = LOSS_IMPLS + ("auto",)


# Each fused option's setting on and off; "auto" picks between them (fused_setting)
FUSED_ON = {"fused_loss": "chunked", "fused_norm": True, "fused_swiglu": "triton"}
FUSED_OFF = {"fused_loss": "none", "fused_norm": False, "fused_swiglu": "none"}


def fused_setting(name, value, device_type, grad=True):
    """GPTConfig's fused option `name` (one of FUSED_OPTIONS) set to `value`, with "auto" resolved: on for a CUDA
    pass, the fastest combination measured (docs/results.md, "Fused kernels"); off elsewhere (on CPU the chunked
    loss's fp32 chunk passes make a small model's step about 1.5x slower, and the Triton kernels would only run
    their torch references). The norm and SwiGLU kernels also need `grad` (autograd on): the packed SwiGLU
    concatenates the MLP weights on every call, which a training step's thousands of tokens amortize and a
    decode step's one token does not; the chunked loss saves the logits' memory in any pass."""
    if value != "auto":
        return value
    on = device_type == "cuda" and (grad or name == "fused_loss")
    return (FUSED_ON if on else FUSED_OFF)[name]


class RMSNorm(nn.Module):
    """RMSNorm; `fused`: the Triton kernels (kernels/fused), which under autocast write the output in autocast's
    dtype: every consumer of a block's or the final norm is a Linear, which would round it to that dtype anyway."""

    def __init__(self, dim, eps=1e-5, fused=False):
        super().__init__()
        self.eps, self.fused = eps, fused
        self.weight = nn.Parameter(torch.ones(dim))

    def uses_kernel(self, x):
        """Whether x is normed by the Triton kernels (`fused` true, or "auto" in a CUDA training pass)."""
        return fused_setting("fused_norm", self.fused, x.device.type, torch.is_grad_enabled())

    def forward(self, x):
        if self.uses_kernel(x):
            return rms_norm(x, self.weight, self.eps, autocast_dtype(x))
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


def autocast_dtype(x):
    """Autocast's dtype where it is on for x's device, else None."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def add_and_norm(x, y, norm):
    """(x + y, norm(x + y)): the residual stream after a branch y (None: no branch, x as it is), and its normed
    input to the next branch; one Triton pass where the norm is a fused RMSNorm."""
    if y is None:
        return x, norm(x)
    if isinstance(norm, RMSNorm) and norm.uses_kernel(x):
        return add_rms_norm(x, y, norm.weight, norm.eps, autocast_dtype(x))
    x = x + y
    return x, norm(x)


def make_norm(config, dim=None):
    dim = dim or config.n_embd
    if config.norm == "rmsnorm":
        return RMSNorm(dim, config.norm_eps, fused=config.fused_norm)
    return nn.LayerNorm(dim, eps=config.norm_eps, bias=config.bias)


NORMS = ("rmsnorm", "layernorm")


def mlp_hidden_size(config):
    if config.mlp_hidden is not None:
        return config.mlp_hidden
    r = config.mlp_ratio
    hidden = int(2 * r * config.n_embd / 3) if config.mlp == "swiglu" else int(r * config.n_embd)
    m = config.mlp_multiple_of
    return m * math.ceil(hidden / m)


class SwiGLU(nn.Module):
    """w_down(silu(w_gate x) * w_up x). `fused` (GPTConfig.fused_swiglu) "packed": one matmul with the
    concatenated [w_gate; w_up] (x read once, one matmul each way in the backward; the weights stay two
    parameters), silu(a) * b left to torch.compile; "triton": packed, and the Triton kernels for silu(a) * b,
    whose backward recomputes silu(a) * b for w_down's gradient instead of keeping it (kernels.fused.swiglu_linear).

    Packed, each half is padded with zero rows to a multiple of PACK_ALIGN (and w_down with zero columns): a
    hidden size like the papers' 8/3 * 896 = 2389 leaves every matmul and the up half misaligned, which
    costs cuBLAS its aligned kernels. The padded units compute silu(0) * 0 = 0 and meet zero columns of
    w_down, so outputs and gradients are the unpadded ones; the parameters keep their shapes."""

    def __init__(self, config):
        super().__init__()
        hidden = mlp_hidden_size(config)
        self.w_gate = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.w_up = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.w_down = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.w_down.residual_proj = True
        self.fused = config.fused_swiglu
        self.pad = -hidden % PACK_ALIGN

    def forward(self, x):
        fused = fused_setting("fused_swiglu", self.fused, x.device.type, torch.is_grad_enabled())
        if fused == "none":
            return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))
        weight = torch.cat([F.pad(w, (0, 0, 0, self.pad)) for w in (self.w_gate.weight, self.w_up.weight)])
        bias = (torch.cat([F.pad(b, (0, self.pad)) for b in (self.w_gate.bias, self.w_up.bias)])
                if self.w_gate.bias is not None else None)
        gate_up = F.linear(x, weight, bias)
        w_down = F.pad(self.w_down.weight, (0, self.pad))
        if fused == "triton":
            return swiglu_linear(gate_up, w_down, self.w_down.bias)
        return F.linear(fused_reference.swiglu(gate_up), w_down, self.w_down.bias)


class GeluMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden = mlp_hidden_size(config)
        self.w_up = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.w_down = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.w_down.residual_proj = True

    def forward(self, x):
        return self.w_down(F.gelu(self.w_up(x), approximate="tanh"))


MLPS = {"swiglu": SwiGLU, "gelu": GeluMLP, "none": None}


# ----------------------------------------------------------------------------- positions

def rope_tables(head_dim, max_len, theta, device=None, dtype=torch.float32):
    """cos/sin tables (max_len, head_dim // 2) in `dtype`, from angles taken in fp64 (in fp32 an angle
    of ~16K radians, position 16K at the fastest frequency, is off by up to 1e-3)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_len, device=device, dtype=torch.float64), inv_freq)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x, rope):
    """Rotate (B, H, T, D) by the (cos, sin) tables of its T positions; halves convention.

    A view of a (B, T, H, D) projection is rotated in that order, so the result (and, in the
    backward, its gradient) keeps the projection's memory layout: no transposing copy to gather
    the q/k gradients for the fused projection."""
    if rope is None:
        return x
    cos, sin = rope
    heads_inner = x.stride(1) < x.stride(2)
    if heads_inner:
        x, cos, sin = x.transpose(1, 2), cos[:, None], sin[:, None]
    ct = torch.promote_types(x.dtype, torch.float32)  # fp32 for 16-bit activations, fp64 for fp64
    cos, sin = cos.to(ct), sin.to(ct)
    x1, x2 = x.to(ct).chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)
    return rotated.transpose(1, 2) if heads_inner else rotated


# ----------------------------------------------------------------------------- attention

ATTENTIONS = {}


def register_attention(name):
    def register(cls):
        ATTENTIONS[name] = cls
        return cls
    return register


def split_heads(x, n_head):
    """(B, T, n_head * D) -> (B, n_head, T, D)."""
    B, T, _ = x.shape
    return x.view(B, T, n_head, -1).transpose(1, 2)


def merge_heads(y):
    """(B, n_head, T, D) -> (B, T, n_head * D)."""
    B, H, T, D = y.shape
    return y.transpose(1, 2).reshape(B, T, H * D)


def cached_causal_mask(T, total, device):
    """Boolean mask for T new queries appended after total - T cached positions (True = attend)."""
    q_pos = torch.arange(total - T, total, device=device)[:, None]
    return torch.arange(total, device=device)[None, :] <= q_pos


class HeadRMSNorm(nn.Module):
    """RMSNorm over each head's channels of a (B, H, T, D) tensor; scale shared by heads or per head."""

    def __init__(self, n_head, head_dim, eps, shared):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(head_dim) if shared else torch.ones(n_head, 1, head_dim))

    def forward(self, x):
        # keep x's dtype: under autocast an fp32 scale would turn bf16 q/k/outputs into fp32
        return F.rms_norm(x, (x.size(-1),), None, self.eps) * self.weight.to(x.dtype)


def token_shift(x, alpha, prev):
    """KV-shift (FoX, arXiv:2503.02130 App. A, eqs (17), (19)): alpha_t * x_{t-1} + (1 - alpha_t) * x_t,
    in alpha's dtype (>= fp32).

    x (B, H, T, D); alpha (B, H, T, 1); prev (B, H, 1, D) is x_0 (zeros at the sequence start).
    """
    shifted = torch.cat([prev, x[:, :, :-1]], dim=2)
    return (alpha * shifted.to(alpha.dtype) + (1 - alpha) * x.to(alpha.dtype)).type_as(x)


FGATES = ("data_dependent", "bias_only", "fixed")


def fgate_bias_at_init(config):
    """The forget-gate bias b^(h) at init, one per head: (n_head,) float32.

    With (T_min, T_max) (FoX, arXiv:2503.02130 App. D): the decay time T(b) = -1 / log sigmoid(b), the steps
    after which sigmoid(b)^T = 1/e, is log-spaced over the heads, T^(h) = exp(log T_min + (log T_max - log T_min)
    (h - 1) / (H - 1)) (one head: T_min), and b = -log(expm1(1 / T)) inverts T(b): log f^(h) = -1 / T^(h). A
    fixed gate is then ALiBi with slopes 1 / T^(h), from 1 / T_max to 1 / T_min (§3, §4.5). Without them:
    config.fgate_bias_init for every head.
    """
    if config.fgate_tmin is None:
        return torch.full((config.n_head,), float(config.fgate_bias_init))
    log_t = torch.linspace(math.log(config.fgate_tmin), math.log(config.fgate_tmax), config.n_head,
                           dtype=torch.float64)
    return (-torch.expm1(1 / log_t.exp()).log()).float()


class GateBias(nn.Module):
    """Data-independent forget-gate logits (FoX, arXiv:2503.02130 §4.5): b^(h) at every position, so
    f_t^(h) = sigmoid(b^(h)). Learned (fgate=bias_only) or a buffer (fixed), saved with the weights either way.
    Called like the data-dependent gate's Linear: x (B, T, d) -> logits (B, T, H)."""

    def __init__(self, bias, learned):
        super().__init__()
        if learned:
            self.bias = nn.Parameter(bias)
        else:
            self.register_buffer("bias", bias)

    def forward(self, x):
        return self.bias.expand(*x.shape[:-1], -1)


def make_forget_gate(config):
    """The module whose output on x (B, T, d) is the forget-gate logits (B, T, H): log f = logsigmoid of it.
    Only the data-dependent gate has the d x H weight w_f; the other two have H parameters (bias_only) or none."""
    bias = fgate_bias_at_init(config)
    if config.fgate != "data_dependent":
        return GateBias(bias, learned=config.fgate == "bias_only")
    gate = nn.Linear(config.n_embd, config.n_head, bias=True)
    gate.bias_init = bias                # written by GPT._init_weights
    return gate


class SoftmaxAttention(nn.Module):
    """Causal softmax attention (Transformer) or Forgetting Attention (FoX), LLaMA or Pro block; with
    model.attention_window = W over the last W positions only (Transformer-SWA, FoX arXiv:2503.02130 §F.4).

    Order inside the layer (FoX, arXiv:2503.02130 App. A, eqs (15)-(23)): projections -> KV-shift ->
    QK-norm -> RoPE -> forget gate -> attention -> per-head output norm * output gate -> output projection.
    """

    def __init__(self, config, forget_gate):
        super().__init__()
        self.n_head, self.head_dim, self.dropout = config.n_head, config.head_dim, config.dropout
        self.window = config.attention_window
        inner = config.n_head * config.head_dim
        self.qkv = nn.Linear(config.n_embd, 3 * inner, bias=config.bias)
        self.out = nn.Linear(inner, config.n_embd, bias=config.bias)
        self.out.residual_proj = True
        self.fgate = make_forget_gate(config) if forget_gate else None
        self.prune_log_eps = config.fgate_prune_log_eps
        self.shift = nn.Linear(config.n_embd, 2 * config.n_head, bias=False) if config.kv_shift else None
        if config.qk_norm:
            self.q_norm = HeadRMSNorm(config.n_head, config.head_dim, 1e-5, config.qk_norm_shared)
            self.k_norm = HeadRMSNorm(config.n_head, config.head_dim, 1e-5, config.qk_norm_shared)
        self.qk_norm = config.qk_norm
        self.out_norm = (HeadRMSNorm(config.n_head, config.head_dim, config.norm_eps, shared=False)
                         if config.output_norm else None)
        self.ogate = nn.Linear(config.n_embd, inner, bias=False) if config.output_gate else None

    def forward(self, x, rope, cache=None):
        q, k, v = (split_heads(t, self.n_head) for t in self.qkv(x).chunk(3, dim=-1))
        if self.shift is not None:
            k, v = self.kv_shift(x, k, v, cache)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        log_fgate = None
        if self.fgate is not None:   # (B, H, T) in fp32, <= 0
            log_fgate = F.logsigmoid(self.fgate(x).float()).transpose(1, 2)
        y = self.attend(q, k, v, log_fgate, cache)
        if self.out_norm is not None:
            y = self.out_norm(y)
        y = merge_heads(y)
        if self.ogate is not None:
            y = y * torch.sigmoid(self.ogate(x))
        return self.out(y)

    def kv_shift(self, x, k, v, cache):
        logits = self.shift(x)
        alpha = torch.sigmoid(logits.to(torch.promote_types(logits.dtype, torch.float32)))
        alpha_k, alpha_v = alpha.transpose(1, 2).unsqueeze(-1).chunk(2, dim=1)
        prev_k = cache.last_raw_k if cache is not None else torch.zeros_like(k[:, :, :1])
        prev_v = cache.last_raw_v if cache is not None else torch.zeros_like(v[:, :, :1])
        shifted = token_shift(k, alpha_k, prev_k), token_shift(v, alpha_v, prev_v)
        if cache is not None:   # in place (a static step keeps its buffers), after prev was read
            cache.last_raw_k.copy_(k[:, :, -1:])
            cache.last_raw_v.copy_(v[:, :, -1:])
        return shifted

    def attend(self, q, k, v, log_fgate, cache):
        if self.window is not None:
            return self.attend_window(q, k, v, log_fgate, cache)
        T = q.size(2)
        c = None
        if cache is not None:
            k, v = cache.append(k, v)
            c = cache.append_gates(log_fgate) if log_fgate is not None else None
            if cache.group is not None or cache.position is not None:
                return attend_rows(q, k, v, c, cache)
        fresh = k.size(2) == T               # no earlier positions: the parallel training kernels apply
        if log_fgate is not None:
            if cache is not None and not fresh:
                return forgetting_decode(q, k, v, c)
            return forgetting_attn(q, k, v, log_fgate, prune_log_eps=self.prune_log_eps)
        dropout = self.dropout if self.training else 0.0
        if fresh:
            return causal_attention(q, k, v, dropout)
        # One new query sees every cached key: no mask, so SDPA can take FlashAttention's split-KV decode. Given
        # the (all-true) mask it takes a kernel parallel over queries only, which leaves most of the GPU idle for a
        # single query over a long cache.
        mask = cached_causal_mask(T, k.size(2), q.device) if T > 1 else None
        return decode_sdpa(q, k, v, attn_mask=mask, dropout_p=dropout)

    def attend_window(self, q, k, v, log_fgate, cache):
        """Sliding-window attention: a whole sequence (or a prompt into an empty unsharded cache, which
        then keeps its last positions) through the forgetting-attention kernels, gated or not, which
        visit only the key tiles of the window; anything else through the window cache."""
        if cache is not None and (cache.length or cache.group is not None or cache.position is not None):
            return cache.attend(q, k, v, cache.gates(log_fgate))
        y = forgetting_attn(q, k, v, log_fgate, window=self.window, prune_log_eps=self.prune_log_eps)
        if cache is not None:
            cache.store(k, v, cache.gates(log_fgate))
        return y

    def new_cache(self, batch_size, max_len, device, dtype, group=None):
        if self.window is not None:
            return WindowCache(batch_size, self.n_head, max_len, self.head_dim, device, dtype, self.window,
                               gated=self.fgate is not None, group=group)
        return SoftmaxCache(batch_size, self.n_head, max_len, self.head_dim, device, dtype, group)

    def flops_per_token(self, seq_len):
        # QK^T and PV: 2 matmuls x 2 FLOPs x (fwd + 2x bwd) = 12 per (head, dim, key) a query sees
        return 12 * self.n_head * self.head_dim * keys_per_query(seq_len, self.window)


def keys_per_query(seq_len, window=None):
    """Mean number of keys a query attends to in a causal sequence of seq_len, (T + 1) / 2, or with
    only the last `window` keys counted: the honest causal count for MFU (not the full T)."""
    T, W = seq_len, seq_len if window is None else min(window, seq_len)
    return (W * (W + 1) / 2 + (T - W) * W) / T


register_attention("baseline")(lambda config: SoftmaxAttention(config, forget_gate=False))
register_attention("fox")(lambda config: SoftmaxAttention(config, forget_gate=True))
# SoftmaxAttention's variants: they take model.attention_window
WINDOWED_ATTENTIONS = ("baseline", "fox")


class CastleAttention(nn.Module):
    """CASTLE / CASTLE-SWL: causal keys plus lookahead keys (arXiv:2509.07301). Six projections per
    head (q^C, k^C, v^C, q^U, k^U, v^U, in that order in `proj`) and W_O: 7 n_head d d_model parameters.
    Without causal keys (castle_causal_keys=false) no k^C: 6 n_head d d_model."""

    def __init__(self, config, window):
        super().__init__()
        self.n_head, self.head_dim, self.window = config.n_head, config.head_dim, window
        self.causal_keys, self.silu = config.castle_causal_keys, config.castle_silu
        self.n_proj = 6 if self.causal_keys else 5
        inner = config.n_head * config.head_dim
        self.proj = nn.Linear(config.n_embd, self.n_proj * inner, bias=config.bias)
        self.out = nn.Linear(inner, config.n_embd, bias=config.bias)
        self.out.residual_proj = True
        self.rope_mode = config.castle_rope

    def forward(self, x, rope, cache=None):
        parts = [split_heads(t, self.n_head) for t in self.proj(x).chunk(self.n_proj, dim=-1)]
        if not self.causal_keys:
            parts.insert(1, None)
        qc, kc, vc, qu, ku, vu = parts
        qc, kc = apply_rope(qc, rope), kc if kc is None else apply_rope(kc, rope)
        if self.rope_mode in ("qk", "qkv"):
            qu, ku = apply_rope(qu, rope), apply_rope(ku, rope)
        if self.rope_mode == "qkv":
            vu = apply_rope(vu, rope)
        if cache is None:
            y = castle_attn(qc, kc, vc, qu, ku, vu, window=self.window, silu=self.silu)
        elif cache.position is None and (cache.length == 0 or x.size(1) > 1):
            y, _ = castle_prefill(qc, kc, vc, qu, ku, vu, cache=cache)    # a prompt, or a chunk of one
        else:       # one position through the UQ-KV cache (a static step's, or a token after the prompt)
            y, _ = castle_decode(cache, qc, kc, vc, qu, ku, vu)
        return self.out(merge_heads(y))

    def new_cache(self, batch_size, max_len, device, dtype, group=None):
        return CastleCache(batch_size, self.n_head, self.head_dim, max_len=max_len, dtype=dtype, device=device,
                           window=self.window, group=group, causal_keys=self.causal_keys, silu=self.silu)

    def flops_per_token(self, seq_len):
        # The block algorithm (arXiv:2509.07301 App. 8) takes 8 block matmuls per (query, key) tile pair inside
        # the lookahead window, 3 outside it (SWL), against FlashAttention's 2: ~4x and ~1.5x its FLOPs; without
        # causal keys one of each, Q^C K^C^T (with its gradients), is not computed
        dropped = 0 if self.causal_keys else 1
        inside = keys_per_query(seq_len, self.window)
        return 12 * self.n_head * self.head_dim * ((8 - dropped) / 2 * inside
                                                   + (3 - dropped) / 2 * (keys_per_query(seq_len) - inside))


register_attention("castle")(lambda config: CastleAttention(config, window=None))
register_attention("castle_swl")(lambda config: CastleAttention(config, window=config.castle_window))
# generate's cuda_graph: off, the eager step captured, the compiled one (and tuned: model/sampling.py COMPILE_OPTIONS),
# the single-launch step of LLaMA blocks (model/sampling.py FusedDecodeStep)
CUDA_GRAPH_MODES = (False, True, "compiled", "autotuned", "fused")
for _name, _layer in RECURRENT_LAYERS.items():   # Mamba-2, HGRN2, DeltaNet, Gated DeltaNet: fla's layers
    register_attention(_name)(_layer)


# ----------------------------------------------------------------------------- model

class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)) (no MLP sub-layer with mlp=none).

    Each residual add is done by the norm that reads its sum (add_and_norm: one pass with fused norms), so the
    MLP's add is left to the next block's first norm (or the final norm): GPT.forward passes it on as
    `pending` and asks for (stream, MLP branch) with `defer_add`; called as block(x, rope) a block adds it.

    With `recompute` (GPT.checkpoint_activations) a forward that records gradients adds the pending
    branch, keeps only the block's input and runs the block again in the backward (activation
    checkpointing). Non-reentrant checkpointing traces under torch.compile, restores the RNG so that
    dropout draws the same mask again, and leaves the hooks DDP or FSDP2 (fully_shard(block)) put on
    this module outside the recomputed region. A forward with a cache never recomputes: it appends to
    the cache."""

    def __init__(self, config):
        super().__init__()
        self.norm_attn = make_norm(config)
        self.attn = ATTENTIONS[config.attention](config)
        has_mlp = MLPS[config.mlp] is not None
        self.norm_mlp = make_norm(config) if has_mlp else None
        self.mlp = MLPS[config.mlp](config) if has_mlp else None
        self.recompute = False

    def forward(self, x, rope, cache=None, pending=None, defer_add=False):
        """The stream x (+ pending, the previous block's MLP branch it left unadded) -> the stream after this
        block, or with defer_add the pair (stream before the MLP's add, MLP branch)."""
        if self.recompute and cache is None and torch.is_grad_enabled():
            if pending is not None:          # the checkpoint then keeps one input, the stream
                x = x + pending
            x, y = checkpoint(self.residual_layers, x, None, rope, use_reentrant=False)
        else:
            x, y = self.residual_layers(x, pending, rope, cache)
        return (x, y) if defer_add else x + y

    def residual_layers(self, x, pending, rope, cache=None):
        x, h = add_and_norm(x, pending, self.norm_attn)
        y = self.attn(h, rope, cache)
        if self.mlp is None:             # no MLP sub-layer (Mamba-2): the layer's branch is the one left to add
            return x, y
        x, h = add_and_norm(x, y, self.norm_mlp)
        return x, self.mlp(h)


ACTIVATION_CHECKPOINTING = ("none", "selective", "full")   # by the memory they save


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd) if config.pos == "learned" else None
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm_f = make_norm(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        # RoPE tables, built on first use in the model's precision (fp64 models: fp64, else fp32); plain
        # attributes, so that model.to(dtype) cannot round them to bf16
        self._rope_len, self._rope_cos, self._rope_sin = 0, None, None
        self.apply(self._init_weights)

    def _init_weights(self, module):
        std = self.config.init_std
        if isinstance(module, nn.Linear):
            if getattr(module, "residual_proj", False) and self.config.scaled_residual_init:
                std = std / math.sqrt(2 * self.config.n_layer)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                module.bias.data.copy_(torch.as_tensor(getattr(module, "bias_init", 0.0)))
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)

    def num_params(self):
        """Unique parameters (a tied embedding counts once)."""
        return sum(p.numel() for p in self.parameters())

    def checkpoint_activations(self, mode, every=2):
        """Which blocks recompute their forward in the backward (Block.recompute): "none"; "full", every
        block; "selective", every `every`-th block from the first (blocks 0, k, 2k, ...). Returns how
        many blocks recompute. Outputs and gradients do not change; the blocks' saved activations fall
        to about the share of blocks that do not recompute, plus one block input per recomputed block."""
        if mode not in ACTIVATION_CHECKPOINTING:
            raise ValueError(f"activation checkpointing {mode!r} is unknown; choose one of {ACTIVATION_CHECKPOINTING}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"activation checkpointing every={every!r} must be an integer >= 1")
        for i, block in enumerate(self.blocks):
            block.recompute = mode == "full" or (mode == "selective" and i % every == 0)
        return sum(block.recompute for block in self.blocks)

    def _rope(self, start, T, device, position=None):
        """RoPE tables for positions [start, start + T), grown on demand (decoding may pass block_size).
        A static step passes its (1,) position tensor and the whole cache's range: the row is picked on
        the device from tables that are never regrown between steps (a graph keeps their addresses)."""
        if self.config.pos != "rope":
            return None
        end = start + T
        dtype = torch.float64 if self.lm_head.weight.dtype == torch.float64 else torch.float32
        if self._rope_len < end or (self._rope_cos.device, self._rope_cos.dtype) != (torch.device(device), dtype):
            self._rope_len = max(end, self.config.block_size)
            self._rope_cos, self._rope_sin = rope_tables(
                self.config.head_dim, self._rope_len, self.config.rope_theta, device, dtype)
        cos, sin = self._rope_cos[start:end], self._rope_sin[start:end]
        if position is not None:
            return cos.index_select(0, position), sin.index_select(0, position)
        return cos, sin

    def forward(self, idx, targets=None, cache=None, last_only=False):
        """idx (B, T) -> (logits, loss). logits: (B, T, vocab), or (B, 1, vocab) with last_only.

        With `cache` (from `new_cache`), the T tokens continue the cached sequence; a static cache
        (InferenceCache.to_static) takes one token at its device-held position. With targets and
        config.fused_loss, the loss comes from the hidden states and lm_head's weight without the logits,
        and logits is None. Targets of -1 are ignored; every vocab_size row takes part in the softmax.
        """
        B, T = idx.shape
        start = cache.pos if cache is not None else 0
        static = cache is not None and cache.position is not None
        if static and T != 1:
            raise ValueError(f"a static cache (InferenceCache.to_static) takes one token per step, not {T}")
        end = cache.max_len if static else start + T     # a static step can be at any position below max_len
        if self.wpe is not None and end > self.config.block_size:
            raise ValueError(f"sequence of {end} tokens exceeds block_size={self.config.block_size} "
                             "of a model with learned positions")
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(cache.position if static else torch.arange(start, start + T, device=idx.device))
        x = self.drop(x)
        rope = self._rope(0, end, idx.device, cache.position) if static else self._rope(start, T, idx.device)
        y = None
        for i, block in enumerate(self.blocks):
            x, y = block(x, rope, cache.layers[i] if cache is not None else None, pending=y, defer_add=True)
        if cache is not None:
            cache.advance(T)
        _, x = add_and_norm(x, y, self.norm_f)
        if last_only:
            x = x[:, -1:]
        fused_loss = fused_setting("fused_loss", self.config.fused_loss, x.device.type)
        if targets is not None and fused_loss != "none":
            return None, linear_cross_entropy(x.reshape(-1, x.size(-1)), self.lm_head.weight, targets.reshape(-1),
                                              ignore_index=-1, impl=fused_loss, chunk_size=self.config.fused_loss_chunk)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1),
                                   ignore_index=-1)
        return logits, loss

    def new_cache(self, batch_size, max_len, device=None, dtype=None, group=None):
        """Every layer's cache for max_len positions. With a process group of p > 1 ranks each
        rank holds only its ceil(max_len / p) positions of every layer (round robin, model.cache.KVCache) and
        attention merges the ranks' partial results exactly (kernels/tree.py); every rank of the
        group must then run the same tokens through the model."""
        device = device or self.wte.weight.device
        dtype = dtype or self.wte.weight.dtype
        if group is not None and dist.get_world_size(group) < 2:
            group = None
        return InferenceCache([b.attn.new_cache(batch_size, max_len, device, dtype, group)
                               for b in self.blocks], max_len)

    def flops_per_token(self, seq_len):
        """Training FLOPs per token: 6N over the weights that multiply (an untied input embedding
        and learned positions are lookups) + each layer's own attention-core FLOPs."""
        n = self.num_params()
        if not self.config.tie_embeddings:
            n -= self.wte.weight.numel()
        if self.wpe is not None:
            n -= self.wpe.weight.numel()
        return 6 * n + sum(b.attn.flops_per_token(seq_len) for b in self.blocks)

    def param_groups(self, weight_decay):
        """AdamW groups: decay weight matrices and embeddings, never norm scales or biases."""
        norms = (RMSNorm, HeadRMSNorm, nn.LayerNorm)
        no_decay = {id(p) for m in self.modules() if isinstance(m, norms) for p in m.parameters()}
        no_decay |= {id(p) for name, p in self.named_parameters() if name.endswith("bias")}
        no_decay |= {id(p) for m in self.modules() if hasattr(m, "no_decay_params") for p in m.no_decay_params()}
        params = [p for p in self.parameters() if p.requires_grad]
        return [{"params": [p for p in params if id(p) not in no_decay], "weight_decay": weight_decay},
                {"params": [p for p in params if id(p) in no_decay], "weight_decay": 0.0}]

    # ------------------------------------------------------------------------- generation

    @torch.no_grad()
    def generate_stream(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
                        eot_token=None, use_cache=True, group=None, prefill_chunk=None, cuda_graph=False):
        """Yield (B,) new tokens one step at a time. temperature 0 is greedy. Tokens are drawn only
        from the tokenizer's ids (`config.tokenizer_vocab_size`), never from the padding rows.

        Stops early once every row has produced `eot_token`; rows that finished keep emitting it.
        group: split the cache over this process group (`new_cache`); call on every rank with the
        same idx. Each token is broadcast from the group's first rank, so the ranks' streams stay
        one stream even when sampling. prefill_chunk: feed the prompt this many tokens at a time (bounds the
        prefill's activations; CASTLE's chunks after the first go in blocks against its cache, about 11x slower
        on one GPU than the whole prompt at once).
        cuda_graph: after the prompt's prefill, every one-token step is one replay of a CUDA graph
        (GraphedDecodeStep) that also samples the next token, and the host launches each step without waiting
        for the one before (model/sampling.py replay_stream: a consumer that does not read every token on the
        host, such as `generate`, keeps the GPU busy); CUDA, with the cache; every attention's caches take its
        static steps (model/cache.py InferenceCache.to_static), also sharded over a group (the graph then holds the
        step's collectives: tree attention's all-gathers, the token's broadcast). "compiled": the step is
        torch.compile'd before it is captured; "autotuned": with max-autotune (slower to start, faster per token);
        "fused": LLaMA blocks only, the whole step as one kernel launch (model/sampling.py FusedDecodeStep), logits
        in fp32.
        """
        check_sampling_options(max_new_tokens, temperature, top_k, top_p)
        if cuda_graph:
            self.check_cuda_graph(cuda_graph, idx, use_cache, group)
        B, T0 = idx.shape
        if self.wpe is not None and T0 + max_new_tokens > self.config.block_size and use_cache:
            raise ValueError(f"prompt ({T0}) + max_new_tokens ({max_new_tokens}) exceeds block_size="
                             f"{self.config.block_size} of a model with learned positions")
        n_tokens = self.config.tokenizer_vocab_size or self.config.vocab_size   # never propose padding ids
        cache = self.new_cache(B, T0 + max_new_tokens, group=group) if use_cache else None
        done = torch.zeros(B, dtype=torch.bool, device=idx.device)

        def choose(logits):
            """(B, T, V) logits -> (B,) next tokens; updates `done` in place. Reads nothing on the host, so a
            CUDA graph can capture it."""
            token = sample_token(logits[:, -1, :n_tokens].float(), temperature, top_k, top_p)
            if group is not None and dist.get_world_size(group) > 1:
                dist.broadcast(token, dist.get_global_rank(group, 0), group=group)
            if eot_token is not None:
                token = torch.where(done, eot_token, token)
                done.logical_or_(token == eot_token)
            return token

        seq, step_input = idx, idx
        for i in range(max_new_tokens):
            if cache is None:
                step_input = seq[:, -self.config.block_size:]
            chunk = prefill_chunk if cache is not None and prefill_chunk else step_input.size(1)
            for piece in step_input.split(chunk, dim=1):
                logits, _ = self(piece, cache=cache, last_only=True)
            token = choose(logits)
            yield token
            if eot_token is not None and done.all():
                return
            if cuda_graph and i + 1 < max_new_tokens:
                graphed = GraphedDecodeStep(self, cache, B, compile=None if cuda_graph is True else cuda_graph,
                                            choose=choose)
                graphed.token.copy_(token[:, None])
                yield from replay_stream(graphed, max_new_tokens - i - 1, done if eot_token is not None else None)
                return
            if cache is None:             # uncached steps re-read the whole window; a cache needs only the token
                seq = torch.cat([seq, token[:, None]], dim=1)
            step_input = token[:, None]

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, eot_token=None,
                 use_cache=True, group=None, prefill_chunk=None, cuda_graph=False):
        """idx (B, T) -> (B, T + n) with n <= max_new_tokens new tokens appended."""
        new = list(self.generate_stream(idx, max_new_tokens, temperature, top_k, top_p, eot_token,
                                        use_cache, group, prefill_chunk, cuda_graph))
        return torch.cat([idx] + [t[:, None] for t in new], dim=1)

    def check_cuda_graph(self, cuda_graph, idx, use_cache, group):
        """Raise a ValueError naming what keeps cuda_graph (any of CUDA_GRAPH_MODES) from decoding this model this way."""
        if cuda_graph not in CUDA_GRAPH_MODES:
            raise ValueError(f"cuda_graph takes one of {CUDA_GRAPH_MODES}, not {cuda_graph!r}")
        if cuda_graph == "fused" and (reason := fused_step_unsupported(self.config)):
            raise ValueError(f"cuda_graph='fused' decodes LLaMA blocks only, not {reason}: use cuda_graph='compiled'")
        if cuda_graph == "fused" and idx.size(0) > FUSED_MAX_BATCH:
            raise ValueError(f"cuda_graph='fused' decodes batches of up to {FUSED_MAX_BATCH} rows (it is built for "
                             f"batch-1 latency), not {idx.size(0)}: use cuda_graph='compiled'")
        if not use_cache:
            raise ValueError("cuda_graph=True replays a cached decode step: it needs use_cache=True")
        if group is not None and dist.get_world_size(group) > 1 and cuda_graph is not True:
            raise ValueError(f"cuda_graph={cuda_graph!r} decodes on one device; a cache sharded over a process "
                             "group takes cuda_graph=True")
        if self.training:
            raise ValueError("cuda_graph=True decodes in eval mode: call model.eval() first")
        if not (idx.is_cuda and self.lm_head.weight.is_cuda):
            raise ValueError(f"cuda_graph=True needs the model and prompt on a CUDA device, not {idx.device.type}: "
                             "decode without cuda_graph")
