"""model/tint: TinT's reference update (two recipes) and the simulator, checked against each other.

Everything runs in float64 on CPU with tiny auxiliary GPTs (D = 48, 4 heads, 2 layers, K = 16 prefix
rows, S = 3, D_s = 192). Section, appendix and definition numbers refer to TinT, arXiv:2307.01189.
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
from model.tint.simulator import _Ctx

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
    """The explicit backward and the surrogate-autograd recipe give the same update in fp64."""
    model, idx = aux(style), tokens()
    a = tint_update(model, idx, N_TRAIN, lr=LR, method="explicit", **opts)
    b = tint_update(model, idx, N_TRAIN, lr=LR, method="autograd", **opts)
    da, db = flat_update(model, *a), flat_update(model, *b)
    assert da.keys() == db.keys()
    assert max_diff(da, db) <= 1e-12
    assert max(v.abs().max().item() for v in da.values()) > 1e-4        # the update is not trivial


@pytest.mark.parametrize("style", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_reference_lr_zero_is_the_model(style):
    """lr = 0 scores the test segment exactly as the unmodified model."""
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
    """With attn_grad=full, exact norm/act gradients, update_set=all == one torch.optim.SGD step on the
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
    """With fd_eps -> 0 the top block's updates (except beta_1) and beta_f equal the exact ones."""
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
    """Tokens after the training segment do not change the update (reference and simulator)."""
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
    """One step: delta(alpha lr) = alpha delta(lr)."""
    model, idx = aux(), tokens()
    a = flat_update(model, *tint_update(model, idx, N_TRAIN, lr=LR))
    b = flat_update(model, *tint_update(model, idx, N_TRAIN, lr=4 * LR))
    for k in a:
        assert (b[k] - 4 * a[k]).abs().max() <= 1e-13 * max(1.0, b[k].abs().max().item()), k


def test_label_mask():
    """lambda == 1 is the full-context loss; a single-1 mask gives the one-token update (both recipes
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
    "gpt2_steps2": ({}, {"n_steps": 2}),
    "gpt2_no_bias": ({"bias": False}, {}),
    "gpt2_padded_mlp_no_pos": ({"mlp_hidden": 100, "pos": "none"}, {}),   # 3 FFN chunks, the last zero-padded
    # LLaMA style (our extension of App. I): group-RMSNorm, GLU primitive, RoPE in the softmax heads; S = 4
    "llama": (LLAMA, {}),                                                # SwiGLU 128 -> 3 chunks of 48, padded
    "llama_top1_steps2": (LLAMA, {"n_layers": 1, "n_steps": 2}),
    "llama_bias": ({**LLAMA, "bias": True}, {}),
}


@pytest.mark.parametrize("case", SIM_CASES)
def test_simulator_equals_reference(case):
    """The simulator's logits and its updated weights (read back from the PrefixMemory) equal
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
    """In fp32: the eps_fd = 1e-3 finite differences lose ~1e-4 relative; the fp32 tolerance is 1e-3
    on the logits."""
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
    """lr = 0: the simulator's logits (every position) equal the auxiliary model's."""
    model, idx = aux(style), tokens()
    sim = TinT.from_model(model, lr=0.0)
    out = sim(idx, N_TRAIN, return_all_logits=True)
    want = model(idx)[0]
    assert ((out - want).abs().max() / want.abs().max()) <= 1e-10


def test_weights_are_data():
    """One simulator instance, auxiliary A then B loaded: outputs follow Ref(A) then Ref(B), and the
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
    """A batch equals its sequences run one at a time (each sequence has its own prefix rows)."""
    model, idx = aux(), tokens(B=3)
    sim = TinT.from_model(model, lr=LR)
    out = sim(idx, N_TRAIN)
    for i in range(3):
        assert (out[i:i + 1] - sim(idx[i:i + 1], N_TRAIN)).abs().max() <= 1e-12


def test_side_channels_are_copy_only():
    """What a module reads from a side channel is bitwise what an earlier module wrote; the
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
    """The simulator's parameter count is tint_param_formula's exact integer; the paper's Table 1
    formula gives 0.431 / 0.424 / 0.421 b for OPT-125m (Table 1 prints 0.4 b each)."""
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
    with pytest.raises(ValueError, match="even head_dim"):
        SimConfig(**{**UNIT, "n_embd": 21, "n_head": 3, "head_dim": 7, "mlp_hidden": 21, "pos": "rope"})


