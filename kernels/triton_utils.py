"""What every Triton kernel of this package shares: the guarded import, the interpreter, small helpers.

- `triton`, `tl`: the modules, or None where Triton is not installed (CPU-only installs still get the
  torch paths). Kernel modules import them from here and define their @triton.jit functions under
  `if triton is not None:`.
- `interpreting()`: whether Triton runs kernels on the CPU (TRITON_INTERPRET=1). Triton reads the
  variable when a @triton.jit function is defined, so set it before importing any kernel.
- Under the interpreter this module, once imported, works around three bugs of the Triton 3.6
  interpreter (the compiled GPU path has none of them), so that `TRITON_INTERPRET=1` runs the kernels
  right in any process, not only under pytest:
    * numpy >= 2.4 refuses int() of a 1-element array, which the interpreter takes of a tensor used
      as a Python int (a loop bound computed in the kernel: `range(lo, hi)`);
    * tl.dot of bf16 tiles multiplies their raw uint16 bit patterns;
    * fp32 -> bf16 casts truncate instead of rounding to nearest even.
- With torch < 2.13 and Triton installed, it bounds inductor's custom-op diagnostics (brief_operator_str):
  those versions format the "Creating implicit fallback" INFO line even with INFO off, by str() of every
  argument's IR, a DAG printed as a tree (exponential in depth). The chunked loss's custom op, first met
  behind every layer's fused RMSNorm, stalled Baseline-S's compile for minutes. pytorch/pytorch#185951
  made the line lazy.
- `LOG2E`: the kernels' softmaxes run in base 2 (exp2 / log2), with log2(e) folded into the logits.
- `split_keys(keys, S, BLOCK)` (@triton.jit): how split-KV decoding deals a head's filled cache rows over its S
  splits; `deal_keys(keys, S, BLOCK)`: the same on the host, for a launch's grid.
- `padded_head_dim(D)`: the head dim the kernels' tiles take; `at_least_fp32(dtype)`: the dtype
  statistics and torch references compute in.
"""
import os

import torch
from torch.torch_version import TorchVersion

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs still get the torch paths
    triton = tl = None


def interpreting():
    """Whether Triton kernels run on the CPU through the interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def at_least_fp32(dtype):
    """fp32 for 16-bit and fp32 dtypes; fp64 stays fp64 (the tests' exact references)."""
    return torch.promote_types(dtype, torch.float32)


def deal_keys(keys, S, BLOCK):
    """(keys per split, splits) when `keys` rows are dealt over about S splits in whole tiles of BLOCK, as split_keys
    deals them in the kernels; splits that would hold no row are not counted."""
    def cdiv(a, b):
        return -(-a // b)
    per = cdiv(cdiv(keys, S), BLOCK) * BLOCK
    return per, cdiv(keys, per)


def require_triton(what, instead):
    """Raise the error that names the missing package and the way around it."""
    if triton is None:
        raise RuntimeError(f"{what} needs the triton package (pip install triton); {instead}")


def padded_head_dim(D):
    """The head dim of the kernels' tiles: the next power of two, at least 16 (96 -> 128, masked or padded)."""
    return max(16, 1 << (D - 1).bit_length())


def brief_operator_str(target, args, kwargs):
    """Inductor's OperatorIssue.operator_str (its messages about an op it cannot lower), with each IR argument
    shown by its type, size and dtype instead of str() of the whole IR tree behind it."""
    def brief(arg):
        if isinstance(arg, (list, tuple)):
            return "[" + ", ".join(map(brief, arg)) + "]"
        if arg is None or isinstance(arg, (bool, int, float, str, torch.dtype, torch.device)):
            return repr(arg)
        try:
            return f"{type(arg).__name__}(size={list(arg.get_size())}, dtype={arg.get_dtype()})"
        except (AttributeError, NotImplementedError):   # not a tensor-like IR node
            return type(arg).__name__
    lines = [f"target: {target}"] + [f"args[{i}]: {brief(arg)}" for i, arg in enumerate(args)]
    lines += [f"kwargs: {{{', '.join(f'{k}: {brief(v)}' for k, v in kwargs.items())}}}"] if kwargs else []
    return "\n".join("  " + line for line in lines)


def inductor_formats_fallbacks_eagerly(version=torch.__version__):
    """Whether this torch's inductor builds the implicit-fallback log line even when INFO is off."""
    return TorchVersion(version) < "2.13"


if triton is not None and inductor_formats_fallbacks_eagerly():
    from torch._inductor import exc as _inductor_exc

    _inductor_exc.OperatorIssue.operator_str = staticmethod(brief_operator_str)


if triton is not None:
    LOG2E = tl.constexpr(1.4426950408889634)  # softmax runs in base 2; log-sum-exps are stored in log2 units

    @triton.jit
    def split_keys(keys, S, BLOCK):
        """Keys per split of a decode step: the `keys` filled rows of a head dealt over its S splits in whole tiles
        of BLOCK (split s reads rows s * split .. (s + 1) * split - 1 of them). Splits of the cache's capacity
        instead would leave all but the first few empty while the cache is far from full, and every step as slow
        as one over a full cache."""
        return tl.cdiv(tl.cdiv(keys, S), BLOCK) * BLOCK

    def _patch_interpreter():
        """The three work-arounds of the module docstring, installed once into Triton's interpreter."""
        import triton.runtime.interpreter as interp

        builder = interp.InterpreterBuilder
        if getattr(builder, "_attention_lm_patched", False):
            return
        patch_tensor, create_dot, cast_impl = interp._patch_lang_tensor, builder.create_dot, builder.cast_impl

        def _patch_lang_tensor(tensor, scope):
            patch_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        def _create_dot(self, a, b, d, *args):
            up = lambda x: cast_impl(self, x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x  # noqa: E731
            return create_dot(self, up(a), up(b), d, *args)

        def _cast_impl(self, src, dst_type):
            if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
                bits = torch.from_numpy(src.data).to(torch.bfloat16).view(torch.uint16).numpy()
                return interp.TensorHandle(bits, tl.bfloat16)
            return cast_impl(self, src, dst_type)

        interp._patch_lang_tensor = _patch_lang_tensor
        builder.create_dot, builder.cast_impl = _create_dot, _cast_impl
        builder._attention_lm_patched = True

    if interpreting():
        _patch_interpreter()
