"""model/tint.py: TinT's reference update (two recipes) and the simulator (tint.md §5.5 invariants).

Everything runs in float64 on CPU with tiny auxiliary GPTs (D = 48, 4 heads, 2 layers, K = 16 prefix
rows, S = 3, D_s = 192: the test size of tint.md §5.3).
"""
import math

import pytest
import torch

from model.gpt import GPT, GPTConfig
from model.tint import (
    ActivationMemory,
    BackwardDescentLayer,
    HSplitLinear,
    LinearLayer,
    PrefixMemory,
    SideChannel,
    SimConfig,
    TinT,
    _Ctx,
    decode_linear,
    dyn_eval_reference,
    encode_linear,
    final_params,
    layer_params,
    paper_param_formula,
    tint_param_formula,
    tint_reference,
    tint_update,
)

GPT2 = {"norm": "layernorm", "mlp": "gelu", "pos": "learned", "bias": True}
LLAMA = {"norm": "rmsnorm", "mlp": "swiglu", "pos": "rope", "bias": False}
V, T, N_TRAIN, LR = 64, 12, 7, 1e-2


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny fp64 ops are dominated by thread synchronisation on a loaded 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def aux(style=GPT2, seed=0, **kw):
    """A tiny fp64 auxiliary GPT with non-trivial norms and biases (so every update is visible)."""
    torch.manual_seed(seed)
    cfg = dict(vocab_size=V, block_size=16, n_layer=2, n_head=4, n_embd=48, **style)
    cfg.update(kw)
    model = GPT(GPTConfig(**cfg)).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def tokens(B=2, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def segment_logits(model, idx, n_train=N_TRAIN):
    return model(idx)[0][:, n_train - 1:idx.size(1) - 1]


def flat_update(model, layers, final, start):
    """{name: updated - original} for every weight the update returns (None skipped)."""
    out = {}
    for k, p in enumerate(layers):
        orig = layer_params(model, start + k)
        for key, v in p.items():
            if v is not None:
                out[(start + k, key)] = (v - orig[key]).detach()
    for key, v in final.items():
        if v is not None:
            out[("f", key)] = (v - final_params(model)[key]).detach()
    return out


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


# ============================================================================ (a) the reference update

@pytest.mark.parametrize("style", [GPT2, LLAMA], ids=["gpt2", "llama"])
@pytest.mark.parametrize("opts", [{}, {"n_layers": 1}, {"n_steps": 2}], ids=["all", "top1", "steps2"])
def test_reference_recipes_agree(style, opts):
    """I1: the explicit backward and the surrogate-autograd recipe give the same update in fp64."""
    model, idx = aux(style), tokens()
    a = tint_update(model, idx, N_TRAIN, lr=LR, method="explicit", **opts)
    b = tint_update(model, idx, N_TRAIN, lr=LR, method="autograd", **opts)
    da, db = flat_update(model, *a), flat_update(model, *b)
    assert da.keys() == db.keys()
    assert max_diff(da, db) <= 1e-12
    assert max(v.abs().max().item() for v in da.values()) > 1e-4        # the update is not trivial


@pytest.mark.parametrize("style", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_reference_lr_zero_is_the_model(style):
    """I6 (reference): lr = 0 scores the test segment exactly as the unmodified model."""
    model, idx = aux(style), tokens()
    out = tint_reference(model, idx, N_TRAIN, lr=0.0)
    assert out.shape == (2, T - N_TRAIN, V)
    assert torch.equal(out, segment_logits(model, idx))
    assert not torch.allclose(tint_reference(model, idx, N_TRAIN, lr=LR), out)


@pytest.mark.parametrize("style", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_frozen_parameters_stay_frozen(style):
    """W_Q, W_K, b_Q, b_K, every gain, the embeddings and the layers below n_layers do not move; the
    TinT set (W_V, W_O, MLP, norm biases) does."""
    model, idx = aux(style), tokens()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    layers, final, start = tint_update(model, idx, N_TRAIN, lr=LR, n_layers=1)
    assert start == 1 and len(layers) == 1
    orig = layer_params(model, 1)
    p = {k: v[0] for k, v in layers[0].items() if v is not None}
    frozen = ["wq", "wk", "ln1_w", "ln2_w"] + (["bq", "bk"] if style is GPT2 else [])
    for key in frozen:
        assert torch.equal(p[key], orig[key]), key
    assert torch.equal(final["lnf_w"][0], model.norm_f.weight)
    moving = ["wv", "wo", "w_up", "w_down"] + (["bv", "bo", "b_up", "b_down", "ln1_b", "ln2_b"] if style is GPT2
                                                else ["w_gate"])
    for key in moving:
        assert not torch.equal(p[key], orig[key]), key
    for k, v in model.state_dict().items():                    # the model itself is never mutated
        assert torch.equal(v, before[k]), k


def test_exact_options_equal_one_sgd_step():
    """I2: attn_grad=full, exact norm/act gradients, update_set=all == one torch.optim.SGD step on the
    masked summed loss (embeddings frozen)."""
    model, idx = aux(), tokens(B=1)
    layers, final, _ = tint_update(model, idx, N_TRAIN, lr=LR, method="autograd", attn_grad="full",
                                   norm_grad="exact", act_grad="exact", update_set="all")
    sgd_model = aux()
    for name, p in sgd_model.named_parameters():
        p.requires_grad_(name.startswith(("blocks.", "norm_f.")))
    opt = torch.optim.SGD([p for p in sgd_model.parameters() if p.requires_grad], lr=LR)
    logits, _ = sgd_model(idx)
    loss = torch.nn.functional.cross_entropy(logits[0, :N_TRAIN - 1], idx[0, 1:N_TRAIN], reduction="sum")
    loss.backward()
    opt.step()
    for k, p in enumerate(layers):
        ref = layer_params(sgd_model, k)
        for key, v in p.items():
            if v is not None:
                assert (v[0] - ref[key]).abs().max() <= 1e-12, key
    assert (final["lnf_b"][0] - sgd_model.norm_f.bias).abs().max() <= 1e-12


def test_top_layer_tends_to_exact_gradient():
    """I3: with fd_eps -> 0 the top block's updates (except beta_1) and beta_f equal the exact ones."""
    model, idx = aux(), tokens()
    fd = flat_update(model, *tint_update(model, idx, N_TRAIN, lr=LR, fd_eps=1e-6))
    exact = flat_update(model, *tint_update(model, idx, N_TRAIN, lr=LR, method="autograd", attn_grad="full",
                                            norm_grad="exact", act_grad="exact"))
    top = [(1, k) for k in ("w_down", "b_down", "w_up", "b_up", "ln2_b", "wo", "bo", "wv", "bv")] + [("f", "lnf_b")]
    for key in top:
        rel = (fd[key] - exact[key]).norm() / exact[key].norm()
        assert rel <= 1e-5, (key, rel.item())
    # the value-only approximation shows up in beta_1 of the top block and below
    assert (fd[(1, "ln1_b")] - exact[(1, "ln1_b")]).norm() / exact[(1, "ln1_b")].norm() > 1e-4


def test_update_ignores_the_test_segment():
    """I4: tokens after the training segment do not change the update (reference and simulator)."""
    model, idx = aux(), tokens()
    idx2 = idx.clone()
    idx2[:, N_TRAIN:] = (idx2[:, N_TRAIN:] + 5) % V
    a = flat_update(model, *tint_update(model, idx, N_TRAIN, lr=LR))
    b = flat_update(model, *tint_update(model, idx2, N_TRAIN, lr=LR))
    assert all(torch.equal(a[k], b[k]) for k in a)
    sim = TinT.from_model(model, lr=LR)
    sim(idx, N_TRAIN)
    wa = flat_update(model, *sim.updated_weights())
    sim(idx2, N_TRAIN)
    wb = flat_update(model, *sim.updated_weights())
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_update_is_linear_in_lr():
    """I5: one step, delta(alpha lr) = alpha delta(lr)."""
    model, idx = aux(), tokens()
    a = flat_update(model, *tint_update(model, idx, N_TRAIN, lr=LR))
    b = flat_update(model, *tint_update(model, idx, N_TRAIN, lr=4 * LR))
    for k in a:
        assert (b[k] - 4 * a[k]).abs().max() <= 1e-13 * max(1.0, b[k].abs().max().item()), k


def test_label_mask():
    """I14: lambda == 1 is the full-context loss; a single-1 mask gives the one-token update (both recipes
    agree on it), and with exact gradients the one-token updates add up to the full one. (TinT's own
    update is not additive: the finite differences are nonlinear in the upstream gradient, O(fd_eps).)"""
    model, idx = aux(), tokens()
    full = flat_update(model, *tint_update(model, idx, N_TRAIN, lr=LR))
    ones = flat_update(model, *tint_update(model, idx, N_TRAIN, lr=LR, label_mask=torch.ones(2, T)))
    assert all(torch.equal(full[k], ones[k]) for k in full)
    exact = {"method": "autograd", "attn_grad": "full", "norm_grad": "exact", "act_grad": "exact"}
    total, total_fd = None, None
    for t in range(1, N_TRAIN):
        lam = torch.zeros(2, T)
        lam[:, t] = 1
        a = flat_update(model, *tint_update(model, idx, N_TRAIN, lr=LR, label_mask=lam))
        b = flat_update(model, *tint_update(model, idx, N_TRAIN, lr=LR, label_mask=lam, method="autograd"))
        assert max_diff(a, b) <= 1e-12
        one = flat_update(model, *tint_update(model, idx, N_TRAIN, lr=LR, label_mask=lam, **exact))
        total = one if total is None else {k: total[k] + one[k] for k in total}
        total_fd = a if total_fd is None else {k: total_fd[k] + a[k] for k in total_fd}
    assert max_diff(total, flat_update(model, *tint_update(model, idx, N_TRAIN, lr=LR, **exact))) <= 1e-12
    assert max_diff(total_fd, full) <= 1e-2 * max(v.abs().max().item() for v in full.values())


def test_dyn_eval_baselines_run():
    model, idx = aux(), tokens()
    matched = dyn_eval_reference(model, idx, N_TRAIN, lr=LR)
    full = dyn_eval_reference(model, idx, N_TRAIN, lr=LR, full=True)
    assert matched.shape == full.shape == (2, T - N_TRAIN, V)
    assert not torch.allclose(matched, full)


# ============================================================================ (b) the simulator

SIM_CASES = {
    "gpt2": ({}, {}),
    "gpt2_top1": ({}, {"n_layers": 1}),
    "gpt2_steps2": ({}, {"n_steps": 2}),                                 # I12
    "gpt2_no_bias": ({"bias": False}, {}),
    "gpt2_padded_mlp_no_pos": ({"mlp_hidden": 100, "pos": "none"}, {}),   # 3 FFN chunks, the last zero-padded
    # LLaMA style (our extension, §5.4): group-RMSNorm, GLU primitive, RoPE in the softmax heads; S = 4
    "llama": (LLAMA, {}),                                                # SwiGLU 128 -> 3 chunks of 48, padded
    "llama_top1_steps2": (LLAMA, {"n_layers": 1, "n_steps": 2}),
    "llama_bias": ({**LLAMA, "bias": True}, {}),
}


@pytest.mark.parametrize("case", SIM_CASES)
def test_simulator_equals_reference(case):
    """I7 / I12: the simulator's logits and its updated weights (read back from the PrefixMemory) equal
    the reference update's."""
    model_kw, opts = SIM_CASES[case]
    style = {**GPT2, **model_kw}
    model, idx = aux(style), tokens()
    sim = TinT.from_model(model, lr=LR, **opts)
    out = sim(idx, N_TRAIN)
    ref = tint_reference(model, idx, N_TRAIN, lr=LR, **opts)
    assert out.shape == ref.shape == (2, T - N_TRAIN, V)
    assert (out - ref).abs().max() <= 1e-8
    assert (ref - segment_logits(model, idx)).abs().max() > 1e-3        # the update matters
    ws = flat_update(model, *sim.updated_weights())
    wr = flat_update(model, *tint_update(model, idx, N_TRAIN, lr=LR, **opts))
    assert ws.keys() == wr.keys()
    for k in wr:
        scale = max(wr[k].abs().max().item(), 1e-300)
        assert (ws[k] - wr[k]).abs().max() / scale <= 1e-9 or (ws[k] - wr[k]).abs().max() <= 1e-15, k


@pytest.mark.parametrize("style", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_simulator_fp32(style):
    """I7 in fp32: the eps_fd = 1e-3 finite differences lose ~1e-4 relative, tint.md's fp32 tolerance is
    1e-3 on the logits."""
    model, idx = aux(style).float(), tokens()
    out = TinT.from_model(model, lr=LR)(idx, N_TRAIN)
    assert out.dtype == torch.float32
    assert (out - tint_reference(model, idx, N_TRAIN, lr=LR)).abs().max() <= 1e-3


def test_simulator_label_mask():
    """The label mask (loss on chosen targets only) reaches the simulator's declared loss op as in Ref."""
    model, idx = aux(), tokens()
    lam = torch.zeros(2, T)
    lam[0, 3] = lam[1, 5] = lam[1, 6] = 1
    out = TinT.from_model(model, lr=LR)(idx, N_TRAIN, label_mask=lam)
    assert (out - tint_reference(model, idx, N_TRAIN, lr=LR, label_mask=lam)).abs().max() <= 1e-8


@pytest.mark.parametrize("style", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_simulator_lr_zero_is_the_model(style):
    """I6: lr = 0, the simulator's logits (every position) equal the auxiliary model's."""
    model, idx = aux(style), tokens()
    sim = TinT.from_model(model, lr=0.0)
    out = sim(idx, N_TRAIN, return_all_logits=True)
    want = model(idx)[0]
    assert ((out - want).abs().max() / want.abs().max()) <= 1e-10


def test_weights_are_data():
    """I8: one simulator instance, auxiliary A then B loaded: outputs follow Ref(A) then Ref(B), and the
    simulator's own parameters never change."""
    a, b, idx = aux(seed=0), aux(seed=3), tokens()
    sim = TinT.from_model(a, lr=LR)
    params = [p.detach().clone() for p in sim.parameters()]
    out_a = sim(idx, N_TRAIN)
    sim.load_aux(b)
    out_b = sim(idx, N_TRAIN)
    assert (out_a - tint_reference(a, idx, N_TRAIN, lr=LR)).abs().max() <= 1e-8
    assert (out_b - tint_reference(b, idx, N_TRAIN, lr=LR)).abs().max() <= 1e-8
    assert (out_a - out_b).abs().max() > 1e-2
    assert all(torch.equal(p, q) for p, q in zip(params, sim.parameters()))
    assert not any(torch.is_tensor(x) and x.requires_grad for x in sim.parameters())


def test_batch_independence():
    """I11: a batch equals its sequences run one at a time (each sequence has its own prefix rows)."""
    model, idx = aux(), tokens(B=3)
    sim = TinT.from_model(model, lr=LR)
    out = sim(idx, N_TRAIN)
    for i in range(3):
        assert (out[i:i + 1] - sim(idx[i:i + 1], N_TRAIN)).abs().max() <= 1e-12


def test_side_channels_are_copy_only():
    """I13: what a module reads from a side channel is bitwise what an earlier module wrote; the
    channel class has no method besides put/get; and the Q/K prefixes, gains and lower layers come back
    unchanged (frozen)."""
    public = {n for n in vars(SideChannel) if not n.startswith("_")}
    assert public == {"put", "get"}
    assert all(not {n for n in vars(c) if not n.startswith("_")} for c in (ActivationMemory, PrefixMemory))
    log = []

    def recording(base):
        class Rec(base):
            def put(self, key, value):
                super().put(key, value)
                log.append(("put", base.__name__, key, value.detach().clone()))

            def get(self, key):
                out = super().get(key)
                log.append(("get", base.__name__, key, out.clone()))
                return out
        return Rec

    model, idx = aux(), tokens()
    sim = TinT.from_model(model, lr=LR, n_layers=1)
    sim.side_channel_types = (recording(ActivationMemory), recording(PrefixMemory))
    out = sim(idx, N_TRAIN)
    last = {}
    n_get = 0
    for op, chan, key, value in log:
        if op == "put":
            last[(chan, key)] = value
        else:
            n_get += 1
            assert torch.equal(value, last[(chan, key)]), (chan, key)
    assert n_get > 50
    # frozen contents: W_Q, W_K of the top layer and everything of layer 0 are never re-written
    puts = {(chan, key) for op, chan, key, _ in log if op == "put"}
    first = {}
    for op, chan, key, value in log:
        if op == "put" and chan == "PrefixMemory":
            first.setdefault(key, value)
    for key in [(1, "q"), (1, "k")] + [k for k in first if k[0] == 0]:
        assert torch.equal(sim.last_prefix_memory.get(key), first[key]), key
    assert ("PrefixMemory", (1, "v")) in puts
    assert (out - tint_reference(model, idx, N_TRAIN, lr=LR, n_layers=1)).abs().max() <= 1e-8


def test_parameter_count_formula():
    """I10: the simulator's parameter count is tint_param_formula's exact integer; the paper's Table 1
    formula gives 0.431 / 0.424 / 0.421 b for OPT-125m (tint.md §3.15)."""
    for style, opts in [(GPT2, {}), ({**GPT2, "bias": False}, {"n_layers": 1}), (LLAMA, {})]:
        sim = TinT.from_model(aux(style), lr=LR, **opts)
        assert sim.num_params() == tint_param_formula(sim.cfg)["total"]
    p = paper_param_formula(768, 12, 2048, H_sim=12)
    assert round(p["Q_split"]) == 823296 and round(p["Q"]) == 5013504
    assert [round(p[k] / 1e9, 3) for k in ("forward", "backward", "descent")] == [0.431, 0.424, 0.421]
    # our construction for a GPT-2 124M-shaped auxiliary model (no instantiation needed)
    cfg = SimConfig(n_embd=768, n_head=12, head_dim=64, n_layer=12, vocab_size=50304, block_size=1024,
                    mlp_hidden=3072, bias=True, norm_eps=1e-5, pos="learned", lr=1e-4, n_layers=12)
    assert (cfg.K, cfg.S, cfg.D_s, cfg.H_L, cfg.H_soft) == (256, 3, 3072, 12, 12)
    assert 0.2e9 < tint_param_formula(cfg)["total"] < 1.5e9      # 370.7 M: shard-aligned maps are "dim"-only


def test_simulator_rejects_unsupported_models():
    with pytest.raises(ValueError):
        TinT.from_model(aux(attention="fox", pos="none"), lr=LR)
    sim = TinT.from_model(aux(), lr=LR)
    with pytest.raises(ValueError):                      # weights of a differently shaped model
        sim.load_aux(aux(LLAMA))


# ---------------------------------------------------------------------------- module unit tests (I9)

def test_three_pass_permutation():
    """A random partial permutation of a 6 x 8 grid (with weights) through dim -> split -> dim stages."""
    g = torch.Generator().manual_seed(0)
    H, d = 6, 8
    cells = [(h, c) for h in range(H) for c in range(d)]
    src = torch.randperm(H * d, generator=g)[:30].tolist()
    dst = torch.randperm(H * d, generator=g)[:30].tolist()
    w = torch.randn(30, generator=g, dtype=torch.float64)
    routes = tuple((cells[s], cells[t], w[i].item()) for i, (s, t) in enumerate(zip(src, dst)))
    m = HSplitLinear(H, d, ("dim", "split", "dim"), dtype=torch.float64)
    m.set_routes(routes)
    x = torch.randn(5, H * d, generator=g, dtype=torch.float64)
    want = torch.zeros_like(x)
    for i, (s, t) in enumerate(zip(src, dst)):
        want[:, t] = w[i] * x[:, s]
    assert (m(x) - want).abs().max() <= 1e-14
    assert sum(p.numel() for p in m.parameters()) == 2 * d * H * H + H * d * d


def _unit_setup(T_tok=5):
    cfg = SimConfig(n_embd=48, n_head=4, head_dim=12, n_layer=1, vocab_size=8, block_size=8, mlp_hidden=192,
                    bias=True, norm_eps=1e-5, pos="learned", lr=0.1, n_layers=1)
    sim = TinT(cfg, dtype=torch.float64)
    m = torch.zeros(1, T_tok, dtype=torch.float64)
    m[:, :3] = 1                                                # tokens 0..2 are training tokens
    ctx = sim._context(1, T_tok, m)
    g = torch.Generator().manual_seed(0)
    W = torch.randn(48, 48, generator=g, dtype=torch.float64)
    b = torch.randn(48, generator=g, dtype=torch.float64)
    return cfg, ctx, m, g, W, b


def test_linear_forward_backward_descent_modules():
    """Linear Forward gives W x + b; [Backward || Descent] gives W^T dy on the token rows and
    W - lr sum_{train} dy x^T, b - lr sum_{train} dy on the prefix rows."""
    cfg, ctx, m, g, W, b = _unit_setup()
    K, D = cfg.K, cfg.n_embd
    x = torch.randn(1, 5, D, generator=g, dtype=torch.float64)
    dy = torch.randn(1, 5, D, generator=g, dtype=torch.float64)
    e = torch.zeros(1, K + 5, cfg.D_s, dtype=torch.float64)
    e[:, :K] = encode_linear(W, b, cfg)
    e[:, K:, :D] = x
    out = LinearLayer(cfg, dtype=torch.float64)(e, ctx)
    assert (out[:, K:, :D] - (x @ W.T + b)).abs().max() <= 1e-12
    assert torch.equal(out[:, :K], e[:, :K]) and torch.equal(out[:, K:, D:], e[:, K:, D:])
    e2 = e.clone()
    e2[:, K:, :D] = dy
    e2[:, K:, cfg.S * D:] = x                                   # the layer input, in its memory block
    out = BackwardDescentLayer(cfg, cfg.lr, cfg.lr, dtype=torch.float64)(e2, ctx)
    assert (out[:, K:, :D] - dy @ W).abs().max() <= 1e-12
    W2, b2 = decode_linear(out[:, :K], cfg)
    mm = m[0, :, None]
    assert (W2[0] - (W - cfg.lr * (dy[0] * mm).T @ x[0])).abs().max() <= 1e-12
    assert (b2[0] - (b - cfg.lr * (dy[0] * mm).sum(0))).abs().max() <= 1e-12


def test_prefix_encoding_round_trip():
    cfg, _, _, _, W, b = _unit_setup()
    W2, b2 = decode_linear(encode_linear(W, b, cfg)[None], cfg)
    assert torch.equal(W2[0], W) and torch.equal(b2[0], b)


def test_context_masks():
    """Descent attends training tokens only; the dv backward's A^T uses j == t or j > t with m_j = 1."""
    cfg, ctx, *_ = _unit_setup()
    K = cfg.K
    pre2train = ctx.masks["pre2train"][0, 0]
    assert pre2train[:K, K:K + 3].eq(1).all() and pre2train[:K, K + 3:].eq(0).all() and pre2train[K:].eq(0).all()
    vg = ctx.masks["vgrad"][0, 0, K:, K:]
    want = torch.tensor([[1.0 if (j == t or (j > t and j < 3)) else 0.0 for j in range(5)] for t in range(5)],
                        dtype=torch.float64)
    assert torch.equal(vg, want)
    assert isinstance(ctx, _Ctx) and math.isclose(float(ctx.onehot.sum()), K + 5)


# ---------------------------------------------------------------------------- the eval.py driver

def test_tint_eval_driver(monkeypatch, tmp_path):
    """evaluation/tint.py end to end on a tiny model: held-out text (stub loader) and a multiple-choice
    file (stub tokenizer); the simulator's parameter count is checked against the formula, and its
    logits agree with the reference on the subset it scores."""
    import json

    from omegaconf import OmegaConf

    import data.loader
    import evaluation.tint
    from evaluation import EVALUATIONS

    class Loader:
        def next_batch(self):
            x = torch.randint(0, V, (2, 14))
            return x, x

    class Tok:
        eot_token = 0

        def encode_ordinary(self, text):
            return [1 + (b % (V - 1)) for b in text.encode()]

    monkeypatch.setattr(data.loader, "build_loader", lambda cfg, split, B, L: Loader())
    task = tmp_path / "mc.jsonl"
    task.write_text("\n".join(json.dumps({"query": f"Question: q{i}?", "choices": ["ab", "c"], "gold": i % 2})
                              for i in range(3)))
    cfg = OmegaConf.create({"tint": {"lr": 1e-2, "dtype": "fp64", "train_fracs": [0.5], "batch_size": 2,
                                     "batches": 2, "sim_batches": 1, "task": "arc_easy", "task_path": str(task),
                                     "task_examples": 3, "sim_examples": 2}})

    class Ctx:
        pass

    ctx = Ctx()
    ctx.cfg, ctx.data_cfg, ctx.seq_len, ctx.device = cfg, OmegaConf.create({"tokenizer": "gpt2"}), 14, "cpu"
    ctx.tokenizer = Tok()
    res = EVALUATIONS["tint"](aux().float(), ctx)
    json.dumps(res)
    assert res["simulator"]["params_built"] == res["simulator"]["params_formula"]
    text = res["text"]["frac_0.5"]
    assert text["n_train"] == 7 and set(text["perplexity"]) == {"vanilla", "dyneval", "tint_ref"}
    assert text["sim_subset"]["max_abs_logit_diff_sim_vs_ref"] <= 1e-8
    assert res["task"]["examples"] == 3
    assert set(res["task"]["sim_subset"]["acc"]) == {"vanilla", "dyneval", "tint_ref", "tint_sim"}
    with pytest.raises(ValueError):
        evaluation.tint.options(type("C", (), {"cfg": OmegaConf.create({"tint": {"lrr": 1}})})())


def test_default_config_matches_driver_defaults():
    from omegaconf import OmegaConf

    import evaluation.tint
    assert OmegaConf.to_container(OmegaConf.load("configs/tint/default.yaml")) == evaluation.tint.DEFAULTS