# ---------------------------------------------------------------------------- module unit tests

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


UNIT = dict(n_embd=48, n_head=4, head_dim=12, n_layer=1, vocab_size=8, block_size=8, mlp_hidden=192, bias=True,
            norm_eps=1e-5, pos="learned", lr=0.1, n_layers=1)
ODD = dict(n_embd=21, n_head=3, head_dim=7, mlp_hidden=21)     # K = 7, S = 3, D_s = 84, H_L = H_soft = 12


def _unit_sim(T_tok=5, **kw):
    """A one-layer fp64 simulator (its modules are the ones under test), the context of T_tok tokens of
    which 0..2 are training tokens, and a seeded generator."""
    sim = TinT(SimConfig(**{**UNIT, **kw}), dtype=torch.float64)
    m = torch.zeros(1, T_tok, dtype=torch.float64)
    m[:, :3] = 1
    return sim, sim._context(1, T_tok, m), m, torch.Generator().manual_seed(0)


def _unit_setup(T_tok=5):
    sim, ctx, m, g = _unit_sim(T_tok)
    W = torch.randn(48, 48, generator=g, dtype=torch.float64)
    b = torch.randn(48, generator=g, dtype=torch.float64)
    return sim.cfg, ctx, m, g, W, b


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


def _blk(cfg, b):
    return slice(b * cfg.n_embd, (b + 1) * cfg.n_embd)


def _rows(cfg, g, T_tok, prefix=None, blocks=None):
    """A simulator input (1, K + T_tok, D_s), random in every channel (so what a module must keep is
    visible), with the prefix rows and the token-row blocks {block: (T_tok, D)} set."""
    e = torch.randn(1, cfg.K + T_tok, cfg.D_s, generator=g, dtype=torch.float64)
    if prefix is not None:
        e[0, :cfg.K] = prefix
    for b, x in (blocks or {}).items():
        e[0, cfg.K:, _blk(cfg, b)] = x
    return e


def _kept(out, e, cfg, blocks, prefix=True):
    """The token rows outside `blocks` (and the prefix rows if `prefix`) are bitwise the input's."""
    keep = torch.ones_like(e, dtype=torch.bool)
    for b in blocks:
        keep[:, cfg.K:, _blk(cfg, b)] = False
    keep[:, :cfg.K] = prefix
    return torch.equal(out[keep], e[keep])


def _rand(g, *shape, scale=1.0, shift=0.0):
    return scale * torch.randn(*shape, generator=g, dtype=torch.float64) + shift


# fp64 formulas of the auxiliary block and its approximate backward, written out (§2.4, App. E-F)
def _ln(x, eps):
    mu = x.mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(((x - mu) ** 2).mean(-1, keepdim=True) + eps)


def _rms(x, eps):
    return x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + eps)


def _gelu(z):
    return 0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3)))


def _silu(z):
    return z / (1 + torch.exp(-z))


@pytest.mark.parametrize("which, kw", [("o", {}), ("ln2", {}), ("o", {"bias": False})],
                         ids=["linear", "norm_bias_only", "bias_free"])
