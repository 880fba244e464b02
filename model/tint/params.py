"""Parameter counts of the TinT simulator: ours, exactly, and the paper's formula for comparison.

Our count is lower than the paper's because the prefix layout of simulator.py (the repo's choice) makes
every re-ordering inside a linear module a whole-shard move: those maps need one dimension-wise H-split
stage (d H^2 parameters), where the paper's Q_split also counts a split-wise one (D_s^2 / H).
"""
from model.tint.primitives import SimConfig


def tint_param_formula(cfg: SimConfig):
    """Exact parameter count of our construction, per primitive: `TinT(cfg).num_params()` equals its
    "total" (a test checks it). Returns a dict with the parts and "total"."""
    D_s, H, K, P = cfg.D_s, cfg.H_L, cfg.K, cfg.P
    Hs, ds = cfg.H_soft, cfg.D_s // cfg.H_soft
    dim = K * H * H                                        # one "dim" H-split stage on the H_L x K grid
    gate = lambda n: P + 2 * n * D_s
    lin_attn = 4 * dim + 3 * P * K + 3 * H                 # 4 maps + 3 position maps + lambda gates
    route = dim + gate(2)
    linear = lin_attn + gate(2)
    bwd_desc = 2 * lin_attn + gate(3)
    bwd_only = lin_attn + gate(2)
    norm = gate(2)
    act_fwd = gate(2)
    act_bwd = 2 * dim + gate(2)
    softmax = (4 * (2 * ds * Hs * Hs + Hs * ds * ds) + 3 * P * ds + 3 * Hs + gate(2)
               + (P * cfg.head_dim if cfg.pos == "rope" else 0))   # RoPE cos / sin tables
    residual = gate(2)
    glu_fwd = 2 * dim + gate(2)
    glu_bwd = 3 * dim + gate(2)
    ln_fwd = route + norm + linear
    ln_bwd = (bwd_desc if cfg.bias and cfg.norm == "layernorm" else bwd_only) + 2 * route + norm
    if cfg.mlp == "gelu":   # up (tap + linear), act (tap + MLP) | backward: up, act
        ffn_fwd = (route + linear) + (route + act_fwd)
        ffn_bwd = act_bwd + bwd_desc
    else:                   # gate (tap + linear), route, up, glu (tap + GLU) | backward: glu, gate, route, up
        ffn_fwd = (route + linear) + route + linear + (route + glu_fwd)
        ffn_bwd = glu_bwd + bwd_desc + route + bwd_desc
    fwd_layer = (2 * ln_fwd + route + linear + 2 * route + softmax + (route + linear) + residual
                 + route + ffn_fwd + (route + linear) + 2 * route + residual)
    bwd_layer = (bwd_desc + ffn_bwd + 3 * route + ln_bwd + residual
                 + bwd_desc + softmax + bwd_desc + ln_bwd + residual)
    forward = cfg.n_layer * fwd_layer + ln_fwd
    backward = cfg.n_layers * bwd_layer + ln_bwd
    return {"forward_per_layer": fwd_layer, "backward_descent_per_layer": bwd_layer, "forward": forward,
            "backward_descent": backward, "total": forward + backward}


def paper_param_formula(D_aux, n_layer, T_aux, H_sim=12, K=None, D_sim=None):
    """The paper's parameter count (arXiv:2307.01189 Table 1): Q_split = D_s^2 / H + H D_s (one H-split
    map), Q = 4 Q_split + 3 T_sim D_s / H (one TinT attention: four maps and three position maps),
    T_sim = T_aux + K, K = D / 4, D_s = 4 D; biases ignored. The forward column adds L Q_split for the
    activations, which the table's closed-form total omits; "total" here is the sum of the columns."""
    K = D_aux // 4 if K is None else K
    D_s = 4 * D_aux if D_sim is None else D_sim
    T_sim = T_aux + K
    Q_split = D_s * D_s / H_sim + H_sim * D_s
    Q = 4 * Q_split + 3 * T_sim * D_s / H_sim
    fwd = 7 * Q * n_layer + n_layer * Q_split
    bwd = (7 * Q + 6 * D_s * H_sim) * n_layer
    desc = 7 * Q * n_layer
    return {"Q_split": Q_split, "Q": Q, "forward": fwd, "backward": bwd, "descent": desc,
            "total": fwd + bwd + desc}
