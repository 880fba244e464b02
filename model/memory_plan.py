"""The per-GPU memory a training run will peak at, estimated before its first step.

    plan = memory_plan(config, micro_batch=16, seq_len=2048, world=4, parallel="fsdp",
                       activation_checkpointing="full", autocast=True, device_type="cuda", compiled=True)
    print(describe(plan, capacity))          # one line: every term in GiB
    check_fits(plan, capacity, "error")       # MemoryPlanError naming the settings to change

Every term is bytes per rank (`plan["terms"]`). The peak of a step comes at the start of the
backward, when every saved activation is still held and the loss's vocabulary-wide gradients are
made; or, with activation checkpointing, while a block is recomputed in the backward, with the
gradients of the blocks after it made; or in the optimizer step, when every gradient exists:

    peak = context + params + optimizer + ddp_buckets
           + max(grads_held + weight_copies + activations + logits_saved + logits_grads,
                 max over recomputed blocks j of (what blocks < j keep + recompute + grads * (n - j) / n),
                 grads)

params       the fp32 parameters: all of them under DDP (and one process); under FSDP2 (train.parallel=fsdp)
             1/world of them plus what is gathered at once: the root unit (embedding, final norm, tied
             head; kept gathered through the step) and two blocks (the one running and the prefetched one).
grads        fp32 gradients, the same sharing as params. They exist from the backward to the optimizer
             step; at the start of the backward only gradient accumulation (grad_accum > 1) keeps them
             (grads_held), otherwise they are made while the activations are freed.
optimizer    AdamW's two fp32 moments per parameter (fused on CUDA: no per-step copies); 1/world under FSDP2.
ddp_buckets  DDP's flat gradient buckets (gradient_as_bucket_view off): one more fp32 gradient copy.
weight_copies  under bf16 autocast every Linear saves the bf16 copy of its weight for the backward: 2 bytes
             per weight of the head and of every block not recomputed (a recomputed block casts again
             in the backward); whole weights under FSDP2 too (they are cast from the gathered ones).
activations  what autograd keeps from the forward for the backward, per token (block_bytes_per_token):
             per block not recomputed, its saved tensors; per recomputed block (activation checkpointing)
             only its input (fp32 residual, 4 d bytes); plus the final norm's and the head's inputs.
logits_saved the (B, T, V) logits in the autocast dtype (the caller holds them) and cross_entropy's fp32
             log-softmax (eager; compiled, a fused loss keeps only the logits and a log-sum-exp).
logits_grads the loss's backward: the fp32 gradient of the log-softmax and of its input, alive together
             (eager); compiled, one fp32 gradient (the fused loss backward). With model.fused_loss
             (kernels/fused) no (B, T, V) tensor exists: logits_saved is the gradients the loss computes in
             its forward (dx, B T d in the autocast dtype; dW, V d in fp32), logits_grads one chunk's logits
             in the autocast dtype, overwritten by their gradient (chunked on CUDA, its Triton kernel), else
             the chunk's fp32 logits and probabilities and its gradient while they are made.
recompute    a recomputed block's activations and bf16 weight copies, live again in its backward (one block
             at a time), plus the gradients that backward holds besides them: the residual stream's (fp32),
             one MLP-hidden-wide one, and the attention projections' twice (per q, k, v and joined).
context      CUDA context, cuBLAS / cuDNN workspaces and allocator slack: a fixed allowance (CPU: 0).

Per-block saved tensors are counted from what the code keeps (model/gpt.py, kernels/castle, kernels/
forgetting): the fp32 residual input and the residual after attention (4 d each), each norm's fp32
rstd (and on CPU, where F.rms_norm is composite, also x * rstd), each Linear's input in the autocast
dtype (under autocast one cast per Linear that reads it; compiled, one), the projections' outputs, the
rotated / normalized / shifted q, k, v, the attention core's own saves (SDPA and the Triton kernels:
output + log-sum-exp; the CPU references of FoX, sliding-window attention and CASTLE: their L x L
probability matrices), and the
MLP's hidden activations (SwiGLU: gate, SiLU(gate), up, product; compiled, SiLU(gate) is recomputed), and the
Pro block's KV-shift: its fp32 alpha, and eager also the shifted k and v in fp32 (compiled, recomputed).
The count is of eager PyTorch; compiled graphs keep the same tensors except the pointwise ones torch.compile
recomputes (named above). tests/test_memory_plan.py checks the count against the CPU allocator (eager,
fp32 and bf16 autocast, every variant and checkpointing mode); `scripts/bench_memory.py` prints each
estimate next to the peak measured on a GPU. Not counted: a compiled fp32 loss keeps one more fp32
(B, T, V) tensor than the compiled bf16 one (inductor's choice; fp32 runs are rarely compiled).
"""
import torch

