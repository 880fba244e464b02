"""Linear + cross-entropy without the (N, V) logits: the loss and its gradients in one pass over token chunks.

For each chunk of `chunk_size` tokens the forward takes the chunk's logits x_c W^T (cuBLAS, in the compute
dtype), their log-sum-exp in fp32, the chunk's loss, and at once the gradient of the mean loss with respect
to those logits, softmax - onehot(target), divided by the number of counted targets and zero on ignored
rows. That gradient goes straight into the chunk's dx = g W and into dW += g^T x_c (fp32); the logits are
then dropped. So memory holds one chunk's logits (and gradient) instead of all N x V of them (and of their
fp32 copy), and the backward only scales the stored dx and dW by the incoming gradient of the loss. Where the
Triton kernels run (op.use_triton) the softmax step is one kernel, op.cross_entropy_grad_, that reads each row
of the logits twice and overwrites it with its gradient: a chunk holds one (chunk, V) buffer in the compute
dtype, no fp32 copies.

The loss is the reference's (reference.linear_cross_entropy): logits rounded to the compute dtype, then
softmax in fp32 over all V rows of W (a padded vocabulary's rows included). Under autocast the compute dtype
is autocast's, else the promoted dtype of x and W.

The rest is plain PyTorch, so that torch.compile traces it whole: the chunk loop unrolls, the kernel is one
opaque custom op per chunk around the three matmuls. Elsewhere (CPU, fp64) and for the loss alone the softmax
is PyTorch too, which inductor fuses into a few kernels per chunk.
"""
import torch

from kernels.fused.op import cross_entropy_grad_, use_triton
from kernels.triton_utils import interpreting

DEFAULT_CHUNK = 16384  # tokens per chunk: its bf16 logits (overwritten by their gradient) take chunk * V * 2 bytes


def compute_dtype(x, weight):
    """The dtype the logits are computed in: autocast's if it is on for x's device, else that of x and W."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(x.dtype, weight.dtype)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, ignore_index, chunk_size):
        loss, dx, dw = _loss_and_grads(x, weight, targets, ignore_index, chunk_size, with_grads=True)
        ctx.save_for_backward(dx.to(x.dtype), dw.to(weight.dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        dx, dw = ctx.saved_tensors
        return dx * grad_loss.to(dx.dtype), dw * grad_loss.to(dw.dtype), None, None, None


def _loss_and_grads(x, weight, targets, ignore_index, chunk_size, with_grads):
    """(mean loss, d loss / dx, d loss / dW in fp32), the gradients None without with_grads."""
    dtype = compute_dtype(x, weight)
    with torch.autocast(x.device.type, enabled=False):
        return _chunks(x.to(dtype), weight.to(dtype), targets, ignore_index, chunk_size, with_grads)


def _chunks(x, weight, targets, ignore_index, chunk_size, with_grads):
    """_loss_and_grads with x (N, d) and W (V, d) in the compute dtype."""
    counted = targets != ignore_index
    n_counted = counted.sum()
    loss_sum = torch.zeros((), device=x.device, dtype=torch.float32)
    dw = torch.zeros(weight.shape, device=x.device, dtype=torch.float32) if with_grads else None
    dx = []
    for start in range(0, x.size(0), chunk_size):
        x_c = x[start:start + chunk_size]
        chunk = (targets[start:start + chunk_size], counted[start:start + chunk_size], n_counted)
        logits = x_c @ weight.t()
        if with_grads and use_triton(logits):
            loss_sum = loss_sum + cross_entropy_grad_(logits, *chunk).sum()
            grad = logits                                  # overwritten with the gradient
        else:
            loss, grad = _torch_loss_and_grad(logits, *chunk, with_grads)
            loss_sum = loss_sum + loss
        if with_grads:
            dx.append(grad @ weight)
            dw = dw + (grad.t() @ x_c).float()
    return loss_sum / n_counted, torch.cat(dx) if with_grads else None, dw


def _torch_loss_and_grad(logits, targets, keep, n_counted, with_grads):
    """The summed loss of one chunk's logits (n, V) and, with_grads, the gradient of the mean loss with respect
    to them in their dtype (else None): what the Triton kernel computes (cross_entropy_grad_), in PyTorch."""
    target = torch.where(keep, targets, 0)[:, None]
    dtype, logits = logits.dtype, logits.float()
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    loss = ((lse - logits.gather(1, target)).squeeze(1) * keep).sum()
    if not with_grads:
        return loss, None
    # d mean / d logits = (softmax - onehot(target)) / n_counted on counted rows, 0 on ignored ones
    probs = torch.exp(logits - lse)
    columns = torch.arange(logits.size(1), device=logits.device)
    scale = (keep / n_counted)[:, None]
    return loss, (torch.where(columns == target, probs - 1, probs) * scale).to(dtype)


def chunked_linear_cross_entropy(x, weight, targets, ignore_index=-1, chunk_size=DEFAULT_CHUNK):
    """Mean cross-entropy of x @ weight^T (x (N, d), weight (V, d), targets (N,)) over targets != ignore_index;
    equal to reference.linear_cross_entropy, differentiable in x and weight. Without autograd (no_grad, or
    neither input requiring a gradient) only the loss is computed."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return ChunkedLinearCrossEntropy.apply(x, weight, targets, ignore_index, chunk_size)
    return _loss_and_grads(x, weight, targets, ignore_index, chunk_size, with_grads=False)[0]


@torch.compiler.disable   # Liger's launch code queries the device in Python: one graph break, at the model's last op
def liger_linear_cross_entropy(x, weight, targets, ignore_index=-1):
    """Liger-Kernel's fused linear cross-entropy (Triton), same contract, weight gradient accumulated in fp32."""
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError as e:
        raise ImportError("model.fused_loss=liger needs the liger-kernel package (pip install liger-kernel); "
                          "or use model.fused_loss=chunked") from e
    if not (x.is_cuda or interpreting()):
        raise ValueError("model.fused_loss=liger runs Liger-Kernel's Triton kernels, which need a CUDA device; "
                         "use model.fused_loss=chunked here")
    x = x.to(compute_dtype(x, weight))
    return liger_fused_linear_cross_entropy(x, weight, targets, ignore_index=ignore_index,
                                            accum_dtype=torch.float32)


LOSSES = {"chunked": chunked_linear_cross_entropy, "liger": liger_linear_cross_entropy}
