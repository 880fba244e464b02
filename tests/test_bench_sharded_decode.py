"""scripts/bench_sharded_decode.py: the cache filling is the real layout (a cache filled from a real
prefill's contents decodes like the prefilled one), and the benchmark runs under torchrun (gloo,
2 CPU processes) and as one process, printing one table row per variant."""
import json
import re

import pytest
import torch
from test_train import run

from model.gpt import GPT
from scripts import bench_sharded_decode as bench

# run(script, args, torchrun=N): a script in a subprocess, under python -m torch.distributed.run

TINY = ["--device", "cpu", "--n-layer", "2", "--n-embd", "32", "--n-head", "4", "--vocab", "97"]


def tiny_args(attention, *extra):
    return bench.parse(TINY + ["--attention", attention, "--window", "5", "--check", "23", *extra])


@pytest.mark.parametrize("attention,pro", [("baseline", False), ("baseline", True), ("fox", False),
                                           ("fox", True), ("castle", False), ("castle_swl", False)])
def test_filled_cache_decodes_like_the_prefilled_one(attention, pro):
    """One process: a cache filled from a real 23-token prefill's contents gives the same logits for
    the next tokens (fp64, same kernels: exact)."""
    args = tiny_args(attention, *(["--pro"] if pro else []))
    torch.manual_seed(0)
    model = GPT(bench.model_config(args, attention)).double().eval()
    with torch.no_grad():
        err, scale = bench.check_fill(model, args, None, torch.device("cpu"))
    assert scale > 0 and err <= 1e-12, err


def test_random_fill_is_position_faithful():
    """Random filling writes ctx positions through store(): lengths, the RoPE position and FoX's
    c_last are those of a cache that has seen ctx tokens, and a decode step continues from there."""
    args = tiny_args("fox", "--pro")
    model = GPT(bench.model_config(args, "fox")).eval()
    cache = model.new_cache(1, 40)
    bench.fill_cache(model, cache, 37, bench.random_source(1, 37, "cpu", torch.float32, seed=3))
    layer = cache.layers[1]
    assert cache.pos == layer.length == layer.n_local == 37
    assert torch.equal(layer.c_last, layer.log_fgate_cumsum[:, :, 36:37])
    assert (layer.log_fgate_cumsum[:, :, 1:37].diff(dim=-1) < 0).all()   # a cumulative log gate
    again = model.new_cache(1, 40)
    bench.fill_cache(model, again, 37, bench.random_source(1, 37, "cpu", torch.float32, seed=3))
    assert torch.equal(again.layers[1].k, layer.k)                      # reproducible
    with torch.no_grad():
        logits, _ = model(torch.zeros(1, 1, dtype=torch.long), cache=cache)
    assert torch.isfinite(logits).all() and layer.length == 38


ROW = re.compile(r"^\| (\d+) \| (\d+) \| ([\w-]+) \| ([\d.]+) \| ([\d.]+) \| (-|[\d.]+) \| (eager|prefill 5) \|")


@pytest.mark.distributed
@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_benchmark_prints_a_row_per_variant(world, tmp_path):
    out = tmp_path / "rows.json"
    proc = run("scripts.bench_sharded_decode",
               TINY + ["--attention", "baseline,fox,castle,castle_swl", "--ctx", "64", "--steps", "2",
                       "--warmup", "1", "--check", "17", "--window", "5", "--prefill-chunk", "5",
                       "--prefill-steps", "2", "--out", str(out)],
               torchrun=world if world > 1 else 0)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"command: torchrun --nproc_per_node={world} -m scripts.bench_sharded_decode")
    for name in ("baseline", "fox", "castle", "castle_swl"):   # the filling check (rank 0 prints)
        assert any(line.startswith(f"check {name}:") and line.endswith(" ok") for line in lines), proc.stdout
    rows = [m.groups() for m in map(ROW.match, lines) if m]
    variants = ["baseline", "fox", "castle", "castle_swl"]
    assert [r[:3] + r[6:] for r in rows] == [(str(world), "64", v, mode) for v in variants
                                             for mode in ("eager", "prefill 5")], proc.stdout
    assert all(float(r[3]) > 0 and float(r[4]) > 0 for r in rows), rows
    assert proc.stdout.count("| ranks | ctx | variant | ms/token | tokens/s | peak GiB |") == 1  # rank 0 only
    saved = json.loads(out.read_text())
    assert saved["world"] == world and len(saved["rows"]) == 8


@pytest.mark.parametrize("args", [["--prefill-chunk", "-1"], ["--prefill-chunk", "8", "--prefill-steps", "0"]])
def test_prefill_options_are_checked_before_any_work(args, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.parse(args)
    assert exit_.value.code == 2 and "give a chunk of tokens (0: no prefill rows)" in capsys.readouterr().err
