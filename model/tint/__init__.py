"""TinT, Trainable Transformer in Transformer (Panigrahi, Malladi, Xia, Arora; arXiv:2307.01189), around our GPT.

TinT is dynamic evaluation done inside one forward pass: it runs an auxiliary GPT (built by model/gpt.py)
on a sequence, takes one (or a few) approximate SGD steps on the next-token loss of the sequence's first
`n_train` tokens (the *training segment*), and scores the remaining tokens (the *test segment*) with the
updated auxiliary model (paper §2, §3.1). Two levels, which the tests check against each other:

    reference.py   the approximate update computed directly in PyTorch ("TinT-Ref"), two independent
                   formulations, and the exact-gradient dynamic-evaluation baselines;
    simulator.py   the simulator transformer ("TinT-Sim"): the auxiliary weights are data on prefix rows,
                   linear-attention heads compute every auxiliary linear map (forward, backward, descent);
                   built from layers.py (each primitive with its gate; the Forward / Backward modules)
                   and primitives.py (row layout, SimConfig, side channels, H-split maps, TinT attention);
    params.py      the simulator's exact parameter count and the paper's Table 1 formula;
    auxiliary.py   what both read from the auxiliary GPT, and the math they share (masks, normaliser,
                   activation, loss gradient at the head).

Public API
    tint_reference(aux_model, idx, n_train, lr=..., **options) -> test-segment logits
    tint_update(aux_model, idx, n_train, lr=..., **options)    -> per-sequence updated weights
    dyn_eval_reference(aux_model, idx, n_train, lr, full=False) -> exact-gradient baseline logits
    TinT.from_model(aux_model, lr=..., **options)(idx, n_train) -> test-segment logits
    tint_param_formula(sim_config) (our construction, exact) and paper_param_formula(...) (Table 1)

The test-segment logits have shape (B, L - n_train, vocab): entry [:, i] is the model's distribution over
token idx[:, n_train + i] (logits of positions n_train - 1 .. L - 2).

Conventions, the repo's choices where the paper leaves them open: the loss is summed over the training
segment (lr is per summed token), the last position carries no gradient, eps_fd = 1e-3 by default,
kappa = 1 for the MLP output bias, W_Q / W_K / norm gains / embeddings / head frozen, layers below the
top `n_layers` untouched, each sequence of a batch gets its own update.
"""
from model.tint.auxiliary import final_params, layer_params
from model.tint.params import paper_param_formula, tint_param_formula
from model.tint.reference import dyn_eval_reference, tint_reference, tint_update
from model.tint.layers import BackwardDescentLayer, LinearLayer
from model.tint.primitives import ActivationMemory, HSplitLinear, PrefixMemory, SideChannel, SimConfig
from model.tint.simulator import TinT, decode_linear, encode_linear

__all__ = ["ActivationMemory", "BackwardDescentLayer", "HSplitLinear", "LinearLayer", "PrefixMemory",
           "SideChannel", "SimConfig", "TinT", "decode_linear", "dyn_eval_reference", "encode_linear",
           "final_params", "layer_params", "paper_param_formula", "tint_param_formula", "tint_reference",
           "tint_update"]
