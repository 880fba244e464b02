"""The recurrent baselines of the FoX paper (arXiv:2503.02130 §4.1): Mamba-2, HGRN2, DeltaNet, plus Gated
DeltaNet, as `GPTConfig.attention` choices ("mamba2", "hgrn2", "deltanet", "gated_deltanet").

The layers are the Flash Linear Attention library's (the FoX paper builds its baselines on it, §4.1): the
layer classes come from the `flash-linear-attention` package (import name `fla`, `fla.layers`), their
Triton kernels from `fla-core` (`fla.ops`, `fla.modules`). This module only adapts them to model/gpt.py's
attention interface (forward(x, rope, cache), new_cache, flops_per_token) and keeps a layer's recurrent
state as its cache (in fixed buffers for CUDA-graph decoding: RecurrentCache.to_static); no recurrence is
written here. `fla` is imported when the first such layer is built
(it imports transformers and all of its layers: seconds), never by model/gpt.py itself.

Each recurrent layer takes the place of the attention sub-layer of the LLaMA-style Block (pre-norm residual
sub-layers), as in the FLA models the paper trains: HGRN2, DeltaNet and Gated DeltaNet blocks keep the SwiGLU
MLP; Mamba-2 blocks have none (`mlp: none`, twice the layers: the FLA Mamba-2 model).

Mamba-2 on a GPU: fla's Mamba2 layer runs its fused path only with the `mamba_ssm` CUDA package; without it,
its forward is a naive form whose intermediates grow as chunk^2 x heads x state per chunk (tens of GB at
16K tokens). `mamba2_scan` runs the same layer, same parameters, with fla's chunked scalar-decay linear
attention (`chunk_simple_gla`) as the SSD scan instead; tests check it equals the layer's own forward.
"""
import logging

import torch
import torch.nn as nn
import torch.nn.functional as F
from packaging.version import Version
from torch.utils._pytree import tree_flatten, tree_unflatten

from kernels.triton_utils import interpreting, triton

RECURRENT_ATTENTIONS = ("mamba2", "hgrn2", "deltanet", "gated_deltanet")
# fla's gated chunk backward (chunk_bwd_dqkwg with a decay: Mamba-2's scan through chunk_simple_gla, Gated DeltaNet)
# computes wrong gradients on Hopper GPUs with Triton >= 3.4.0, < 3.7.1, so fla raises there (fla issue #640)
GATED_BACKWARD = ("mamba2", "gated_deltanet")


def fla_kernels_ready(x, attention):
    """fla's kernels are Triton: a CUDA tensor, or the Triton interpreter on CPU (TRITON_INTERPRET=1)."""
    if not (x.is_cuda or interpreting()):
        raise ValueError(f"attention={attention} runs the Triton kernels of fla: it needs a CUDA GPU, or "
                         "TRITON_INTERPRET=1 on CPU (slow; for tests)")


def check_trainable(attention, device):
    """Before training: a ValueError when fla would refuse this layer's backward on `device` (GATED_BACKWARD)."""
    if device.type == "cuda" and attention in GATED_BACKWARD and triton is not None:   # without triton fla cannot run
        refuse_gated_backward(attention, torch.cuda.get_device_capability(device), triton.__version__)


def refuse_gated_backward(attention, capability, triton_version):
    if capability[0] == 9 and Version("3.4.0") <= Version(triton_version) < Version("3.7.1"):
        raise ValueError(f"attention={attention} cannot train on a Hopper GPU with Triton {triton_version}: fla's gated "
                         "chunk backward computes wrong gradients with Triton >= 3.4.0, < 3.7.1 there and refuses to "
                         "run (fla issue #640). Use Triton >= 3.7.1 (with a torch built for it) or another GPU "
                         "generation (e.g. an A100), or train model=hgrn2 or model=deltanet; decoding and evaluation "
                         "of a trained model work")


def take_first_autotune_config():
    """Under the Triton interpreter, fla's autotuned kernels run their first config: the autotuner would
    time every config through a GPU driver, which the interpreter does not have."""
    from triton.runtime.autotuner import Autotuner

    if getattr(Autotuner, "_first_config_only", False):
        return
    run = Autotuner.run

    def run_first(self, *args, **kwargs):
        self.configs = self.configs[:1]
        return run(self, *args, **kwargs)

    Autotuner.run, Autotuner._first_config_only = run_first, True


# ----------------------------------------------------------------------------- the fla layers, from GPTConfig

