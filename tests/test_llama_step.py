"""The single-launch LLaMA decode step (kernels/llama_step) against its PyTorch reference, and its model binding
(model/sampling.py FusedDecodeStep, GPT.generate(cuda_graph="fused")) against the model's own static step.

On CPU the kernel runs under the Triton interpreter one phase per launch (tests/conftest.py sets it where there
is no GPU); the GPU tests run the real single launch with its grid barriers and L2 prefetches."""
import os
import subprocess
import sys

import pytest
import torch

from kernels.llama_step import LlamaStepWeights, decode_step, pack_qkv
from kernels.llama_step.reference import unpair_rows
from kernels.llama_step.triton import decode_step_triton
from kernels.triton_utils import interpreting
from model.gpt import GPT, rope_tables
from model.sampling import FusedDecodeStep, fused_step_unsupported
from scripts import bench_llama_step
from tests.test_model import LLAMA, PRO, tiny

needs_triton = pytest.mark.skipif(not (torch.cuda.is_available() or interpreting()),
                                  reason="the Triton kernel needs CUDA or TRITON_INTERPRET=1")
FUSED_LLAMA = dict(attention="baseline", **LLAMA, n_head=2, n_embd=32)     # head_dim 16


def random_step(L, B, H, D, d, F, V, CAP, dtype, device="cpu", seed=0):
    """Random packed weights (norm scales around 1), caches whose rows hold garbage (NaN past row 0 of
    batch 0's first layer, which the position must mask), and token embeddings."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    cos, sin = rope_tables(D, CAP, 10000.0, device)
    w = LlamaStepWeights.random(L, H, D, d, F, V, cos, sin, dtype, g)
    k, v = r(L, B, H, CAP, D), r(L, B, H, CAP, D)
    return w, k, v, r(B, d)


def with_nan_past(cache, pos):
    """The cache with every row past `pos` NaN: rows no position has written must not be read."""
    cache = cache.clone()
    cache[:, :, :, pos + 1:] = float("nan")
    return cache


def test_pack_qkv_pairs_the_rows_rope_rotates_together():
    D = 8
    w = torch.arange(2 * D, dtype=torch.float64)[:, None].expand(2 * D, 3)
    packed = pack_qkv(w, D)
    assert packed[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]
    assert torch.equal(unpair_rows(packed.T, D).T, w)


@needs_triton
@pytest.mark.parametrize("dtype, tol, programs, B, CAP", [
    (torch.float32, 2e-5, 1, 3, 37), (torch.float32, 2e-5, 7, 3, 37), (torch.bfloat16, 2e-2, 3, 3, 37),
    (torch.float32, 2e-5, 7, 1, 300)])
def test_kernel_equals_reference(dtype, tol, programs, B, CAP):
    """Odd sizes (d 40, F 50, V 70, 3 heads, batch 3 or 1), the first, a middle and the last position, 1-7
    programs (shares of zero and one rows included): logits and the written cache rows match the reference;
    every row past the position is NaN and never read. A capacity of 300 splits each head's cache in two
    (7 programs), so the first two positions leave the second split empty, and the last fills a part of it."""
    L, H, D, d, F, V = 2, 3, 16, 40, 50, 70
    device = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
    w, k, v, x = random_step(L, B, H, D, d, F, V, CAP, dtype, device)
    for pos in (0, 20, CAP - 1):
        position = torch.tensor([pos], device=device)
        k_ref, v_ref = with_nan_past(k, pos), with_nan_past(v, pos)
        k_out, v_out = k_ref.clone(), v_ref.clone()
        ref = decode_step(x.clone(), position, w, k_ref, v_ref, 1e-5, impl="torch")
        out = decode_step_triton(x.clone(), position, w, k_out, v_out, 1e-5, programs=programs)
        assert out.dtype == torch.float32 and out.shape == (B, V)
        torch.testing.assert_close(out, ref.float(), rtol=tol, atol=tol * ref.abs().max().item())
        for got, want in ((k_out, k_ref), (v_out, v_ref)):
            torch.testing.assert_close(got, want, rtol=tol, atol=tol, equal_nan=True)


def test_reference_equals_the_unpacked_step_in_fp64():
    """The reference itself, on fp64 weights: packing (the pair order) changes no result; one position of
    one layer checked against attention written out from the unpacked matrices."""
    L, B, H, D, d, F, V, CAP = 1, 2, 2, 16, 24, 30, 11, 9
    w, k, v, x = random_step(L, B, H, D, d, F, V, CAP, torch.float64)
    pos = 5
    position = torch.tensor([pos])
    k_in, v_in = k.clone(), v.clone()
    logits = decode_step(x.clone(), position, w, k_in, v_in, 1e-6, impl="torch")

    def rms(t, g):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * g

    wqkv = unpair_rows(w.wqkv[0].T, D).T                          # back to q|k|v, head, dim order
    q, kn, vn = (rms(x, w.norms[0, 0]) @ wqkv.T).view(B, 3, H, D).unbind(1)
    cos, sin = w.cos[pos], w.sin[pos]
    rot = lambda t: torch.cat([t[..., :8] * cos - t[..., 8:] * sin, t[..., :8] * sin + t[..., 8:] * cos], -1)
    keys = torch.cat([k[0, :, :, :pos], rot(kn)[:, :, None]], dim=2)
    values = torch.cat([v[0, :, :, :pos], vn[:, :, None]], dim=2)
    p = torch.softmax((rot(q)[:, :, None] * keys).sum(-1) / D ** 0.5, dim=-1)
    h = x + (p[..., None] * values).sum(2).reshape(B, H * D) @ w.wo[0].T
    gate, up = rms(h, w.norms[0, 1]) @ w.wgu[0, :F].T, rms(h, w.norms[0, 1]) @ w.wgu[0, F:].T
    h = h + (torch.nn.functional.silu(gate) * up) @ w.wd[0].T
    torch.testing.assert_close(logits, rms(h, w.norm_f) @ w.head.T, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(k_in[0, :, :, pos], rot(kn), rtol=1e-12, atol=1e-12)


def llama_model(dtype=torch.float32, device="cpu", **kw):
    torch.manual_seed(0)
    return GPT(tiny(**{**FUSED_LLAMA, **kw})).to(device=device, dtype=dtype).eval()


@needs_triton
@torch.no_grad()
def test_fused_step_equals_the_models_static_step():
    """FusedDecodeStep (the kernel) against GPT.forward on a static cache, step after step from a prompt of 5:
    the same logits and the same cache rows, position advanced; untied head, 3 layers, batch 2."""
    device = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
    model = llama_model(device=device, n_layer=3, tie_embeddings=False)
    prompt, tokens = torch.randint(0, 97, (2, 5), device=device), torch.randint(0, 97, (2, 4), device=device)
    caches = [model.new_cache(2, 12) for _ in range(2)]
    for cache in caches:
        model(prompt, cache=cache)
        cache.to_static()
    fused = FusedDecodeStep(model, caches[0], impl="triton")
    for t in range(tokens.size(1)):
        got = fused(tokens[:, t:t + 1])
        want = model(tokens[:, t:t + 1], cache=caches[1])[0]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert caches[0].position.item() == caches[1].position.item() == 9
    for mine, theirs in zip(caches[0].layers, caches[1].layers):
        torch.testing.assert_close(mine.k[:, :, :9], theirs.k[:, :, :9], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mine.v[:, :, :9], theirs.v[:, :, :9], rtol=1e-5, atol=1e-5)
    assert all(layer.k.data_ptr() == fused.k[i].data_ptr() for i, layer in enumerate(caches[0].layers))


@pytest.mark.parametrize("kw, reason", [
    (dict(attention="fox", **LLAMA), "model.attention='fox'"),
    (dict(attention="baseline", **LLAMA, **PRO), "model.qk_norm=True"),
    (dict(attention="baseline", norm="layernorm", mlp="gelu", pos="learned", bias=True), "model.norm='layernorm'"),
    (dict(attention="baseline", **LLAMA, attention_window=4), "model.attention_window=4"),
    (dict(attention="baseline", **LLAMA, n_head=4), "model.head_dim=8"),
])
def test_fused_mode_refuses_other_blocks_by_name(kw, reason):
    assert reason in fused_step_unsupported(tiny(**{**dict(n_head=2), **kw}))
    model = GPT(tiny(**{**dict(n_head=2), **kw})).eval()
    with pytest.raises(ValueError, match="cuda_graph='fused' decodes LLaMA blocks only, not " + reason):
        model.generate(torch.zeros(1, 3, dtype=torch.long), 2, cuda_graph="fused")
    assert fused_step_unsupported(tiny(**FUSED_LLAMA)) is None


def test_fused_mode_refuses_large_batches_by_name():
    model = llama_model()
    with pytest.raises(ValueError, match=r"cuda_graph='fused' decodes batches of up to 4 rows .* not 5: use "
                                         r"cuda_graph='compiled'"):
        model.generate(torch.zeros(5, 3, dtype=torch.long), 2, cuda_graph="fused")


def assert_fits_hoppers_shared_memory(script, configs):
    """Run a compile script (below) on these configs in its own process; every kernel must fit the 227 KiB of
    shared memory a Hopper program has, or it would fail to launch on the GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", script, *configs], cwd=root, env=env, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    shared = [int(line.split()[-1]) for line in out.stdout.splitlines()]
    assert len(shared) == len(configs) and max(shared) <= 232448, out.stdout


