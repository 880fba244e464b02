"""Registers and spills of the CASTLE Triton kernels, compiled offline for an H100 (sm_90a); no GPU needed.

    python -m scripts.castle_regs                       # default tiles of each kernel, D = 64 and 128, bf16
    python -m scripts.castle_regs --D 64 --all          # every tile config bench_castle --sweep times
    python -m scripts.castle_regs --tiles 32/32/4,64/32/4 --kernels bwd --variants split,fused

Backward variants are kernels/castle/triton.py's BWD_VARIANTS (a variant may launch several kernels: one row
each).

Each kernel is compiled by triton.compile (ASTSource, GPUTarget("cuda", 90, 64)) to PTX, with the
specialisation a real launch at B=8 H=16 L=2048 gets (16-byte aligned pointers, ints divisible by 16),
then `ptxas -arch=sm_90a -v` reads registers per thread, spill stores / loads (bytes per thread) and
shared memory (Triton's dynamic allocation). 255 registers with spills means ptxas ran out: the kernel keeps
too many tiles live.
Rows are printed as they finish and again as a markdown table.

Tiles are m/n/warps[/stages]: m = query rows, n = key rows. For the backward the tile is the backward's
(cfg.m_bwd, cfg.n_bwd, cfg.warps_bwd, cfg.stages_bwd); for the forward the forward's (stages_fwd).
"""
import argparse
import concurrent.futures
import dataclasses
import multiprocessing
import os
import re
import shutil
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # we want the GPU code path of the kernels

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels.castle import triton as castle  # noqa: E402
from kernels.triton_utils import padded_head_dim  # noqa: E402

TARGET = GPUTarget("cuda", 90, 64)
DTYPES = {"bf16": (torch.bfloat16, "bf16", tl.bfloat16), "fp32": (torch.float32, "fp32", tl.float32)}
FP32_PTRS = {"LSE", "DELTA", "U", "DQC", "DKU", "DVU", "E"}  # fp32 buffers; SYNC int32, the rest input dtype
# upper-case ints; the other upper-case args are pointers
INT_ARGS = {"H", "L", "NR", "NC", "NBH", "NSLOTS", "W", "HEAD_GROUP"}
FP_SCALARS = {"scale"}
L = 2048  # the launch's sequence length: every tile in bounds, as the kernels specialise for it


def _ptxas():
    return os.environ.get("PTXAS") or shutil.which("ptxas") or "/usr/local/bin/ptxas"


def signature(kernel, constexprs, dtype_name):
    """Triton signature and attrs for a launch: pointers and ints 16-divisible (as at L = 2048)."""
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in FP_SCALARS:
            sig[name] = "fp32"
        elif name.isupper() and name not in INT_ARGS:
            sig[name] = "*i32" if name == "SYNC" else "*fp32" if name in FP32_PTRS else f"*{dtype_name}"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def kernels_for(cfg, D, dtype, variants):
    """(label, jit function, constexprs, num_warps, num_stages) of the forward and the backward kernel(s)."""
    torch_dt, _, tl_dt = DTYPES[dtype]
    block_d = padded_head_dim(D)
    scale = D ** -0.5
    # the launch's num_stages (1): cfg.stages_fwd reaches the kernel as its STAGES constexpr
    fwd_consts = castle.fwd_constexprs(D, block_d, cfg, tl_dt, scale, L)
    fwd = ("fwd", castle.castle_fwd_kernel, fwd_consts, cfg.warps_fwd, 1)
    out = {"fwd": [fwd], "bwd": []}
    for v in variants:
        for label, fn, consts in castle.bwd_kernels(v, D, block_d, cfg, tl_dt, scale, L):
            # the launch's num_stages (1): cfg.stages_bwd reaches the kernel as its SIGMA_STAGES constexpr
            out["bwd"].append((f"bwd {v}: {label}", fn, consts, cfg.warps_bwd, 1))
    return out


JOBS = []  # (D, tile, label, fn, constexprs, warps, stages, dtype); forked workers read it by index


