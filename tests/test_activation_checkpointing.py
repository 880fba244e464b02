"""Activation checkpointing (train.activation_checkpointing, GPT.checkpoint_activations): the recomputed
blocks give the loss and every gradient of the run without it, for every attention variant, the CASTLE
and FoX Triton kernels, torch.compile, dropout, DDP and FSDP2 (test_train.py's FSDP run); the activations
saved for the backward and the peak memory fall; a cached (inference) forward never recomputes; bad values
are named."""
import functools

import pytest
import torch

import model.gpt as gpt
import train
from kernels.castle import castle_attn
from kernels.forgetting import forgetting_attn
from model.gpt import GPT
from scripts.bench_memory import backoff_batches, cpu_peak_bytes, largest_fitting
from test_entry_errors import compose_config
from test_model import VARIANTS, tiny
from test_train import TINY, run, train_losses


def loss_and_grads(model, idx, params_of=None):
    """Loss and {name: gradient} of one forward and backward; params_of: the module that holds the
    parameters (the raw model of a compiled one)."""
    params_of = params_of or model
    params_of.zero_grad(set_to_none=True)
    _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in params_of.named_parameters()}


def assert_same(got, expected, rtol=1e-6, case=None):
    """Loss and every gradient equal, exactly or within rtol of the largest entry; `case` names the
    run in the messages (a test that checks several)."""
    (loss, grads), (loss_ref, grads_ref) = got, expected
    assert abs(loss - loss_ref) <= rtol * abs(loss_ref), (case, loss, loss_ref)
    assert grads.keys() == grads_ref.keys(), case
    for name, g in grads.items():
        err = (g - grads_ref[name]).abs().max()
        assert err <= rtol * grads_ref[name].abs().max(), (case, name, err.item())


def attention_runs(model):
    """A list whose i-th entry counts how often block i's attention ran (forward hooks)."""
    counts = [0] * len(model.blocks)
    for i, block in enumerate(model.blocks):
        block.attn.register_forward_hook(lambda *_, i=i: counts.__setitem__(i, counts[i] + 1))
    return counts


def random_tokens(config, batch=2, length=None):
    return torch.randint(0, config.vocab_size, (batch, (length or config.block_size) + 1))


@pytest.mark.parametrize("name", VARIANTS)
def test_recomputed_blocks_keep_loss_and_every_gradient(name):
    """fp32 CPU: the same loss and gradients as without checkpointing; the chosen blocks (selective: 0 and 2
    of 3) really run their attention twice, once in the forward and once in the backward. Both modes
    switch the one model, so they share its run without checkpointing."""
    model = GPT(tiny(n_layer=3, **VARIANTS[name]))
    idx = random_tokens(model.config)
    expected = loss_and_grads(model, idx)
    for mode, recomputed, twice in (("selective", 2, [2, 1, 2]), ("full", 3, [2, 2, 2])):
        runs = attention_runs(model)                     # counts this mode's runs
        assert model.checkpoint_activations(mode) == recomputed, mode
        assert_same(loss_and_grads(model, idx), expected, case=mode)
        assert runs == twice, (mode, runs)


@pytest.fixture
def triton_kernels(monkeypatch):
    """The model's CASTLE and FoX attention on the Triton kernels (the CUDA path), here under TRITON_INTERPRET."""
    monkeypatch.setattr(gpt, "castle_attn", functools.partial(castle_attn, impl="triton"))
    monkeypatch.setattr(gpt, "forgetting_attn", functools.partial(forgetting_attn, impl="triton"))


@pytest.mark.parametrize("name", ["castle_swl", "fox_pro"])
def test_triton_kernels_recompute_exactly(triton_kernels, name):
    """The CASTLE custom ops and FoX's Triton autograd function run again in the backward and give the
    gradients of the run without checkpointing."""
    model = GPT(tiny(n_layer=2, block_size=16, **VARIANTS[name]))
    idx = random_tokens(model.config, batch=1)
    expected = loss_and_grads(model, idx)
    runs = attention_runs(model)
    model.checkpoint_activations("full")
    assert_same(loss_and_grads(model, idx), expected)
    assert runs == [2, 2]