# Compiles the kernel for Hopper (sm_90, no GPU needed: Triton's own ptxas) at the constants decode_step_triton
# launches, and prints each shape's shared memory; a separate process, since the interpreter replaces the kernel.
HOPPER_COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.llama_step.triton import _llama_step_kernel, launch_constants
names = _llama_step_kernel.arg_names
weights = "WQKV WO WGU WD NORMS NORM_F WH KC VC".split()
for dtype, size, B, d, F, H, D in [tuple(x if i == 0 else int(x) for i, x in enumerate(c.split(":")))
                                   for c in sys.argv[1:]]:
    types = {n: "*fp32" for n in "X Q PO PM PL ATT HID LOGITS COS SIN".split()}
    types.update(BAR="*i32", CNT="*i32", POS="*i64", eps="fp32", qk_scale="fp32", **{n: "*" + dtype for n in weights})
    types.update({n: "i32" for n in "B d H F V CAP S L ph0 ph1".split()})
    _, constants = launch_constants(B, d, F, H, D, 32768, size, 132)
    constants["SYNC"] = True
    types.update({n: "constexpr" for n in constants})
    src = ASTSource(_llama_step_kernel, {n: types[n] for n in names},
                    constexprs={(names.index(n),): v for n, v in constants.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=4, launch_cooperative_grid=True))
    print(dtype, B, d, D, kernel.metadata.shared)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="Triton's ptxas ships for Linux")
