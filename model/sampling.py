"""Choosing the next token (check_sampling_options, sample_token) and the CUDA-graph decode step
(GraphedDecodeStep, replayed by replay_stream, and FusedDecodeStep, its one-launch form for LLaMA blocks) that
GPT.generate_stream uses."""
import math

import torch
import torch.nn.functional as F

from kernels.llama_step import LlamaStepWeights, decode_step


# Inductor settings of a compiled decode step. "autotuned" adds max-autotune's Triton matmul templates and
# coordinate-descent tuning of the fused kernels (without Inductor's own CUDA graphs, which would nest in
# ours): 18% faster at batch 1 (docs/results.md), for minutes of tuning on the first call.
COMPILE_OPTIONS = {"compiled": {}, "autotuned": {"max_autotune": True, "coordinate_descent_tuning": True}}


class GraphedDecodeStep:
    """`model(token, cache)` of one token over a static cache (InferenceCache.to_static), as a CUDA graph:
    token (B, 1) -> logits (B, 1, vocab), a buffer the next call overwrites. The graph is captured once per
    (batch, max_len) and replayed at every position: the token goes into a static input buffer, the step
    writes the cache in place and advances the device-held position itself.

    The first `warmup` calls run the step eagerly on a side stream (real steps, so nothing is undone), as
    PyTorch's CUDA-graph docs require before a capture (cuBLAS workspaces, Triton compilation, autotuning);
    the next call captures the step and replays it, and every later call is one replay.

    compile (a key of COMPILE_OPTIONS, or None): the step is torch.compile'd first (Inductor fuses its
    pointwise ops into fewer kernels; the compilation happens in the first warm-up call), and the graph
    captures the compiled kernels; "fused": the step is FusedDecodeStep's single launch.

    choose (logits -> (B,) tokens, or None): the step also picks the next token and writes it into its own
    input buffer (`self.token`), so `step()` with no token continues the sequence without the host: sampling
    runs inside the graph, and the host need not wait for a step before launching the next. choose must be
    capturable (static shapes, no host reads); the graph draws from PyTorch's CUDA generator as eager code
    does, so a seed gives the same tokens with and without the graph.
    """

    def __init__(self, model, cache, batch_size, warmup=2, compile=None, choose=None):
        cache.to_static()
        if compile == "fused":
            self.forward = FusedDecodeStep(model, cache)
        else:
            compiled = (model if compile is None
                        else torch.compile(model, dynamic=False, options=COMPILE_OPTIONS[compile]))
            self.forward = lambda token: compiled(token, cache=cache)[0]
        self.cache, self.warmup, self.choose = cache, warmup, choose
        self.token = torch.zeros(batch_size, 1, dtype=torch.long, device=cache.position.device)
        self.calls, self.graph, self.logits = 0, None, None

    def step(self):
        logits = self.forward(self.token)
        if self.choose is not None:
            self.token.copy_(self.choose(logits)[:, None])
        return logits

    def __call__(self, token=None):
        """token (B, 1), or None: the token the previous call chose (choose)."""
        if token is not None:
            self.token.copy_(token)
        if self.calls < self.warmup:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.logits = self.step()
            torch.cuda.current_stream().wait_stream(side)
        else:
            if self.graph is None:
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph):
                    self.logits = self.step()
            self.graph.replay()
        self.calls += 1
        return self.logits


def replay_stream(graphed, n, done=None):
    """Yield n (B,) tokens, each one replay of `graphed` (a GraphedDecodeStep with a `choose`) from the token it
    chose last. Each token is a device tensor and nothing in the loop waits for the step it launched, so the GPU
    runs the steps back to back. `done` ((B,) bool, updated by choose), if given, is read one step late through
    pinned memory: before yielding a token the host waits for the step before it, which has finished while this
    one runs. As in the eager loop the stream stops once every row is done (the step after that is computed and
    not yielded)."""
    flags = torch.zeros(2, dtype=torch.bool, pin_memory=True) if done is not None else None
    events = [torch.cuda.Event(), torch.cuda.Event()]
    for t in range(n):
        graphed()
        token = graphed.token[:, 0].clone()
        if done is not None:
            if t > 0:
                events[(t - 1) % 2].synchronize()
                if flags[(t - 1) % 2]:
                    return
            flags[t % 2].copy_(done.all(), non_blocking=True)
            events[t % 2].record()
        yield token


