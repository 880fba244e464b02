"""TinT simulator benchmark: a GPT-2-shaped auxiliary model against its reference update and simulator.

    python -m scripts.bench_tint                          # 124M GPT-2 shape, T = 1024, n_train = 512, fp32
    python -m scripts.bench_tint --dtype fp64 --json out.json

Reports parameters (the simulator's, our exact formula's, the paper's Table 1 formula), peak memory
(CUDA only) and the median time of the auxiliary forward, the reference update (model.tint.tint_reference)
and the simulator forward, plus the largest logit difference between simulator and reference.
"""
import argparse
import json
import time

import torch

from model.gpt import GPT, GPTConfig
from model.tint import TinT, paper_param_formula, tint_param_formula, tint_reference


def benchmark(n_embd=768, n_layer=12, n_head=12, seq_len=1024, frac=0.5, batch_size=1, reps=3, lr=1e-4,
              dtype=torch.float32, device=None):
    """Simulator vs auxiliary forward (and the reference update) for a GPT-2-shaped auxiliary model:
    parameters, peak memory and time. Returns a dict (also printed as a table)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=50304, block_size=seq_len, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                    norm="layernorm", mlp="gelu", pos="learned", bias=True)
    aux = GPT(cfg).to(device, dtype).eval()
    idx = torch.randint(0, 50257, (batch_size, seq_len), device=device)
    n_train = int(frac * seq_len)

    def timed(fn):
        times, out = [], None
        for _ in range(reps + 1):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return out, sorted(times[1:])[len(times[1:]) // 2]

    def peak(fn):
        if not cuda:
            return fn(), float("nan")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        return out, (torch.cuda.max_memory_allocated() - base) / 2 ** 30

    res = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "dtype": str(dtype), "T": seq_len,
           "n_train": n_train, "batch": batch_size, "aux_params": aux.num_params()}
    with torch.no_grad():
        aux_logits, res["aux_forward_s"] = timed(lambda: aux(idx)[0])
        _, res["aux_forward_peak_GiB"] = peak(lambda: aux(idx)[0])
        ref, res["tint_ref_s"] = timed(lambda: tint_reference(aux, idx, n_train, lr=lr))
        _, res["tint_ref_peak_GiB"] = peak(lambda: tint_reference(aux, idx, n_train, lr=lr))
        t0 = time.perf_counter()
        mem0 = torch.cuda.memory_allocated() if cuda else 0
        sim = TinT.from_model(aux, lr=lr)
        res["sim_build_s"] = time.perf_counter() - t0
        res["sim_weights_GiB"] = ((torch.cuda.memory_allocated() - mem0) / 2 ** 30) if cuda else float("nan")
        res["sim_params"] = sim.num_params()
        res["sim_params_formula"] = tint_param_formula(sim.cfg)["total"]
        res["paper_formula_params"] = int(paper_param_formula(n_embd, n_layer, seq_len, H_sim=sim.cfg.H_L,
                                                              K=sim.cfg.K, D_sim=sim.cfg.D_s)["total"])
        out, res["sim_forward_s"] = timed(lambda: sim(idx, n_train))
        _, res["sim_forward_peak_GiB"] = peak(lambda: sim(idx, n_train))
        res["max_abs_logit_diff_sim_vs_ref"] = (out - ref).abs().max().item()
        res["max_abs_logit_change_ref_vs_vanilla"] = (ref - aux_logits[:, n_train - 1:-1]).abs().max().item()
    res["sim_over_aux_forward_time"] = res["sim_forward_s"] / res["aux_forward_s"]
    res["ref_over_aux_forward_time"] = res["tint_ref_s"] / res["aux_forward_s"]
    res["sim_over_ref_time"] = res["sim_forward_s"] / res["tint_ref_s"]
    for k, v in res.items():
        print(f"{k:<36} {v:.4g}" if isinstance(v, float) else f"{k:<36} {v}")
    return res


def main():
    ap = argparse.ArgumentParser(description="TinT simulator benchmark (GPT-2-shaped auxiliary model)")
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", choices=["fp32", "fp64"], default="fp32")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args()
    r = benchmark(a.n_embd, a.n_layer, a.n_head, a.seq_len, batch_size=a.batch_size, reps=a.reps,
                  dtype=torch.float64 if a.dtype == "fp64" else torch.float32)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