def compile_one(i):
    _, _, label, fn, consts, warps, stages, dtype = JOBS[i]
    sig, attrs = signature(fn, consts, DTYPES[dtype][1])
    try:
        src = ASTSource(fn, sig, constexprs=consts, attrs=attrs)
        kernel = triton.compile(src, target=TARGET, options=dict(num_warps=warps, num_stages=stages))
    except Exception as e:  # noqa: BLE001 (a config that does not compile is reported, not fatal)
        return dict(error=repr(e).splitlines()[0][:100])
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(kernel.asm["ptx"])
        log = subprocess.run([_ptxas(), "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "k.o")],
                             capture_output=True, text=True).stderr
    num = lambda pat: int(m.group(1)) if (m := re.search(pat, log)) else -1  # noqa: E731
    return dict(regs=num(r"Used (\d+) registers"), spill_st=num(r"(\d+) bytes spill stores"),
                spill_ld=num(r"(\d+) bytes spill loads"), smem=kernel.metadata.shared)


def parse_tile(s):
    parts = [int(x) for x in s.split("/")]
    return (*parts, 1) if len(parts) == 3 else tuple(parts)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--D", default="64,128", help="comma list of head dims")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--kernels", default="fwd,bwd", help="fwd, bwd or both")
    p.add_argument("--variants", default=",".join(castle.BWD_VARIANTS), help="backward variants")
    p.add_argument("--tiles", default=None, help="backward (or forward) tiles m/n/warps[/stages], comma list; "
                   "default: each kernel's default tiles")
    p.add_argument("--all", action="store_true", help="the tiles scripts/bench_castle.py --sweep times")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    variants = args.variants.split(",")
    which = args.kernels.split(",")

    jobs = JOBS
    for D in (int(d) for d in args.D.split(",")):
        default_d, torch_dt = padded_head_dim(D), DTYPES[args.dtype][0]
        default = castle.default_config(default_d, torch_dt)
        d = 64 if D <= 64 else 128
        tiles = lambda cfg: [(cfg.m_bwd, cfg.n_bwd, cfg.warps_bwd, cfg.stages_bwd)]  # noqa: E731
        if args.all:
            from scripts import bench_castle
            fwd_tiles = [(m, n, w, default.stages_fwd) for m, n, w in bench_castle.FWD_TILES[d]]
            bwd_tiles = bench_castle.BWD_TILES[d]
        elif args.tiles:
            fwd_tiles = bwd_tiles = [parse_tile(t) for t in args.tiles.split(",")]
        else:  # each kernel's own default tiles
            fwd_tiles, bwd_tiles = [(default.m_fwd, default.n_fwd, default.warps_fwd, default.stages_fwd)], None
        if "fwd" in which:
            for m, n, w, st in fwd_tiles:
                cfg = dataclasses.replace(default, m_fwd=m, n_fwd=n, warps_fwd=w, stages_fwd=st)
                for job in kernels_for(cfg, D, args.dtype, [])["fwd"]:
                    jobs.append((D, f"{m}/{n}/{w}/{st}", *job, args.dtype))
        if "bwd" in which:
            for v in variants:
                for m, n, w, st in bwd_tiles or tiles(castle.default_config(default_d, torch_dt, v)):
                    cfg = dataclasses.replace(default, m_bwd=m, n_bwd=n, warps_bwd=w, stages_bwd=st)
                    for job in kernels_for(cfg, D, args.dtype, [v])["bwd"]:
                        jobs.append((D, f"{m}/{n}/{w}/{st}", *job, args.dtype))

    rows = []
    ctx = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
        for (D, tile, label, *_), res in zip(jobs, pool.map(compile_one, range(len(jobs)))):
            row = (label, D, tile, *(res.get(k, "") for k in ("regs", "spill_st", "spill_ld", "smem")),
                   res.get("error", ""))
            rows.append(row)
            print(row, flush=True)
    header = ["kernel", "D", "m/n/warps/stages", "regs", "spill st B", "spill ld B", "smem B", "error"]
    print("\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                    + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]))


if __name__ == "__main__":
    main()
