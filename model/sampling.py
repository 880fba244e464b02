"""Choosing the next token (check_sampling_options, sample_token) and the CUDA-graph decode step
(GraphedDecodeStep) that GPT.generate_stream uses."""
import math

import torch


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
    captures the compiled kernels.
    """

    def __init__(self, model, cache, batch_size, warmup=2, compile=None):
        cache.to_static()
        self.model = (model if compile is None
                      else torch.compile(model, dynamic=False, options=COMPILE_OPTIONS[compile]))
        self.cache, self.warmup = cache, warmup
        self.token = torch.zeros(batch_size, 1, dtype=torch.long, device=cache.position.device)
        self.calls, self.graph, self.logits = 0, None, None

    def step(self):
        return self.model(self.token, cache=self.cache)[0]

    def __call__(self, token):
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