def test_every_supported_shape_fits_hoppers_shared_memory():
    """The pipelined tiles live in shared memory (227 KiB per program on Hopper): the launch constants must fit, or
    the kernel fails to launch on the GPU. The largest tiles: fp32 weights, head dim 128, d 2048, batch 1 (three
    pipeline stages) and the largest batch (two); bf16 tiles are half their size."""
    assert_fits_hoppers_shared_memory(HOPPER_COMPILE, ["fp32:4:1:2048:5632:16:128", "fp32:4:4:2048:5632:16:128"])


GLUON_HOPPER_COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from kernels.llama_step.gluon import _llama_step_gluon, launch_constants
names = _llama_step_gluon.arg_names
weights = "WQKV WO WGU WD NORMS NORM_F WH KC VC".split()
for dtype, size, d, F, H, D, CAP in [tuple(x if i == 0 else int(x) for i, x in enumerate(c.split(":")))
                                     for c in sys.argv[1:]]:
    types = {n: "*fp32" for n in "X Q PO PM PL ATT HID LOGITS COS SIN".split()}
    types.update(BAR="*i32", CNT="*i32", POS="*i64", eps="fp32", qk_scale="fp32", **{n: "*" + dtype for n in weights})
    types.update({n: "i32" for n in "d H F V CAP L".split()})
    types.update({n: "i64" for n in "base_wo base_wgu base_wd base_wh base_kc base_vc".split()})
    _, constants = launch_constants(d, F, H, D, 50304, CAP, size, 132)
    types.update({n: "constexpr" for n in constants})
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in names
               if types[n].startswith("*") or n in ("d", "F", "CAP", "V")}
    src = GluonASTSource(_llama_step_gluon, {n: types[n] for n in names},
                         constexprs={(names.index(n),): v for n, v in constants.items()}, attrs=aligned)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=8, launch_cooperative_grid=True))
    print(dtype, d, D, CAP, kernel.metadata.shared)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="Triton's ptxas ships for Linux")
def test_gluon_step_fits_hoppers_shared_memory():
    """The Gluon step's ring, staged vector and schedule fill shared memory to what launch_constants leaves for
    the compiler's scratch: at head dims 64 and 128, bf16 and fp32, and a 128K-row cache (the longest
    schedule) it must compile for Hopper within 227 KiB, or it fails to launch."""
    configs = ["bf16:2:1024:2816:16:64:32768", "bf16:2:1024:2816:8:128:4096", "fp32:4:2048:5632:16:128:131072"]
    assert_fits_hoppers_shared_memory(GLUON_HOPPER_COMPILE, configs)