from kernels.triton_utils import padded_head_dim
from model.gpt import GPT, fused_setting, mlp_hidden_size

GiB = 2 ** 30
CUDA_CONTEXT_BYTES = GiB      # CUDA context (~0.5 GiB) + cuBLAS / cuDNN workspaces + fragmentation
MEMORY_CHECKS = ("error", "warn", "off")
FP32 = 4


class MemoryPlanError(ValueError):
    """The plan does not fit the device (a user error: change the settings it names)."""


# ----------------------------------------------------------------------------- activations

def norm_bytes(c, cpu):
    """What the block's RMSNorm / LayerNorm keeps besides its input, per token: fp32 rstd (LayerNorm: mean
    too); the composite F.rms_norm of the CPU also keeps x * rstd (fp32)."""
    return 2 * FP32 + (FP32 * c.n_embd if cpu and c.norm == "rmsnorm" else 0)


def linear_inputs(width, readers, a, compiled):
    """The Linear inputs saved for a norm output read by `readers` Linears: fp32, the output itself once;
    under autocast each Linear saves its own bf16 cast (compiled: one shared cast)."""
    if a == FP32:
        return FP32 * width
    return a * width * (1 if compiled else readers)


def head_norm_bytes(i, H, a, cpu):
    """HeadRMSNorm of a (B, H, T, D) tensor: rstd per head, the normalized tensor (saved by * weight);
    on CPU the composite norm of a 16-bit input keeps an fp32 copy too."""
    return FP32 * H + a * i + (FP32 * i if cpu and a != FP32 else 0)


def softmax_attention_bytes(c, T, a, cpu, compiled):
    """SoftmaxAttention (baseline, FoX, sliding-window; LLaMA or Pro block) per token, beyond its input."""
    i, H = c.n_head * c.head_dim, c.n_head
    forgetting_kernels = c.attention == "fox" or c.attention_window is not None   # else SDPA
    reference = cpu and forgetting_kernels            # the materialized reference keeps copies of q, k, v
    total = 0
    if not reference or c.qk_norm or c.kv_shift:
        # the qkv projection (SDPA and the Triton kernels keep v, a view of it; QK-norm and KV-shift their
        # inputs), and the q, k, v an op made anew: RoPE and QK-norm (q, k), KV-shift (k, v)
        new_q, new_k = c.pos == "rope" or c.qk_norm, c.pos == "rope" or c.qk_norm or c.kv_shift
        total += 3 * a * i + (new_q + new_k + bool(c.kv_shift)) * a * i
    if c.kv_shift:     # eqs (17), (19): alpha, and (eager) the shifted k, v in fp32; compiled, the shift is
        total += 2 * FP32 * H + (0 if compiled else 2 * (FP32 * i + (FP32 * i if a != FP32 else 0)))  # recomputed
    if c.qk_norm:
        total += 2 * head_norm_bytes(i, H, a, cpu) + (2 * a * i if c.pos == "rope" else 0)   # then RoPE again
    if c.attention == "fox":                              # gate logits and log f (fp32); Triton: c offsets
        total += 2 * FP32 * H + (0 if cpu else FP32 * H)
    if reference:          # fp32 probabilities (+ their bf16 copy for p @ v), copies of q, k, v, the output
        total += (FP32 + (a if a != FP32 else 0)) * H * T + (3 + (a != FP32)) * a * i
    elif forgetting_kernels:   # Triton: output and lse on tiles padded to a power-of-two head dim (and
        padded = H * padded_head_dim(c.head_dim)          # q, k, v copied when the head dim is padded)
        total += a * padded + FP32 * H + (3 * a * padded if padded != i else 0)
    else:     # SDPA: lse; its output is laid out (B, T, H, D), so merging the heads is a view of it, except
        total += FP32 * H + (a * i if cpu and a != FP32 else 0)   # on CPU under autocast (a merged copy)
    total += a * i                                        # the output projection's input (merged heads)
    if c.output_norm:
        total += head_norm_bytes(i, H, a, cpu)
    if c.output_gate:
        total += 2 * a * i                                # sigmoid(gate) and the gated output
    return total


def castle_attention_bytes(c, T, a, cpu):
    """CastleAttention per token, beyond its input: the projections, rotated copies, the core."""
    i, H = c.n_head * c.head_dim, c.n_head
    n_proj = 6 if c.castle_causal_keys else 5             # without causal keys no k^C
    if cpu:        # attn_parallel: sigmoid(Qu Ku^T), A_U, R, S^U, softmax: five L x L per head, its operand
        return 5 * a * H * T + (n_proj + 2 + (a != FP32)) * a * i   # copies, the merged output
    rotated = {"causal": 2, "qk": 4, "qkv": 5}[c.castle_rope] - (not c.castle_causal_keys)
    # Triton: the projections (views of one output) and the rotated ones, output, log-sum-exp (the
    # default "stored" backward keeps no U), the output projection's input (merged heads)
    return n_proj * a * i + rotated * a * i + a * i + FP32 * H + a * i


