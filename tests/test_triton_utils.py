"""kernels/triton_utils.py: the kernels run under TRITON_INTERPRET=1 in any process (not only under pytest,
whose conftest only sets the variable), and every kernel package imports and runs its torch paths without
Triton installed. Both in fresh subprocesses, as a user would run them."""
import os
import subprocess
import sys

import pytest
import torch

from kernels.triton_utils import (at_least_fp32, brief_operator_str, inductor_formats_fallbacks_eagerly,
                                  padded_head_dim, triton)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code, **env):
    """`python -c code` from the repository root with extra environment variables; its stdout."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_helpers():
    assert [padded_head_dim(d) for d in (1, 16, 17, 64, 96, 128)] == [16, 16, 32, 64, 128, 128]
    assert at_least_fp32(torch.bfloat16) == torch.float32 and at_least_fp32(torch.float64) == torch.float64


class DeepIR:
    """An inductor IR node whose str() would walk a whole graph: any call of it fails."""
    def __str__(self):
        raise AssertionError("str() of an IR argument")
    __repr__ = __str__

    def get_size(self):
        return (8, 50304)

    def get_dtype(self):
        return torch.bfloat16


def test_inductor_operator_messages_never_print_ir_trees():
    text = brief_operator_str("fused::cross_entropy_grad", [DeepIR(), [DeepIR(), 3], None], {"eps": 1e-5})
    assert text.splitlines() == ["  target: fused::cross_entropy_grad",
                                 "  args[0]: DeepIR(size=[8, 50304], dtype=torch.bfloat16)",
                                 "  args[1]: [DeepIR(size=[8, 50304], dtype=torch.bfloat16), 3]",
                                 "  args[2]: None", "  kwargs: {eps: 1e-05}"]
    assert inductor_formats_fallbacks_eagerly("2.11.0+cu130") and inductor_formats_fallbacks_eagerly("2.12.1")
    assert not inductor_formats_fallbacks_eagerly("2.13.0")
    from torch._inductor.exc import OperatorIssue   # bounded exactly where this torch formats eagerly
    bounded = triton is not None and inductor_formats_fallbacks_eagerly()
    assert (OperatorIssue.operator_str is brief_operator_str) == bounded


# bf16 tiles reach tl.dot (FoX) and fp32 -> bf16 casts (both outputs); FoX's loops over key tiles and
# CASTLE's step loop have bounds computed in the kernel (numpy >= 2.4 refuses their int())
INTERPRETED = """
import torch, torch.nn.functional as F
from kernels.castle import castle_attn
from kernels.forgetting import forgetting_attn
torch.manual_seed(0)
xs = [torch.randn(1, 2, 37, 32, dtype=torch.float64) for _ in range(6)]
ref = castle_attn(*xs, window=5, impl="torch")
out = castle_attn(*[x.bfloat16() for x in xs], window=5, impl="triton")
print("castle", ((out.double() - ref).norm() / ref.norm()).item())
q, k, v = (torch.randn(1, 2, 45, 32, dtype=torch.float64) for _ in range(3))
log_f = F.logsigmoid(3 * torch.randn(1, 2, 45))
ref = forgetting_attn(q, k, v, log_f, impl="torch")
out = forgetting_attn(q.bfloat16(), k.bfloat16(), v.bfloat16(), log_f, impl="triton")
print("fox", ((out.double() - ref).norm() / ref.norm()).item())
"""


@pytest.mark.slow
def test_interpreter_outside_pytest():
    """TRITON_INTERPRET=1 python -c '...impl="triton"...' gives the reference's output within bf16 rounding."""
    errs = dict(line.split() for line in run_python(INTERPRETED, TRITON_INTERPRET="1").splitlines())
    assert float(errs["castle"]) < 1e-2 and float(errs["fox"]) < 1e-2, errs


NO_TRITON = """
import sys
class NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("no triton here")
sys.meta_path.insert(0, NoTriton())
import torch, torch.nn.functional as F
from kernels.castle import castle_attn, castle_decode, castle_prefill
from kernels.forgetting import forgetting_attn
from kernels.tree import tree_decode
from model.gpt import GPT, GPTConfig
assert "triton" not in sys.modules
xs = [torch.randn(1, 2, 9, 8) for _ in range(6)]
assert torch.allclose(castle_attn(*xs, impl="blockwise"), castle_attn(*xs, impl="auto"), atol=1e-5)
out, cache = castle_prefill(*[x[..., :8, :] for x in xs], window=3)
castle_decode(cache, *[x[..., 8:, :] for x in xs])
forgetting_attn(*xs[:3], F.logsigmoid(torch.randn(1, 2, 9)))
tree_decode(xs[0], xs[1], xs[2])
model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16, attention="castle"))
model.generate(torch.zeros(1, 3, dtype=torch.long), 4)
one = [x[..., 8:, :] for x in xs]
for call in (lambda: castle_attn(*xs, impl="triton"), lambda: castle_decode(cache, *one, impl="triton"),
             lambda: forgetting_attn(*xs[:3], torch.zeros(1, 2, 9), impl="triton")):
    try:
        call()
    except RuntimeError as e:
        assert "pip install triton" in str(e), e
    else:
        raise AssertionError("impl='triton' ran without triton")
print("ok")
"""


@pytest.mark.slow
def test_torch_paths_without_triton():
    """Without the triton package every kernel package imports, the torch paths and the model run, and
    impl="triton" is refused with the package to install."""
    assert run_python(NO_TRITON).strip() == "ok"
