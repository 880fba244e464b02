"""compute-sanitizer memcheck of the CASTLE kernels on the layouts a model gives them: RoPE'd heads in
(B, L, H, D) storage, plain heads as views of the fused projection; forward and backward, bf16, with and
without a window. Run it after every change to the kernels:

    compute-sanitizer --tool memcheck --error-exitcode 1 python -m scripts.sanitize_castle
"""
import torch

from kernels.castle import castle_attn


def main():
    for L, window in ((333, None), (2048, None), (5000, 512)):
        fused = torch.randn(2, L, 6, 3, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        views = fused.permute(2, 0, 3, 1, 4).unbind(0)
        # q^C, k^C, q^U, k^U as RoPE leaves them (new tensors in the projection's order), v^C, v^U as views
        xs = [v * 1.0 if i in (0, 1, 3, 4) else v for i, v in enumerate(views)]
        out = castle_attn(*xs, window=window)
        out.float().square().sum().backward()
        torch.cuda.synchronize()
        print(f"L {L} window {window}: out strides {out.stride()}, gradients finite: "
              f"{torch.isfinite(fused.grad).all().item()}", flush=True)


if __name__ == "__main__":
    main()