def saved_activation_bytes(model, idx, params_of=None):
    """Bytes of the distinct tensors (parameters aside) that one forward saves for its backward, counted by
    a saved_tensors_hooks pack hook. Non-reentrant checkpointing saves a recomputed block's inputs under
    this hook and what the block computes under its own, so the count holds what checkpointing keeps."""
    params = {p.untyped_storage().data_ptr() for p in (params_of or model).parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    return sum(saved.values())


@pytest.mark.parametrize("name", ["baseline", "castle", "fox_pro"])
def test_saved_activations_fall_with_the_blocks_recomputed(name):
    """none keeps every block's activations, full one input per block; selective (blocks 0 and 2 of 4) lies
    between them, in proportion to the blocks it keeps (within 1%)."""
    model = GPT(tiny(n_layer=4, block_size=64, n_embd=64, **VARIANTS[name]))
    idx = random_tokens(model.config, batch=8)
    saved = {}
    for mode in ("none", "selective", "full"):
        model.checkpoint_activations(mode)
        saved[mode] = saved_activation_bytes(model, idx)
    assert saved["full"] < 0.15 * saved["none"], saved
    expected = saved["full"] + 2 / 4 * (saved["none"] - saved["full"])
    assert abs(saved["selective"] - expected) < 0.01 * expected, saved


def test_peak_memory_falls():
    """The CPU allocator's peak over a forward and backward (the profiler's allocation records): selective
    below none, full below both and under 40% of none."""
    model = GPT(tiny(n_layer=4, block_size=64, n_embd=64))
    idx = random_tokens(model.config, batch=8)
    peak = {}
    for mode in ("none", "selective", "full"):
        model.checkpoint_activations(mode)
        peak[mode] = cpu_peak_bytes(functools.partial(loss_and_grads, model, idx))
    assert peak["full"] < 0.4 * peak["none"] and peak["full"] < peak["selective"] < 0.7 * peak["none"], peak


def assert_compiled_recomputes(name, most_saved):
    """A tiny model compiled afresh without checkpointing and under each mode of `most_saved`: every mode
    keeps the eager loss and gradients without checkpointing, and saves less than its share
    most_saved[mode] of what the compiled model without checkpointing saves. The modes share the model,
    its eager run and that compiled run. aot_eager runs AOTAutograd's partitioner, which decides what
    the compiled backward recomputes, without Inductor's slow CPU code generation."""
    model = GPT(tiny(n_layer=2, block_size=16, **VARIANTS[name]))
    idx = random_tokens(model.config, batch=1)
    expected = loss_and_grads(model, idx)
    saved = {}
    for mode in ("none", *most_saved):
        model.checkpoint_activations(mode)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)   # fullgraph: no graph break
        saved[mode] = saved_activation_bytes(compiled, idx, model)
        if mode != "none":
            assert_same(loss_and_grads(compiled, idx, model), expected, case=mode)
            assert saved[mode] < most_saved[mode] * saved["none"], (mode, saved)


def test_compiled_model_recomputes():
    """torch.compile traces the non-reentrant checkpoint in one graph, keeps the gradients and saves less."""
    assert_compiled_recomputes("transformer_pro", {"selective": 0.75, "full": 0.25})


@pytest.mark.slow
def test_compiled_castle_custom_ops_recompute(triton_kernels):
    """The castle::triton_fwd op inside a recomputed block is run again by the compiled backward. (FoX's
    Triton autograd function is traced only on CUDA: dynamo cannot trace the interpreter's launches.)"""
    assert_compiled_recomputes("castle", {"full": 0.25})


def test_dropout_draws_the_same_masks_when_recomputed():
    """Checkpointing restores the RNG before recomputing, so dropout inside a block (SDPA's) draws the
    same masks: the same loss and gradients under the same seed."""
    model = GPT(tiny(n_layer=2, dropout=0.3))
    idx = random_tokens(model.config)
    torch.manual_seed(1)
    expected = loss_and_grads(model, idx)
    model.checkpoint_activations("full")
    torch.manual_seed(1)
    assert_same(loss_and_grads(model, idx), expected)
    model.eval()                           # dropout did act: without it the loss differs
    assert loss_and_grads(model, idx)[0] != expected[0]


@pytest.mark.parametrize("name", ["baseline", "castle", "fox_pro"])
def test_cached_forward_never_recomputes(name):
    """With a cache (generation, even where gradients are recorded) the blocks run as they are and append
    to it; a recomputed block would attend without the cached prompt."""
    model = GPT(tiny(n_layer=2, **VARIANTS[name]))
    idx = random_tokens(model.config, length=11)
    outputs = {}
    for mode in ("none", "full"):
        model.checkpoint_activations(mode)
        runs = attention_runs(model)
        cache = model.new_cache(2, 12)
        with torch.no_grad():
            model(idx[:, :8], cache=cache)
        with torch.enable_grad():
            outputs[mode], _ = model(idx[:, 8:], cache=cache)
        assert outputs[mode].requires_grad and cache.pos == 12 and runs == [2, 2]
    torch.testing.assert_close(outputs["full"], outputs["none"], rtol=0, atol=0)


def test_bad_values_are_refused():
    model = GPT(tiny())
    with pytest.raises(ValueError, match="'some'"):
        model.checkpoint_activations("some")
    with pytest.raises(ValueError, match="every=0"):
        model.checkpoint_activations("selective", every=0)


def test_largest_fitting_micro_batch_search():
    for threshold in (0, 1, 2, 7, 16, 63, 64, 100):
        tried = []

        def fits(b):
            tried.append(b)
            return b <= threshold

        assert largest_fitting(fits, 64) == min(threshold, 64)
        assert len(tried) <= 13 and max(tried) <= 64


# ----------------------------------------------------------------------------- train.py and the benchmark

