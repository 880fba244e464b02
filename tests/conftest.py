"""Shared test setup.

Triton kernels run on CPU through the interpreter; TRITON_INTERPRET must be set before Triton is
first imported, so it is decided here, before any test module imports a kernel.
"""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture
def nan_filled_empty():
    """torch.empty / empty_like / new_empty return NaN-filled floats (deterministic mode), so outputs
    the kernels leave unwritten show up as NaN; ops with no deterministic version only warn."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.utils.deterministic.fill_uninitialized_memory = fill


@pytest.fixture(autouse=True, scope="session")
def _fix_triton_interpreter():
    """Work around three Triton 3.6 interpreter bugs for every CPU test of a Triton kernel (the
    compiled GPU path is unaffected):

    - numpy >= 2.4 refuses int() of a 1-element array, which the interpreter uses for
      runtime loop bounds (`range(lo, hi)` with lo, hi computed in the kernel);
    - tl.dot on bf16 multiplies the raw uint16 bit patterns;
    - fp32 -> bf16 casts truncate instead of rounding to nearest even.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    import triton.language as tl
    import triton.runtime.interpreter as interp

    patch_tensor = interp._patch_lang_tensor
    builder = interp.InterpreterBuilder
    create_dot, cast_impl = builder.create_dot, builder.cast_impl

    def _patch_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def _create_dot(self, a, b, d, *args):
        up = lambda x: cast_impl(self, x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x
        return create_dot(self, up(a), up(b), d, *args)

    def _cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(src.data).to(torch.bfloat16).view(torch.uint16).numpy()
            return interp.TensorHandle(bits, tl.bfloat16)
        return cast_impl(self, src, dst_type)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interp, "_patch_lang_tensor", _patch_lang_tensor)
        mp.setattr(builder, "create_dot", _create_dot)
        mp.setattr(builder, "cast_impl", _cast_impl)
        yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