def test_bias_heads(which, kw):
    """Bias heads (App. C): Linear Forward adds prefix row 0's bias slot (the other rows' copies are
    never read); [Backward || Descent] ignores the bias on the token rows and takes lr_b sum_train dy from
    row 0's bias slot only. As wired in the simulator: lr_b = lr_w = lr for linear maps, lr_w = 0 for the
    norms (the weight slots, diag(gamma) there, stay as they are), lr_b = 0 in bias-free models."""
    T_tok = 7
    sim, ctx, m, g = _unit_sim(T_tok, **ODD, **kw)
    cfg = sim.cfg
    K, D, S, lr = cfg.K, cfg.n_embd, cfg.S, cfg.lr
    W, x, dy = _rand(g, D, D), _rand(g, T_tok, D), _rand(g, T_tok, D)
    P = encode_linear(W, torch.zeros(D, dtype=torch.float64), cfg)
    P[:, S * D:] = _rand(g, K, D)                              # a different bias copy on every prefix row
    b0 = P[0, S * D:]
    e = _rows(cfg, g, T_tok, P, {0: x})
    out = sim.fwd[0].qkv(e, ctx)
    assert (out[0, K:, :D] - (x @ W.T + b0)).abs().max() <= 1e-12
    assert _kept(out, e, cfg, [0])
    layer = sim.bwd[0].o if which == "o" else sim.bwd[0].ln2[0]
    lr_w, lr_b = (lr if which == "o" else 0.0), (lr if cfg.bias else 0.0)
    e = _rows(cfg, g, T_tok, P, {0: dy, S: x})                 # dy on the signal, the layer input in memory
    out = layer(e, ctx)
    assert (out[0, K:, :D] - dy @ W).abs().max() <= 1e-12
    assert _kept(out, e, cfg, [0], prefix=False)
    mdy = dy * m[0, :, None]
    W2, _ = decode_linear(out[:, :K], cfg)
    assert (W2[0] - (W - lr_w * mdy.T @ x)).abs().max() <= 1e-12
    if lr_w == 0:
        assert torch.equal(out[0, :K, :S * D], P[:, :S * D])
    assert (out[0, 0, S * D:] - (b0 - lr_b * mdy.sum(0))).abs().max() <= 1e-12
    assert torch.equal(out[0, 1:K, S * D:], P[1:, S * D:])


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_group_norm_on_a_block(kind):
    """Group norm (App. E, Def. E.3): each listed D-block of the token rows is normalised on its own (the
    LayerNorm / RMSNorm normaliser with norm_eps); the LN forward module (App. E) then gives
    gamma * N(x) + beta on the signal and keeps (N(x), x) in its memory blocks (B_{S-1}, B_S)."""
    sim, ctx, _, g = _unit_sim(5, **ODD, norm=kind)
    cfg = sim.cfg
    K, D, S, eps = cfg.K, cfg.n_embd, cfg.S, cfg.norm_eps
    N = _ln if kind == "layernorm" else _rms
    x, y = _rand(g, 5, D, scale=3.0, shift=2.0), _rand(g, 5, D, scale=0.5, shift=-1.0)
    e = _rows(cfg, g, 5, blocks={0: x, S - 1: y})
    out = sim.fwd[0].ln1[1](e, ctx)                            # the NormLayer of blocks B0 and B_{S-1}
    assert (out[0, K:, :D] - N(x, eps)).abs().max() <= 1e-12
    assert (out[0, K:, _blk(cfg, S - 1)] - N(y, eps)).abs().max() <= 1e-12
    assert _kept(out, e, cfg, [0, S - 1])
    gamma, beta = _rand(g, D), _rand(g, D)
    e = _rows(cfg, g, 5, encode_linear(torch.diag(gamma), beta, cfg), {0: x})
    out = sim.fwd[0].ln1(e, ctx)
    assert (out[0, K:, :D] - (gamma * N(x, eps) + beta)).abs().max() <= 1e-12
    assert (out[0, K:, _blk(cfg, S - 1)] - N(x, eps)).abs().max() <= 1e-12
    assert torch.equal(out[0, K:, _blk(cfg, S)], x)
    assert _kept(out, e, cfg, [0, S - 1, S])


FD_EPS = (1e-2, 1e-3, 1e-4, 1e-5, 1e-6)