def test_gluon_step_refuses_batches_by_name():
    w, k, v, x = random_step(1, 2, 2, 16, 32, 48, 97, 8, torch.float32)
    with pytest.raises(ValueError, match=r"takes batch 1, not batch 2: use impl='triton'"):
        decode_step(x, torch.tensor([0]), w, k, v, 1e-6, impl="gluon")


# ----------------------------------------------------------------------------- on a GPU

def assert_step_equals_the_reference(impl, w, k, v, x, pos, tol):
    """decode_step(impl=...) at cache row pos against impl="torch": the logits and both caches (NaN past pos, which
    the step must never read)."""
    position = torch.tensor([pos], device=x.device)
    k_ref, v_ref = with_nan_past(k, pos), with_nan_past(v, pos)
    k_out, v_out = k_ref.clone(), v_ref.clone()
    ref = decode_step(x.clone(), position, w, k_ref, v_ref, 1e-6, impl="torch")
    out = decode_step(x.clone(), position, w, k_out, v_out, 1e-6, impl=impl)
    torch.testing.assert_close(out, ref.float(), rtol=tol, atol=tol * ref.abs().max().item())
    scale = k_ref[k_ref.isfinite()].abs().max().item()     # keys grow with depth: deep layers' are ~10
    torch.testing.assert_close(k_out, k_ref, rtol=tol, atol=tol * scale, equal_nan=True)
    torch.testing.assert_close(v_out, v_ref, rtol=tol, atol=tol * scale, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_single_launch_at_a_360M_shape(dtype, tol):
    """The real launch (one program per SM, grid barriers, L2 prefetches) at the Transformer (LLaMA) 360M shapes
    with 4 of its 24 layers, a 4100-row cache, batch 1 and 3, against the reference."""
    for B in (1, 3):
        w, k, v, x = random_step(4, B, 16, 64, 1024, 2816, 50304, 4100, dtype, "cuda", seed=B)
        for pos in (0, 4099):
            assert_step_equals_the_reference("triton", w, k, v, x, pos, tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_fused_graph_generation_equals_the_eager_graph():
    """GPT.generate(cuda_graph="fused"): the single launch captured in a CUDA graph and replayed gives the same
    greedy tokens as cuda_graph=True (fp32, 48 tokens after a prompt of 7; batch 1, the Gluon kernel on a
    Hopper, and batch 2, the Triton kernel)."""
    model = llama_model(device="cuda", n_layer=3, n_embd=64, n_head=4, block_size=64)
    for B in (1, 2):
        prompt = torch.randint(0, 97, (B, 7), device="cuda")
        assert torch.equal(model.generate(prompt, 48, temperature=0, cuda_graph="fused"),
                           model.generate(prompt, 48, temperature=0, cuda_graph=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs a Hopper (or newer) GPU")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_gluon_step_equals_the_reference(dtype, tol):
    """impl="gluon" against the reference: the 360M shapes (4 of 24 layers, a 4100-row cache), head dim 128,
    and tiny odd sizes where most programs own no rows; the first, a middle and the last cache row (the
    ring's partial tiles and the item that holds the new key)."""
    shapes = [(4, 16, 64, 1024, 2816, 50304, 4100), (2, 8, 128, 1024, 2816, 5000, 1000), (2, 2, 16, 64, 96, 97, 70)]
    for L, H, D, d, F, V, CAP in shapes:
        w, k, v, x = random_step(L, 1, H, D, d, F, V, CAP, dtype, "cuda", seed=CAP)
        for pos in (0, 37, CAP - 1):
            assert_step_equals_the_reference("gluon", w, k, v, x, pos, tol)


@pytest.mark.parametrize("args, says", [
    (["--ctx", "4096", "--capacity", "100"], "--capacity 100 is below --ctx 4096: the cache must hold the context"),
    (["--ctx", "4096", "--capacity", "0"], "--capacity 0 is below --ctx 4096"),
    (["--variants", "stages"], "--variants 'stages': write space-separated KEY=VALUE pairs")])
def test_bench_llama_step_options_are_checked_before_any_work(args, says):
    with pytest.raises(SystemExit) as exit_:
        bench_llama_step.parse(args)
    assert says in str(exit_.value.code)