def check_widths(config):
    """The head layout each layer can take (called by GPTConfig): a ValueError naming the options otherwise."""
    a, d, h, dh = config.attention, config.n_embd, config.n_head, config.head_dim
    if a == "mamba2" and h * dh % d:
        raise ValueError(f"attention=mamba2: model.n_head x model.head_dim = {h * dh} is Mamba-2's inner width and "
                         f"must be a multiple of model.n_embd={d} (expand 2: n_head = 2 n_embd / head_dim)")
    if a in ("hgrn2", "deltanet") and h * dh != d:
        raise ValueError(f"attention={a}: model.n_head x model.head_dim = {h} x {dh} must equal model.n_embd={d} "
                         "(its heads split the model width); leave model.head_dim null")
    if a == "gated_deltanet" and (dh * config.gdn_expand_v) % 1:
        raise ValueError(f"attention=gated_deltanet: model.head_dim x model.gdn_expand_v = {dh} x "
                         f"{config.gdn_expand_v} must be a whole number (the value width of a head)")


def build_mamba2(config):
    """Mamba-2 (arXiv:2405.21060) with the FLA defaults the FoX paper trains (App. B.1): inner width
    n_head x head_dim (expand = that / n_embd, 2 in the paper's configs), d_state ssm_state_size, one
    group of B/C, causal conv of width 4 with bias, gated RMSNorm, chunk 256."""
    from fla.layers.mamba2 import Mamba2

    quiet = logging.getLogger("fla.layers.mamba2")   # its "no mamba_ssm: naive fallback" is not our path
    level, quiet.level = quiet.level, logging.ERROR
    try:
        return Mamba2(hidden_size=config.n_embd, num_heads=config.n_head, head_dim=config.head_dim,
                      expand=config.n_head * config.head_dim // config.n_embd, state_size=config.ssm_state_size,
                      n_groups=1, norm_eps=config.norm_eps, backend="triton", layer_idx=0)
    finally:
        quiet.level = level


def build_hgrn2(config):
    """HGRN2 (arXiv:2404.07904) as in the FoX paper's runs: n_embd / n_head heads with forget/query
    dimension head_dim ("expand_ratio", 128 in the paper's configs), no short convolution."""
    from fla.layers.hgrn2 import HGRN2Attention

    return HGRN2Attention(hidden_size=config.n_embd, expand_ratio=config.head_dim, use_short_conv=False,
                          norm_eps=config.norm_eps, layer_idx=0)


def build_deltanet(config):
    """DeltaNet (arXiv:2406.06484) with the FLA defaults of the FoX paper's runs: n_head heads of
    n_embd / n_head, SiLU + L2-normed q/k, beta, short convolutions of width 4, output RMSNorm, no gate."""
    from fla.layers.delta_net import DeltaNet

    return DeltaNet(hidden_size=config.n_embd, num_heads=config.n_head, use_beta=True, use_gate=False,
                    use_short_conv=True, conv_size=4, qk_activation="silu", qk_norm="l2",
                    norm_eps=config.norm_eps, layer_idx=0)


def build_gated_deltanet(config):
    """Gated DeltaNet (arXiv:2412.06464): n_head heads, key dim head_dim, value dim gdn_expand_v x head_dim,
    output gate, short convolutions of width 4."""
    from fla.layers.gated_deltanet import GatedDeltaNet

    return GatedDeltaNet(hidden_size=config.n_embd, num_heads=config.n_head, head_dim=config.head_dim,
                         expand_v=config.gdn_expand_v, use_gate=True, use_short_conv=True, conv_size=4,
                         norm_eps=config.norm_eps, layer_idx=0)


# Forward FLOPs per token of one layer's recurrence, from its recurrent form (FoX, arXiv:2503.02130 App. B.2,
# Table 6: 20 d_model d_state for Mamba-2, 5 d_model d_head for HGRN2, 6 d_model d_head for DeltaNet, i.e.
# 6 x heads x key width x value width, which Gated DeltaNet's value heads of gdn_expand_v x head_dim also take).
def recurrence_flops(config):
    d, h, dh = config.n_embd, config.n_head, config.head_dim
    return int({"mamba2": 20 * d * config.ssm_state_size,
                "hgrn2": 5 * d * dh,
                "deltanet": 6 * d * dh,
                "gated_deltanet": 6 * h * dh * dh * config.gdn_expand_v}[config.attention])


# ----------------------------------------------------------------------------- the adapter and its cache

