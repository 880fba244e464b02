"""Forgetting Attention (FoX, Lin et al., arXiv:2503.02130 §3): softmax attention with a per-position
forget gate.

    o_i = sum_{j<=i} softmax_j( scale * q_i.k_j + c_i - c_j ) v_j,    c = cumsum(log f)

Tensors are (B, H, L, D); `log_fgate` is (B, H, L), the log forget gate (<= 0), float32.
The bias c_i - c_j is not scaled by `scale` (D_ij = log F_ij, eq (12)).

Public API
- `forgetting_attn(q, k, v, log_fgate, *, scale=None, window=None, prune_log_eps=None, impl="auto")`: the op;
  `impl="torch"` is the materialized reference (also works in fp64), `impl="triton"` the
  FlashAttention-2 style kernels (forward + backward). `window=W`: query i sees keys i-W+1 .. i only
  (sliding window; the kernels visit only the key tiles it touches). `log_fgate=None`: no gate, plain
  causal softmax attention; with a window this is how the model runs the Transformer-SWA (FoX
  arXiv:2503.02130 §F.4), through a kernel variant compiled without the gate's loads and sums.
  `prune_log_eps`: Adaptive Computation Pruning (arXiv:2504.06949 §3; reference.acp_block_bounds, acp_plan):
  the blocks whose bias bounds what a row loses below eps are skipped; off (None) by default.
- `fgate_cumsum`, `forgetting_decode`: cached decoding (the cache holds K, V and c), through tree
  attention's split-KV step (kernels/tree.py), whose Triton kernel computes the gate's logits from c.

Modules: reference.py (the torch reference, fgate_cumsum), triton.py (the kernels, their launch and
the gate's cumsum), op.py (forgetting_attn and the autograd function), decode.py (forgetting_decode).
Internal API for tests and benchmarks: kernels.forgetting.triton's names listed in its docstring.

Precision policy for c. An fp32 global cumsum cancels catastrophically: with log f ~ -5 at 64K
tokens |c| ~ 3e5, so each c_i carries an absolute error of ~0.02 and so does every bias c_i - c_j,
including the near-diagonal ones that carry the weight (~2% error in the probabilities). Instead c
is kept in float64 (8 bytes per head per token, nothing next to Q/K/V). The kernels get it in two
parts (triton.split_c): a float64 value per block of positions (c at its first position) and every
position's fp32 offset from its block's value, a small number; fp64 arithmetic per position would cost
the kernels a noticeable share of their time. An entry (i, j) that carries weight has |c_i - c_j|
small, so its fp32 bias error is about 6e-8 * (|c_i - c_j| + sum of |log f| over two blocks):
bounded independently of L and of |c| (about 1e-4 for |log f| <= 10 and 128-token blocks; entries
with a large |c_i - c_j| get an error relative to it, but their weight is ~exp(-|c_i - c_j|) anyway).
The op is thus invariant to adding a constant to c (i.e. to changing log f_1), which the tests
check with an offset of 3e5. The reverse cumsum of the gate gradient is done in fp64 too.
The torch reference takes c_i - c_j in fp64 directly; the decode path takes c_j - c_ref in fp64, c_ref the
newest position's c, and rounds it to the statistics' dtype (fp32 in the kernel).
"""
from kernels.forgetting.decode import forgetting_decode
from kernels.forgetting.op import forgetting_attn
from kernels.forgetting.reference import fgate_cumsum

__all__ = ["forgetting_attn", "forgetting_decode", "fgate_cumsum"]
