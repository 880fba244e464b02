"""Float8 training (train.fp8=true): the blocks' linear layers multiply in float8 through torchao's Float8Linear.

Each such matmul scales its two inputs to float8 by their absolute maxima (dynamic, one scale per tensor;
e4m3 for weights and activations, e5m2 for gradients) and runs torch._scaled_mm, which accumulates in fp32;
everything else (embeddings, norms, attention, the loss) keeps bf16 autocast. Parameters, optimizer state
and checkpoints stay as they are (Float8Linear keeps nn.Linear's weight), so a run resumes, exports and
samples the same with or without fp8.

Converted: nn.Linear layers of the blocks whose input and output widths are multiples of 16 (the float8
matmul's requirement), except the fla layers of the recurrent baselines (their kernels read weights
themselves). Not converted: the output head (the logits feeding the loss stay bf16, as in torchao's
recipes) and the embeddings. The SwiGLU runs unfused: its packed path (model.fused_swiglu) multiplies the
concatenated weights itself, which would bypass Float8Linear.
"""
import importlib.util

import torch
import torch.nn as nn

from model.gpt import SwiGLU

FP8_MIN_CAPABILITY = (8, 9)   # float8 tensor cores: Ada, Hopper and newer


def check_fp8_device(device):
    """A ValueError naming train.fp8 unless `device` has float8 matmuls and torchao is installed."""
    if device.type != "cuda":
        raise ValueError(f"train.fp8=true runs float8 matmuls, which need a CUDA GPU of compute capability >= 8.9 "
                         f"(Ada, Hopper or newer); this run is on {device.type}: set train.fp8=false")
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        raise ValueError(f"train.fp8=true needs float8 matmuls (compute capability >= 8.9: Ada, Hopper or newer); "
                         f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}: "
                         "set train.fp8=false")
    if importlib.util.find_spec("torchao") is None:
        raise ValueError("train.fp8=true runs torchao's Float8Linear: pip install torchao (or set train.fp8=false)")


def check_fp8_config(config):
    """A ValueError naming model.fused_swiglu when it asks for the packed SwiGLU, which bypasses Float8Linear
    (its "auto" turns to none under fp8: convert_to_fp8)."""
    if config.fused_swiglu in ("packed", "triton"):
        raise ValueError(f"train.fp8=true multiplies the SwiGLU's w_gate, w_up and w_down in float8, but "
                         f"model.fused_swiglu={config.fused_swiglu} concatenates their weights and multiplies them "
                         "itself: set model.fused_swiglu=auto (or none)")


def block_linears(model):
    """(name, module) of the blocks' nn.Linear layers that Float8Linear could take (fla layers excepted)."""
    return [(name, module) for name, module in model.named_modules()
            if type(module) is nn.Linear and name.startswith("blocks.") and ".attn.layer." not in name]


def fits_fp8(linear):
    """Whether both widths are multiples of 16, as the float8 matmul needs."""
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0


def fp8_layer_names(model):
    """The names of the nn.Linear layers convert_to_fp8 converts (see the module docstring)."""
    return [name for name, module in block_linears(model) if fits_fp8(module)]


def fp8_left_out(model):
    """A note on the block linears that stay bf16 because a width is not a multiple of 16 ("" if none): the
    papers' SwiGLU hidden sizes (8/3 d, e.g. 2730 at d = 1024) leave the whole MLP, most of the FLOPs, in bf16."""
    left = [(name, m) for name, m in block_linears(model) if not fits_fp8(m)]
    if not left:
        return ""
    name, m = left[0]
    fix = " (model.mlp_multiple_of=16 rounds the SwiGLU's hidden size so that they convert)" \
        if any(".mlp." in n for n, _ in left) else ""
    return (f"{len(left)} block linear layers stay bf16, a width not a multiple of 16 (e.g. {name}: "
            f"{m.in_features} -> {m.out_features}){fix}")


def convert_to_fp8(model):
    """Swap fp8_layer_names(model) for torchao's Float8Linear, in place, before FSDP and torch.compile see the
    model; -> the names converted."""
    from torchao.float8 import convert_to_float8_training   # optional (requirements.txt): check_fp8_device checks

    names = set(fp8_layer_names(model))
    convert_to_float8_training(model, module_filter_fn=lambda module, name: name in names)
    for module in model.modules():
        if isinstance(module, SwiGLU):
            module.fused = "none"   # the unfused path calls w_gate, w_up and w_down, now Float8Linear
    return sorted(names)