class RecurrentCache:
    """One layer's recurrent state between forward calls (fla's Cache, the layer at index 0): a fixed size
    whatever the number of positions. `length` counts the positions consumed by dynamic steps.

    Static steps (to_static: the steps a CUDA graph replays, model/cache.py InferenceCache.to_static) must read
    and write the same storage every time, but an fla layer puts new state tensors into its cache's dict at
    every step (FLALayer.update); after each static step `keep_buffers` copies them into the buffers to_static
    made and points the dict back at them. No count of positions is needed: the fla layers' one-token steps
    depend on the input length and on whether a state exists, never on `length` or fla's own token counter
    (FLALayer._seen_tokens); both keep counting the dynamic steps only, so a static step changes no Python
    state (nor does torch.compile see a counter change from step to step)."""

    group = None   # never sharded: there is no sequence axis to split (RecurrentLayer.new_cache)

    def __init__(self, device):
        from fla.models.cache_utils import Cache

        self.state = Cache()
        self.length = 0
        self.device = device
        self.position = None     # static steps: InferenceCache's device-held position (unread here)
        self.buffers = self.spec = self.layout = None     # static steps: the state's tensors, structure, layout
        self.seen_tokens = None                           # static steps: fla's counter, held at its value

    def to_static(self, position):
        """Continue with static steps: the state tensors are copied into buffers that every later step reads
        and overwrites in place."""
        if self.length == 0:
            raise ValueError("static (CUDA-graph) decoding of a recurrent layer continues its state: run the "
                             "prompt (at least one token) through the cache before to_static")
        state = self.state[0]
        leaves, self.spec = tree_flatten(state)
        self.buffers = [x.clone(memory_format=torch.contiguous_format) if isinstance(x, torch.Tensor) else x
                        for x in leaves]
        self.layout = state_layout(self.buffers)
        state.update(tree_unflatten(self.buffers, self.spec))
        self.seen_tokens = self.state.layers[0]._seen_tokens
        self.position = position

    def keep_buffers(self):
        """After a static step: the layer's new state tensors into the buffers, the state pointing at them again
        (a tensor the layer updated in place, e.g. a short convolution's window, is the buffer already)."""
        state = self.state[0]
        leaves, spec = tree_flatten(state)
        if spec != self.spec or state_layout(leaves) != self.layout:
            raise RuntimeError("a one-token step changed the structure, shapes or dtypes of the recurrent state "
                               "(fla layer): static decoding cannot keep it in fixed buffers")
        for x, buf in zip(leaves, self.buffers):
            if x is not buf and isinstance(buf, torch.Tensor):
                buf.copy_(x)
        state.update(tree_unflatten(self.buffers, spec))
        self.state.layers[0]._seen_tokens = self.seen_tokens     # FLALayer.update added the step's token


def state_layout(leaves):
    """What a static step must keep of a state's leaves: each tensor's shape, dtype and device, any other value."""
    return [(x.shape, x.dtype, x.device) if isinstance(x, torch.Tensor) else x for x in leaves]


def match_fla_init_and_decay(layer, std):
    """What GPT._init_weights and GPT.param_groups do not know of an fla layer, set as FLA's models do
    (PreTrainedModel._init_weights): its convolutions N(0, std) with zero bias (GPT._init_weights draws the
    Linear weights alike); and its norm scales, like A_log, D and dt_bias already, marked `_no_weight_decay`."""
    from fla.modules import FusedRMSNormGated, RMSNorm
    from fla.modules.layernorm_gated import RMSNormGated

    for module in layer.modules():
        if isinstance(module, nn.Conv1d):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        if isinstance(module, (RMSNorm, FusedRMSNormGated, RMSNormGated)):
            for p in module.parameters():
                p._no_weight_decay = True


class RecurrentLayer(nn.Module):
    """An fla layer in the place of attention: forward(x, rope, cache) -> y, (B, T, n_embd) both ways.
    Positions come from the recurrence itself: `rope` is unused (GPTConfig requires pos=none)."""

    def __init__(self, config):
        super().__init__()
        self.attention = config.attention
        self.layer = BUILDERS[config.attention](config)
        out = self.layer.out_proj if config.attention == "mamba2" else self.layer.o_proj
        out.residual_proj = True          # GPT._init_weights: FLA's rescaled residual init (rescale_prenorm_residual)
        match_fla_init_and_decay(self.layer, config.init_std)
        # by name: FSDP2 replaces the parameter objects, and with them the marks
        self._no_decay = {n for n, p in self.layer.named_parameters() if getattr(p, "_no_weight_decay", False)}
        self._recurrence_flops = recurrence_flops(config)
        if interpreting():
            take_first_autotune_config()

    def forward(self, x, rope, cache=None):
        if cache is None:
            return self.fresh(x)
        y = self.continued(x, cache)
        if cache.position is None:
            cache.length += x.size(1)
        else:                    # a static step (one token): the new state into the buffers the next one reads
            cache.keep_buffers()
        return y

    def fresh(self, x):
        """A sequence from its start, no state kept (training, uncached evaluation)."""
        fla_kernels_ready(x, self.attention)
        return self.layer(x)[0]

    def continued(self, x, cache):
        """T positions continuing the cached state (the first call: a prompt from its start)."""
        fla_kernels_ready(x, self.attention)
        return self.layer(x, past_key_values=cache.state, use_cache=True)[0]

    def no_decay_params(self):
        """The parameters FLA trains without weight decay (GPT.param_groups): A_log, D, dt_bias, norm scales."""
        return [p for n, p in self.layer.named_parameters() if n in self._no_decay]

    def new_cache(self, batch_size, max_len, device, dtype, group=None):
        if group is not None:
            raise ValueError(f"attention={self.attention} is recurrent: its cache is a fixed-size state with no "
                             "sequence axis to shard, so tree (sharded) decoding does not apply; decode on one "
                             "device (no process group)")
        return RecurrentCache(device)

    def flops_per_token(self, seq_len):
        return 3 * self._recurrence_flops      # forward + backward (2x)


