"""FlashAttention-4 (the `flash-attn-4` package, CuTe DSL kernels for Hopper and Blackwell) as the causal
attention of whole sequences, for `train.sdpa_backend=fa4`.

At head dim 64 and long contexts its forward and backward beat SDPA's fastest backend (cuDNN) on Hopper;
docs/results.md has the measurements. torch's own FA4 registration (`activate_flash_attention_impl("FA4")`)
does not match the package's current return values, so the kernels are wrapped here as two custom ops:
torch.compile keeps each as one opaque call, with fake kernels for its shapes, and autograd pairs them.
Every output buffer is allocated here (`torch.empty_like` of the input it matches), so the real and the
fake kernels agree on strides, which Inductor relies on.
"""
import torch

INSTALL_HINT = ("train.sdpa_backend=fa4 needs FlashAttention-4: `pip install flash-attn-4` (CUDA GPUs of compute "
                "capability 9.0 or 10.0, i.e. Hopper or Blackwell)")


def fa4_interface():
    """The package's kernel entry points; a clear error when it is missing."""
    try:
        from flash_attn.cute import interface
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT}; importing it failed: {e}") from e
    return interface


@torch.library.custom_op("fa4::causal_fwd", mutates_args=())
def causal_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L, H, D) inputs -> the output (B, L, H, D) and the log-sum-exp of each row (B, H, L, fp32)."""
    out, lse = fwd_buffers(q, k, v)
    fa4_interface()._flash_attn_fwd(q, k, v, causal=True, return_lse=True, out=out, lse=lse)
    return out, lse


def fwd_buffers(q, k, v):
    B, L, H, _ = q.shape
    return q.new_empty(B, L, H, v.size(-1)), q.new_empty(B, H, L, dtype=torch.float32)


@torch.library.custom_op("fa4::causal_bwd", mutates_args=())
def causal_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
               lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = bwd_buffers(q, k, v, out, dout, lse)
    fa4_interface()._flash_attn_bwd(q, k, v, out, dout, lse, causal=True, dq=dq, dk=dk, dv=dv)
    return dq, dk, dv


def bwd_buffers(q, k, v, out, dout, lse):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs, *output)


def _backward(ctx, dout, dlse):   # lse is not differentiable: nothing downstream reads it
    q, k, v, out, lse = ctx.saved_tensors
    return causal_bwd(q, k, v, out, dout, lse)


causal_fwd.register_fake(fwd_buffers)
causal_bwd.register_fake(bwd_buffers)
causal_fwd.register_autograd(_backward, setup_context=_setup_context)


def fa4_causal_attention(q, k, v):
    """Causal softmax attention with scale D^-1/2, as F.scaled_dot_product_attention(q, k, v, is_causal=True):
    (B, H, L, D) in and out (views of FA4's (B, L, H, D) layout; no copies for inputs whose last dim is
    contiguous)."""
    out, _ = causal_fwd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)
