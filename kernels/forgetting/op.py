"""forgetting_attn, and the Triton path as an autograd function (padding in, slicing out)."""
import torch

from kernels.forgetting import triton as fox_triton
from kernels.forgetting.reference import reference_attn
from kernels.triton_utils import interpreting, padded_head_dim, require_triton, triton


class ForgettingAttnTriton(torch.autograd.Function):
    """The Triton forward and backward on inputs padded to the kernels' tiles (fox_triton.padded_length,
    padded_head_dim); outputs and gradients sliced back."""

    @staticmethod
    def forward(ctx, q, k, v, log_fgate, scale, window, prune_log_eps):
        L, D = q.shape[-2:]
        Lp = fox_triton.padded_length(L)
        Dp = padded_head_dim(D)
        q, k, v = (fox_triton.pad(x, Lp, Dp) for x in (q, k, v))
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        c_parts = fox_triton.split_c(log_fgate, Lp) if log_fgate is not None else ()
        plan = fox_triton.acp_plan_of(q, k, c_parts, scale, prune_log_eps, L) if prune_log_eps is not None else ()
        o, lse2 = fox_triton.triton_fwd(q, k, v, c_parts or None, scale, window, plan or None)
        ctx.save_for_backward(q, k, v, o, lse2, *c_parts, *plan)
        ctx.scale, ctx.window, ctx.L, ctx.D, ctx.pruned = scale, window, L, D, prune_log_eps is not None
        ctx.gate_dtype = log_fgate.dtype if log_fgate is not None else None
        return o[..., :L, :D]

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse2, *parts = ctx.saved_tensors
        c_parts, plan = (parts[:2], parts[2:]) if ctx.pruned else (parts, ())
        L, D = ctx.L, ctx.D
        do = fox_triton.pad(do, *o.shape[-2:]).contiguous()
        dq, dk, dv, dcq, dck = fox_triton.triton_bwd(q, k, v, c_parts or None, o, lse2, do, ctx.scale, ctx.window,
                                                     plan or None)
        dlog_fgate = fox_triton.gate_grad(dcq, dck, L, ctx.gate_dtype) if c_parts else None
        return dq[..., :L, :D], dk[..., :L, :D], dv[..., :L, :D], dlog_fgate, None, None, None


def check_inputs(q, k, v, log_fgate, window, prune_log_eps=None):
    if not (q.shape == k.shape == v.shape and q.dim() == 4):
        raise ValueError(f"q, k, v must share one (B, H, L, D) shape, got {q.shape}, {k.shape}, {v.shape}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    check_window(window)
    check_prune_log_eps(prune_log_eps)
    if log_fgate is None:
        if prune_log_eps is not None:
            raise ValueError("prune_log_eps needs a forget gate (log_fgate); without one nothing decays")
        return
    if log_fgate.shape != q.shape[:3]:
        raise ValueError(f"log_fgate must be (B, H, L) = {tuple(q.shape[:3])}, got {tuple(log_fgate.shape)}")
    if log_fgate.dtype not in (torch.float32, torch.float64):
        # a 16-bit log gate would already have lost the precision that c needs (the precision policy)
        raise TypeError(f"log_fgate must be float32 (compute logsigmoid in fp32), got {log_fgate.dtype}")


def check_window(window):
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window={window!r} must be None (full causal attention) or an integer >= 1")


def check_prune_log_eps(value, name="prune_log_eps"):
    """A ValueError naming the option `name` unless value is None or a number < 0."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value < 0):
        raise ValueError(f"{name}={value!r} must be null/None (no pruning) or log(eps) < 0, the bound on the "
                         "attention weight a row may lose (the paper recommends -10)")


def forgetting_attn(q, k, v, log_fgate, *, scale=None, window=None, prune_log_eps=None, impl="auto"):
    """Causal Forgetting Attention; returns (B, H, L, D) in q's dtype.

    q, k, v: (B, H, L, D) in fp32, bf16 or fp16 (fp64 too with impl="torch").
    log_fgate: (B, H, L) float32, log of the forget gate (<= 0); its fp32 cumsum is never formed.
               None: no gate, i.e. plain causal softmax attention (the kernels' ungated variant).
    scale: logit scale, default D ** -0.5 (it does not multiply the gate bias).
    window: None (every earlier position) or W >= 1: query i sees keys i-W+1 .. i only (sliding
            window); the Triton kernels skip the key tiles outside it.
    prune_log_eps: None (exact), or log(eps) < 0: Adaptive Computation Pruning (arXiv:2504.06949 §3)
            skips the blocks of MAX_BLOCK x MAX_BLOCK entries (128; 16 under the interpreter) whose bias
            c_i - c_j is so negative that all a row loses weighs less than eps (reference.acp_block_bounds:
            the bound holds for any inputs). Needs the gate; the torch reference masks the same blocks.
    impl: "auto" (Triton on CUDA, torch elsewhere), "torch" (materialized reference) or
          "triton" (on CPU only under TRITON_INTERPRET=1).
    """
    check_inputs(q, k, v, log_fgate, window, prune_log_eps)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    prune_log_eps = None if prune_log_eps is None else float(prune_log_eps)
    if impl == "auto":
        impl = "triton" if q.is_cuda and triton is not None else "torch"
    if impl == "torch":
        prune = None if prune_log_eps is None else (prune_log_eps, fox_triton.MAX_BLOCK)
        return reference_attn(q, k, v, log_fgate, scale, window, prune)
    if impl != "triton":
        raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")
    require_triton("impl='triton'", "use impl='torch' without it")
    if not (q.is_cuda or interpreting()):
        raise RuntimeError("impl='triton' needs a CUDA tensor or TRITON_INTERPRET=1")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16) or q.shape[-1] > 128:
        raise ValueError(f"triton path supports fp32/bf16/fp16 and D <= 128, got {q.dtype}, D={q.shape[-1]}")
    return ForgettingAttnTriton.apply(q, k, v, log_fgate, scale, window, prune_log_eps)