class Mamba2Layer(RecurrentLayer):
    """fla's Mamba2 with `mamba2_scan` for whole sequences (training, prompts) and the layer's own one-token
    step for decoding (fla's Mamba2 takes a cached state one token at a time)."""

    def fresh(self, x):
        return mamba2_scan(self.layer, x)[0]

    def continued(self, x, cache):
        if cache.length == 0:
            y, conv_state, ssm_state = mamba2_scan(self.layer, x, keep_state=True)
            # fla's step updates the state as state * exp(dt A) + dt B x: fp32 promoted with x's dtype (fp64 for an
            # fp64 model). The prompt's state takes that dtype now, so no step changes it (static steps keep it in
            # fixed buffers: RecurrentCache.keep_buffers)
            ssm_state = ssm_state.to(torch.promote_types(ssm_state.dtype, x.dtype))
            cache.state.update(recurrent_state=ssm_state, conv_state=conv_state, layer_idx=0, offset=x.size(1))
            return y
        return torch.cat([self.layer(x[:, t:t + 1], past_key_values=cache.state, use_cache=True)[0]
                          for t in range(x.size(1))], dim=1)


def mamba2_scan(layer, x, keep_state=False):
    """fla's Mamba2 `layer` (n_groups 1) over x (B, T, d) from the start -> (y, conv_state, ssm_state), the
    states as the layer's own forward returns them (None unless keep_state).

    The SSD recurrence h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t + D x_t (arXiv:2405.21060
    §3-§4) is scalar-decay linear attention with q = C, k = B, v = dt x, log-decay dt A and scale 1: fla's
    chunk_simple_gla on a GPU, its fused_recurrent_simple_gla elsewhere (the Triton interpreter). On CPU without
    the interpreter, the layer's own (naive) forward.
    """
    if not (x.is_cuda or interpreting()):
        return layer.torch_forward(x, use_cache=keep_state)
    from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla

    B, T, _ = x.shape
    inner, state = layer.intermediate_size, layer.ssm_state_size
    gate, xbc, dt = layer.in_proj(x).split([inner, layer.conv_dim, layer.num_heads], dim=-1)
    conv_state = F.pad(xbc.transpose(1, 2), (layer.conv_kernel_size - T, 0)) if keep_state else None
    xbc = layer.act(layer.conv1d(xbc.transpose(1, 2))[..., :T].transpose(1, 2))
    xs, b, c = xbc.split([inner, state, state], dim=-1)
    dt = F.softplus(dt.float() + layer.dt_bias).clamp(*layer.dt_limit)          # (B, T, H), fp32
    log_decay = dt * -torch.exp(layer.A_log.float())
    xs = xs.reshape(B, T, layer.num_heads, layer.head_dim)
    b, c = (z[:, :, None].expand(B, T, layer.num_heads, state) for z in (b, c))
    scan = chunk_simple_gla if x.is_cuda else fused_recurrent_simple_gla
    y, ssm_state = scan(q=c, k=b, v=xs * dt[..., None].to(xs.dtype), g=log_decay, scale=1.0,
                        output_final_state=keep_state, state_v_first=True)
    y = y + xs * layer._get_D(expand_to_head_dim=True).to(xs.dtype)
    y = layer.norm(y.reshape(B, T, inner), gate)
    return layer.out_proj(y.to(x.dtype)), conv_state, ssm_state


BUILDERS = {"mamba2": build_mamba2, "hgrn2": build_hgrn2, "deltanet": build_deltanet,
            "gated_deltanet": build_gated_deltanet}
LAYERS = {name: Mamba2Layer if name == "mamba2" else RecurrentLayer for name in RECURRENT_ATTENTIONS}