def mlp_bytes(c, a, cpu, compiled):
    h = mlp_hidden_size(c)
    if c.mlp == "swiglu":     # gate, SiLU(gate) (compiled: recomputed), up, product (Triton: recomputed)
        if not cpu and fused_setting("fused_swiglu", c.fused_swiglu, "cuda") == "triton":
            return 2 * a * h
        return (3 if compiled else 4) * a * h
    return 2 * a * h                                      # up, GELU(up)


def attention_readers(c):
    """Linears that read the attention norm's output."""
    if c.attention.startswith("castle"):
        return 1
    return 1 + (c.attention == "fox" and c.fgate == "data_dependent") + bool(c.kv_shift) + bool(c.output_gate)


def block_bytes_per_token(c, T, a, cpu, compiled):
    """Bytes one block keeps for the backward per token (its own input included)."""
    d = c.n_embd
    attention = (castle_attention_bytes(c, T, a, cpu) if c.attention.startswith("castle")
                 else softmax_attention_bytes(c, T, a, cpu, compiled))
    return (FP32 * d + norm_bytes(c, cpu) + linear_inputs(d, attention_readers(c), a, compiled) + attention
            + FP32 * d + norm_bytes(c, cpu) + linear_inputs(d, 2 if c.mlp == "swiglu" else 1, a, compiled)
            + mlp_bytes(c, a, cpu, compiled))


def recomputes(n_layer, mode, every):
    """Which blocks GPT.checkpoint_activations recomputes (full: all; selective: 0, k, 2k, ...)."""
    return [mode == "full" or (mode == "selective" and i % every == 0) for i in range(n_layer)]


def head_bytes_per_token(c, a, cpu):
    """The final norm's and the head's saved inputs, and the token ids the embedding keeps."""
    return FP32 * c.n_embd + norm_bytes(c, cpu) + a * c.n_embd + 8


def backward_transient_per_token(c, a):
    """Gradients alive inside one block's backward besides its saved tensors: the residual stream's
    (fp32), one hidden-width gradient of the MLP, and the attention projections' gradients twice (per
    q, k, v ... and joined into the fused projection's)."""
    projections = (6 if c.attention.startswith("castle") else 3) * c.n_head * c.head_dim
    return FP32 * c.n_embd + a * mlp_hidden_size(c) + 2 * a * projections


def last_recompute_bytes(flags, kept_block, block_input, recompute, grads):
    """The most held while a recomputed block runs again in the backward (blocks go last to first):
    the blocks before it still hold what they keep, the blocks after it have made their gradients."""
    n, worst, before = len(flags), 0, 0
    for j, recomputed in enumerate(flags):
        if recomputed:
            worst = max(worst, before + recompute + grads * (n - j) / n)
        before += block_input if recomputed else kept_block
    return worst


def logits_bytes(c, B, T, a, compiled, device_type):
    """(kept after the forward, the extra in the loss's backward) for the (B, T, V) logits."""
    fused_loss = fused_setting("fused_loss", c.fused_loss, device_type)
    if fused_loss != "none":
        # one chunk in flight. The chunked loss on CUDA: its logits in the autocast dtype, which its Triton kernel
        # overwrites with their gradient. The PyTorch softmax
        # (elsewhere): eager, its logits, logits - lse, probabilities, the target mask, probs - 1 and the masked
        # gradient (measured on CPU: 17-18 bytes per element); compiled, inductor fuses the elementwise ops down
        # to fp32 logits, probabilities and the gradient (measured on an H200)
        chunk = min(B * T, c.fused_loss_chunk) * c.vocab_size
        if fused_loss == "chunked" and device_type == "cuda":
            per_element = a
        else:
            per_element = 2 * FP32 + a if compiled else 4 * FP32 + 1
        return a * B * T * c.n_embd + FP32 * c.vocab_size * c.n_embd, per_element * chunk
    n = B * T * c.vocab_size
    if compiled:
        return a * n, FP32 * n
    return (a + FP32) * n, 2 * FP32 * n


# ----------------------------------------------------------------------------- the plan

def parameter_counts(c):
    """(all parameters, root-unit parameters, one block's, one block's Linear weights, the head's)."""
    with torch.device("meta"):
        model = GPT(c)
    total = model.num_params()
    block = sum(p.numel() for p in model.blocks[0].parameters())
    block_matrices = sum(m.weight.numel() for m in model.blocks[0].modules() if isinstance(m, torch.nn.Linear))
    return total, total - c.n_layer * block, block, block_matrices, model.lm_head.weight.numel()