@pytest.mark.parametrize("override,expected", [
    ("train.activation_checkpointing=some",
     "train.activation_checkpointing=some is invalid: it must be one of none, selective, full"),
    ("train.activation_checkpointing_every=0",
     "train.activation_checkpointing_every=0 is invalid: it must be an integer >= 1"),
], ids=["mode", "every"])
def test_train_refuses_bad_checkpointing_options(override, expected):
    """train.py checks its options before anything else (test_entry_errors: a bad one exits 2 and writes
    nothing), in process here."""
    with pytest.raises(ValueError) as info:
        train.check_train_options(compose_config("config", [override]))
    assert expected in str(info.value)


COMMON = TINY + ["train.max_steps=3", "train.global_batch_tokens=256", "train.ckpt_interval=100"]


@pytest.fixture(scope="module")
def losses_without(tmp_path_factory):
    """Losses of a tiny train.py run (one process, accumulation 2) without activation checkpointing."""
    out = tmp_path_factory.mktemp("none")
    proc = run("train.py", COMMON + [f"train.out_dir={out}"])
    assert "activation checkpointing none (0 of 2 blocks recomputed)" in proc.stdout
    return train_losses(out)


def run_losses(out, args, torchrun=0):
    proc = run("train.py", COMMON + [f"train.out_dir={out}"] + args, torchrun=torchrun)
    return proc.stdout, train_losses(out)


@pytest.mark.slow
@pytest.mark.parametrize("mode,recomputed", [("selective", 1), ("full", 2)])
def test_training_losses_are_bit_identical(losses_without, tmp_path, mode, recomputed):
    stdout, losses = run_losses(tmp_path, [f"train.activation_checkpointing={mode}"])
    assert f"activation checkpointing {mode} ({recomputed} of 2 blocks recomputed)" in stdout
    assert losses == losses_without and sorted(losses) == [1, 2, 3]


@pytest.mark.slow
def test_compiled_training_run(losses_without, tmp_path):
    """train.compile=true (Inductor) with every block recomputed trains like the eager run without."""
    _, losses = run_losses(tmp_path, ["train.activation_checkpointing=full", "train.compile=true"])
    assert sorted(losses) == [1, 2, 3]
    for step, loss in losses.items():
        assert abs(loss - losses_without[step]) < 1e-5 * loss, (losses, losses_without)


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_two_ranks_selective_matches_one_process(losses_without, tmp_path):
    _, ddp = run_losses(tmp_path, ["train.activation_checkpointing=selective"], torchrun=2)
    assert sorted(ddp) == [1, 2, 3]
    for step, loss in ddp.items():
        assert abs(loss - losses_without[step]) < 1e-4 * loss, (ddp, losses_without)


@pytest.mark.slow
def test_memory_benchmark_finds_larger_micro_batches_with_checkpointing():
    proc = run("scripts.bench_memory", ["--device", "cpu", "--models", "tiny", "--seq-len", "64", "--memory-gib",
                                        "0.05", "--override", "model.vocab_size=512", "--max-batch", "64",
                                        "--no-compile", "--steps", "1", "--warmup", "0"])
    # | model | mode | blocks recomputed | context | micro-batch | peak GiB eager | timed at | tokens/s | vs none | ...
    rows = {r[1]: r for r in (line.split(" | ") for line in proc.stdout.splitlines()) if r[0] == "| tiny"}
    assert list(rows) == ["none", "selective", "full"], proc.stdout
    assert [rows[m][2] for m in rows] == ["0/4", "2/4", "4/4"]
    batches = [int(rows[m][4]) for m in rows]
    assert 0 < batches[0] < batches[1] < batches[2] < 64, proc.stdout
    assert [int(rows[m][6]) for m in rows] == batches            # the eager step fits: timed where found
    assert all(float(rows[m][5]) <= 0.05 and float(rows[m][7].replace(",", "")) > 0 for m in rows)
    tok_s = {m: float(rows[m][7].replace(",", "")) for m in rows}
    assert rows["none"][8] == "1.00x" and rows["full"][8] == f"{tok_s['full'] / tok_s['none']:.2f}x", proc.stdout


@pytest.mark.parametrize("batch,expected", [(89, [89, 67, 45]), (16, [16, 12, 8]), (3, [3, 2]), (2, [2, 1]), (1, [1])])
def test_compiled_timing_backs_off_to_smaller_micro_batches(batch, expected):
    assert backoff_batches(batch) == expected


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["castle", "fox_pro"])
def test_compiled_triton_kernels_recompute_on_cuda(name):
    """CUDA, fp32, Inductor: the compiled model recomputing every block (the CASTLE custom ops and FoX's
    Triton function inside) gives the gradients of the compiled model without checkpointing."""
    model = GPT(tiny(n_layer=2, block_size=64, **VARIANTS[name])).cuda()
    idx = random_tokens(model.config).cuda()
    results = {}
    for mode in ("none", "full"):
        model.checkpoint_activations(mode)
        torch._dynamo.reset()
        results[mode] = loss_and_grads(torch.compile(model), idx, model)
    assert_same(results["full"], results["none"], rtol=1e-4)