def fused_step_unsupported(config):
    """Why FusedDecodeStep cannot run a model of this GPTConfig (None: it can). It takes LLaMA blocks only:
    RMSNorm, RoPE softmax attention over the whole context, SwiGLU, no biases, a power-of-two head dim."""
    wanted = {"attention": "baseline", "norm": "rmsnorm", "mlp": "swiglu", "pos": "rope", "bias": False,
              "attention_window": None, "qk_norm": False, "kv_shift": False, "output_gate": False,
              "output_norm": False}
    for name, value in wanted.items():
        if getattr(config, name) != value:
            return f"model.{name}={getattr(config, name)!r} (it takes {name}={value!r})"
    D = config.head_dim
    if D < 16 or D & (D - 1):
        return f"model.head_dim={D} (it takes powers of two >= 16)"
    return None


class FusedDecodeStep:
    """model(token, cache)[0] for a LLaMA-block model (fused_step_unsupported) over a static cache, as
    kernels.llama_step's single launch: token (B, 1) -> fp32 logits (B, 1, V), and the position advanced.

    The weights are packed once (a copy of the block matrices: the model's own tensors stay as they are), and
    every layer's keys and values move into one stacked buffer, the layers' caches becoming views of it, so the
    kernel reaches any layer's rows from one base pointer. impl: kernels.llama_step.decode_step's."""

    def __init__(self, model, cache, impl="auto"):
        blocks, config = model.blocks, model.config
        cos, sin = model._rope(0, cache.max_len, model.lm_head.weight.device)
        self.weights = LlamaStepWeights.pack(
            [b.attn.qkv.weight for b in blocks], [b.attn.out.weight for b in blocks],
            [b.mlp.w_gate.weight for b in blocks], [b.mlp.w_up.weight for b in blocks],
            [b.mlp.w_down.weight for b in blocks], [b.norm_attn.weight for b in blocks],
            [b.norm_mlp.weight for b in blocks], model.norm_f.weight, model.lm_head.weight, cos, sin,
            config.head_dim)
        self.k = torch.stack([layer.k for layer in cache.layers])
        self.v = torch.stack([layer.v for layer in cache.layers])
        for i, layer in enumerate(cache.layers):
            layer.k, layer.v = self.k[i], self.v[i]
        self.embedding, self.eps, self.cache, self.impl = model.wte.weight, config.norm_eps, cache, impl

    def __call__(self, token):
        x = F.embedding(token[:, 0], self.embedding)
        logits = decode_step(x, self.cache.position, self.weights, self.k, self.v, self.eps, self.impl)
        self.cache.advance(1)
        return logits[:, None]


def check_sampling_options(max_new_tokens, temperature, top_k, top_p):
    """Raise a ValueError naming the option when a sampling setting is out of range."""
    def is_int(x):
        return isinstance(x, int) and not isinstance(x, bool)

    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature={temperature!r} must be a number >= 0 (0: greedy)")
    if top_k is not None and (not is_int(top_k) or top_k < 0):
        raise ValueError(f"top_k={top_k!r} must be null (or 0: no top-k filtering) or an integer >= 1")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not 0 < top_p <= 1):
        raise ValueError(f"top_p={top_p!r} must be null (no nucleus filtering) or a number in (0, 1]")


def sample_token(logits, temperature=1.0, top_k=None, top_p=None):
    """(B, V) logits -> (B,) tokens. temperature 0 = argmax; top-k then nucleus (top-p) filtering."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k:                             # None or 0: no top-k filtering
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens strictly before it already reach top_p
        drop = probs.cumsum(dim=-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.multinomial(logits.softmax(dim=-1), num_samples=1).squeeze(-1)