def _check_fd(run, formula, exact):
    """A finite-difference module at every fd_eps in FD_EPS: run(eps) is the module's output, formula(eps)
    the difference quotient written out. The two agree to the rounding of a quotient (1e-14 / eps: 1e-12
    at eps = 1e-2, a non-default eps, so the module must take eps from its configuration); as eps -> 0 the
    module tends to the exact derivative at first order (error / 10 per decade, 1e-5 relative at 1e-6)."""
    errs = []
    for eps in FD_EPS:
        out = run(eps)
        assert (out - formula(eps)).abs().max() <= 1e-14 / eps, eps
        errs.append(((out - exact).norm() / exact.norm()).item())
    assert all(0.05 * a <= b <= 0.2 * a for a, b in zip(errs, errs[1:])), errs
    assert errs[-1] <= 1e-5, errs


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_norm_backward_fd_module(kind):
    """Norm backward (App. E) with the memory (N(x), x): the signal becomes FD_N(x, gamma dy) =
    (N(x + eps gamma dy) - N(x)) / eps -> J_N (gamma dy), J_N = (I - 11^T / D - z z^T / D) / sigma
    (LayerNorm; RMSNorm: (I - z z^T / D) / rms); in parallel beta -= lr sum_train dy (LayerNorm only),
    gamma kept; the memory blocks are kept."""
    g = torch.Generator().manual_seed(1)
    D, eps_n = ODD["n_embd"], UNIT["norm_eps"]
    N = _ln if kind == "layernorm" else _rms
    x, dy, gamma, beta = _rand(g, 5, D, scale=2.0, shift=1.0), _rand(g, 5, D), _rand(g, D), _rand(g, D)
    gd, z = gamma * dy, N(x, eps_n)
    xc = x - x.mean(-1, keepdim=True) if kind == "layernorm" else x
    sigma = torch.sqrt((xc ** 2).mean(-1, keepdim=True) + eps_n)
    exact = (gd - z * (z * gd).mean(-1, keepdim=True) - (gd.mean(-1, keepdim=True) if kind == "layernorm" else 0))
    exact = exact / sigma

    def run(eps):
        sim, ctx, m, _ = _unit_sim(5, **ODD, norm=kind, fd_eps=eps)
        cfg = sim.cfg
        K, S = cfg.K, cfg.S
        P = encode_linear(torch.diag(gamma), beta, cfg)
        e = _rows(cfg, g, 5, P, {0: dy, S - 1: N(x, eps_n), S: x})
        out = sim.bwd[0].ln2(e, ctx)
        assert _kept(out, e, cfg, [0], prefix=False)
        if kind == "layernorm":
            P[0, S * D:] -= cfg.lr * (dy * m[0, :, None]).sum(0)
        assert (out[0, :K] - P).abs().max() <= 1e-12
        return out[0, K:, :D]

    _check_fd(run, lambda eps: (N(x + eps * gd, eps_n) - N(x, eps_n)) / eps, exact)


def test_activation_backward_fd_module():
    """Activation backward (App. F), one MLP with z from memory: the signal becomes FD_sigma(z, dg) =
    (gelu(z + eps dg) - gelu(z)) / eps -> gelu'(z) dg (GPT-2's tanh GELU); everything else kept."""
    g = torch.Generator().manual_seed(2)
    D = ODD["n_embd"]
    z, dg = _rand(g, 5, D, scale=2.0), _rand(g, 5, D)
    c = math.sqrt(2 / math.pi)
    t = torch.tanh(c * (z + 0.044715 * z ** 3))
    exact = (0.5 * (1 + t) + 0.5 * z * (1 - t ** 2) * c * (1 + 3 * 0.044715 * z ** 2)) * dg

    def run(eps):
        sim, ctx, _, _ = _unit_sim(5, **ODD, fd_eps=eps)
        e = _rows(sim.cfg, g, 5, blocks={0: dg, sim.cfg.S: z})
        out = sim.bwd[0].act(e, ctx)
        assert _kept(out, e, sim.cfg, [0])
        return out[0, sim.cfg.K:, :D]

    _check_fd(run, lambda eps: (_gelu(z + eps * dg) - _gelu(z)) / eps, exact)