def memory_plan(config, *, micro_batch, seq_len, world=1, parallel="ddp", activation_checkpointing="none",
                activation_checkpointing_every=2, autocast=True, device_type="cuda", compiled=False, grad_accum=1):
    """{"terms": {name: bytes}, "peak": bytes, "settings": {...}}: the estimate of one rank's peak
    (module docstring). `autocast`: bf16 autocast (train.dtype bf16, or auto on CUDA)."""
    B, T, c = micro_batch, seq_len, config
    cpu = device_type != "cuda"
    a = 2 if autocast else FP32
    total, root, block, block_matrices, head_matrix = parameter_counts(c)
    fsdp = parallel == "fsdp" and world > 1
    resident = total / world + root + 2 * block if fsdp else total
    flags = recomputes(c.n_layer, activation_checkpointing, activation_checkpointing_every)
    tokens = B * T
    saved_block = block_bytes_per_token(c, T, a, cpu, compiled) * tokens
    block_copies = 2 * block_matrices if autocast else 0
    block_input = FP32 * c.n_embd * tokens
    activations = (sum(block_input if f else saved_block for f in flags)
                   + head_bytes_per_token(c, a, cpu) * tokens)
    recompute = (saved_block + block_copies + backward_transient_per_token(c, a) * tokens) if any(flags) else 0
    logits_saved, logits_grads = logits_bytes(c, B, T, a, compiled, device_type)
    terms = {
        "params": FP32 * resident,
        "grads": FP32 * resident,
        "optimizer": 2 * FP32 * (total / world if fsdp else total),
        "ddp_buckets": FP32 * total if world > 1 and not fsdp else 0,
        "weight_copies": (2 * head_matrix if autocast else 0) + block_copies * flags.count(False),
        "activations": activations,
        "logits_saved": logits_saved,
        "logits_grads": logits_grads,
        "recompute": recompute,
        "context": 0 if cpu else CUDA_CONTEXT_BYTES,
    }
    grads_held = terms["grads"] if grad_accum > 1 else 0
    kept = terms["weight_copies"] + activations
    backward_start = grads_held + kept + logits_saved + logits_grads
    last_recompute = last_recompute_bytes(flags, saved_block + block_copies, block_input, recompute, terms["grads"])
    peak = (terms["context"] + terms["params"] + terms["optimizer"] + terms["ddp_buckets"]
            + max(backward_start, last_recompute, terms["grads"]))
    settings = dict(micro_batch=B, seq_len=T, world=world, parallel=parallel if world > 1 else "single",
                    activation_checkpointing=activation_checkpointing, autocast=autocast, compiled=compiled)
    return {"terms": terms, "peak": peak, "settings": settings}


def describe(plan, capacity=None):
    """One line: the plan's terms in GiB and its peak (of the device's capacity when known)."""
    t, s = plan["terms"], plan["settings"]
    g = {k: f"{v / GiB:.2f}" for k, v in t.items()}
    line = (f"memory plan per GPU: params {g['params']} GiB, grads {g['grads']}, optimizer {g['optimizer']}"
            + (f", DDP buckets {g['ddp_buckets']}" if t["ddp_buckets"] else "")
            + (f", bf16 weight copies {g['weight_copies']}" if t["weight_copies"] else "")
            + f", activations {g['activations']} ({s['micro_batch']} x {s['seq_len']}, checkpointing "
            f"{s['activation_checkpointing']}), logits {(t['logits_saved'] + t['logits_grads']) / GiB:.2f}"
            + (f", context {g['context']}" if t["context"] else "")
            + f", total {plan['peak'] / GiB:.2f}")
    return line + (f" of {capacity / GiB:.2f} GiB" if capacity else " GiB")


def check_fits(plan, capacity, mode="error"):
    """Raise MemoryPlanError (mode error) or return a warning line (warn) when the plan's peak exceeds
    `capacity` bytes; None when it fits or mode is off."""
    if mode == "off" or plan["peak"] <= capacity:
        return None
    s = plan["settings"]
    advice = [f"lower train.micro_batch_size (now {s['micro_batch']}; keep the batch with train.global_batch_tokens)"]
    if s["activation_checkpointing"] != "full":
        lighter = "selective or full" if s["activation_checkpointing"] == "none" else "full"
        advice.append(f"set train.activation_checkpointing={lighter}")
    if s["parallel"] != "fsdp":
        advice.append("shard parameters and optimizer over several GPUs with train.parallel=fsdp (torchrun)")
    message = (f"the memory plan needs {plan['peak'] / GiB:.1f} GiB per GPU but the device has "
               f"{capacity / GiB:.1f} GiB ({describe(plan, capacity)}); " + "; ".join(advice)
               + "; or train.memory_check=warn to start anyway")
    if mode == "error":
        raise MemoryPlanError(message)
    return "warning: " + message