def test_glu_backward_fd_module():
    """SwiGLU backward (Def. I.7), one GLU layer with (a, b) = (gate, up) pre-activations from
    memory (B_{S-1}, B_S) and dm on the signal: d_gate = (silu(a + eps dm) - silu(a)) b / eps ->
    silu'(a) dm b on the signal, d_up = silu(a) dm (exact) in B_{S-1}."""
    g = torch.Generator().manual_seed(3)
    D = 28
    kw = dict(n_embd=D, n_head=4, head_dim=7, mlp_hidden=D, norm="rmsnorm", mlp="swiglu", bias=False)  # K = 7, S = 4
    a, b, dm = _rand(g, 5, D, scale=2.0), _rand(g, 5, D), _rand(g, 5, D)
    sa = torch.sigmoid(a)
    exact = sa * (1 + a * (1 - sa)) * dm * b

    def run(eps):
        sim, ctx, _, _ = _unit_sim(5, **kw, fd_eps=eps)
        cfg = sim.cfg
        e = _rows(cfg, g, 5, blocks={0: dm, cfg.S - 1: a, cfg.S: b})
        out = sim.bwd[0].glu(e, ctx)
        assert (out[0, cfg.K:, _blk(cfg, cfg.S - 1)] - _silu(a) * dm).abs().max() <= 1e-12
        assert _kept(out, e, cfg, [0, cfg.S - 1])
        return out[0, cfg.K:, :D]

    _check_fd(run, lambda eps: (_silu(a + eps * dm) - _silu(a)) * b / eps, exact)


@pytest.mark.parametrize("transpose", [False, True], ids=["forward", "transposed"])
def test_softmax_attention_modules(transpose):
    """Self-attention (App. D) with q, k in B_{S-2}, B_{S-1} and the values on the signal, per auxiliary
    head h: A^h = causal softmax(q^h k^hT / sqrt(d_a)) over the tokens (prefix columns masked). The
    forward module gives a^h = A^h v^h; the dv module (T1) gives A^hT da^h, row t using column j iff
    j == t or j > t with m_j = 1. Everything but the signal, and the prefix rows, kept. 7 heads of
    d_a = 3 in the simulator's 12 heads of 7."""
    T_tok = 7                                                   # tokens 0..2 train, 3..6 test
    sim, ctx, m, g = _unit_sim(T_tok, **{**ODD, "n_head": 7, "head_dim": 3})
    cfg = sim.cfg
    K, D, S, H, da = cfg.K, cfg.n_embd, cfg.S, cfg.n_head, cfg.head_dim
    q, k, v = _rand(g, T_tok, D, scale=1.5), _rand(g, T_tok, D, scale=1.5), _rand(g, T_tok, D)
    e = _rows(cfg, g, T_tok, blocks={0: v, S - 2: q, S - 1: k})
    out = (sim.bwd[0] if transpose else sim.fwd[0]).softmax(e, ctx)
    t, j = torch.arange(T_tok)[:, None], torch.arange(T_tok)[None, :]
    use = (j == t) | ((j > t) & m[0].bool()[None, :])           # use[t, j] for A^T
    want = torch.empty(T_tok, D, dtype=torch.float64)
    for h in range(H):
        sl = slice(h * da, (h + 1) * da)
        A = torch.softmax((q[:, sl] @ k[:, sl].T / math.sqrt(da)).masked_fill(j > t, float("-inf")), -1)
        want[:, sl] = (A.T * use) @ v[:, sl] if transpose else A @ v[:, sl]
    assert (out[0, K:, :D] - want).abs().max() <= 1e-12
    assert _kept(out, e, cfg, [0])


def test_default_config_matches_driver_defaults():
    from omegaconf import OmegaConf

    import evaluation.tint
    assert OmegaConf.to_container(OmegaConf.load("configs/tint/default.yaml")) == evaluation.tint.DEFAULTS
