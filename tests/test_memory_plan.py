"""The memory plan (model/memory_plan.py) against what PyTorch really allocates on CPU: the state
exactly, what a forward keeps for the backward and a whole step's peak within 15% (every variant,
fp32 and bf16 autocast, every activation-checkpointing mode); the error on a plan that cannot fit;
train.py printing the plan and an ETA."""
import json
import os

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from model.gpt import GPT, GPTConfig
from model.memory_plan import GiB, MemoryPlanError, check_fits, describe, memory_plan
from scripts.bench_memory import cpu_peak_bytes, state_bytes
from tests.test_train import TINY, run

VARIANTS = {
    "baseline": {},
    "fox_llama": dict(attention="fox"),
    "fox_pro": dict(attention="fox", qk_norm=True, kv_shift=True, output_gate=True, output_norm=True, pos="none",
                    mlp_ratio=3.5),
    "transformer_pro": dict(qk_norm=True, kv_shift=True, output_gate=True, output_norm=True, pos="none"),
    "castle": dict(attention="castle"),
    "castle_swl": dict(attention="castle_swl", castle_window=8),
    "castle_no_causal_keys": dict(attention="castle", castle_causal_keys=False, castle_silu=False),
    "transformer_swa": dict(attention_window=16),
    "gpt2_block": dict(mlp="gelu", pos="learned", norm="layernorm"),
}
MODES = ("none", "selective", "full")


def tiny_config(variant, T, vocab=256):
    return GPTConfig(vocab_size=vocab, n_layer=4, n_head=4, n_embd=96, block_size=T, **VARIANTS[variant])


def live_bytes_after(fn):
    """Bytes fn allocated and did not free (the CPU allocator's records in the profiler). After a
    forward: what autograd keeps for the backward (activation-checkpointed inputs included, which
    saved-tensor hooks do not see), the logits and the loss."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    live = sum(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    return live, result


def autocast(bf16):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)


def test_state_terms_are_the_real_parameter_gradient_and_adamw_bytes():
    config = tiny_config("fox_pro", 32)
    model = GPT(config)
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-3)
    idx = torch.randint(0, config.vocab_size, (2, 33))
    model(idx[:, :-1], idx[:, 1:])[1].backward()
    opt.step()
    terms = memory_plan(config, micro_batch=2, seq_len=32, autocast=False, device_type="cpu")["terms"]
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)    # noqa: E731
    assert terms["params"] == nbytes(model.parameters())
    assert terms["grads"] == nbytes(p.grad for p in model.parameters())
    assert terms["optimizer"] == nbytes(s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq"))
    sharded = memory_plan(config, micro_batch=2, seq_len=32, world=4, parallel="fsdp", device_type="cpu")["terms"]
    assert sharded["optimizer"] == terms["optimizer"] / 4 and sharded["params"] < terms["params"]
    ddp = memory_plan(config, micro_batch=2, seq_len=32, world=4, parallel="ddp", device_type="cpu")["terms"]
    assert ddp["optimizer"] == terms["optimizer"] and ddp["ddp_buckets"] == terms["params"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_saved_for_backward_matches_the_plan(variant, bf16):
    """Per variant, dtype and checkpointing mode: the bytes a forward leaves allocated within 15% of the
    plan's activations + bf16 weight copies + saved logits; checkpointing lowers them in order."""
    B, T = 3, 48
    config = tiny_config(variant, T)
    kept = {}
    for mode in MODES:
        model = GPT(config)
        model.checkpoint_activations(mode, 2)
        idx = torch.randint(0, config.vocab_size, (B, T + 1))

        def forward():
            with autocast(bf16):
                return model(idx[:, :-1], idx[:, 1:])

        measured, _ = live_bytes_after(forward)
        terms = memory_plan(config, micro_batch=B, seq_len=T, activation_checkpointing=mode, autocast=bf16,
                            device_type="cpu")["terms"]
        planned = terms["activations"] + terms["weight_copies"] + terms["logits_saved"]
        assert planned / measured == pytest.approx(1, abs=0.15), (mode, planned, measured)
        kept[mode] = planned
    assert kept["none"] > kept["selective"] > kept["full"]


@pytest.mark.parametrize("variant,vocab,bf16,mode", [
    ("baseline", 4096, False, "none"), ("fox_pro", 256, True, "full"), ("baseline", 256, True, "full"),
    ("fox_pro", 256, False, "selective"), ("castle", 256, True, "none"), ("castle_swl", 4096, False, "full"),
    ("transformer_swa", 4096, True, "selective")])
def test_step_peak_matches_the_plan(variant, vocab, bf16, mode):
    """A whole step (forward, backward, AdamW) peaks within 15% of the plan (no CUDA context on CPU)."""
    B, T = 3, 64
    config = tiny_config(variant, T, vocab)
    model = GPT(config)
    model.checkpoint_activations(mode, 2)
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-4)

    def step():
        idx = torch.randint(0, vocab, (B, T + 1))
        with autocast(bf16):
            _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()                                  # AdamW's state exists from here on
    measured = state_bytes(model, opt) + cpu_peak_bytes(step)
    plan = memory_plan(config, micro_batch=B, seq_len=T, activation_checkpointing=mode, autocast=bf16,
                       device_type="cpu")
    assert plan["peak"] / measured == pytest.approx(1, abs=0.15)


def test_the_loss_chunk_sets_the_logits_in_flight():
    """On CUDA a chunk of the fused loss holds its bf16 logits, overwritten by their gradient (2 bytes per logit;
    compiled on CPU ~10: fp32 logits and probabilities, the bf16 gradient): half the chunk, half of that term; the
    chunk never exceeds the micro-batch's tokens."""
    config = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=50304, fused_loss="chunked")
    grads = {(chunk, device): memory_plan(GPTConfig(**config, fused_loss_chunk=chunk), micro_batch=8, seq_len=2048,
                                          compiled=True, device_type=device)["terms"]["logits_grads"]
             for chunk in (4096, 8192, 16384, 32768) for device in ("cuda", "cpu")}
    assert grads[8192, "cuda"] == 2 * grads[4096, "cuda"] == 2 * 8192 * 50304
    assert grads[16384, "cuda"] == grads[32768, "cuda"] == 2 * 16384 * 50304
    assert grads[8192, "cpu"] == 10 * 8192 * 50304


def test_a_plan_that_cannot_fit_names_the_settings_to_change():
    config = tiny_config("baseline", 64)
    plan = memory_plan(config, micro_batch=8, seq_len=64, device_type="cuda")
    assert plan["terms"]["context"] == GiB
    small = plan["peak"] * 0.9
    with pytest.raises(MemoryPlanError) as err:
        check_fits(plan, small, "error")
    message = str(err.value)
    for setting in ("train.micro_batch_size", "train.activation_checkpointing", "train.parallel=fsdp",
                    "train.memory_check=warn"):
        assert setting in message
    assert isinstance(err.value, ValueError) and "of 0." in message      # the plan against the device's size
    assert check_fits(plan, small, "warn").startswith("warning: the memory plan needs")
    assert check_fits(plan, small, "off") is None
    assert check_fits(plan, plan["peak"], "error") is None
    sharded = memory_plan(config, micro_batch=8, seq_len=64, world=2, parallel="fsdp",
                          activation_checkpointing="full", device_type="cuda")
    with pytest.raises(MemoryPlanError) as err:
        check_fits(sharded, 1, "error")
    assert "train.micro_batch_size" in str(err.value) and "train.parallel" not in str(err.value)
    assert "train.activation_checkpointing" not in str(err.value)


def test_describe_lists_every_term():
    plan = memory_plan(tiny_config("castle", 64), micro_batch=2, seq_len=64, world=2, device_type="cuda")
    line = describe(plan, 80 * GiB)
    for part in ("memory plan per GPU: params", "grads", "optimizer", "DDP buckets", "bf16 weight copies",
                 "activations", "(2 x 64, checkpointing none)", "logits", "context", "of 80.00 GiB"):
        assert part in line


@pytest.mark.slow
def test_train_prints_the_plan_and_logs_an_eta(tmp_path):
    proc = run("train.py", TINY + [f"train.out_dir={tmp_path}", "train.max_steps=3", "train.memory_check=error"])
    plan_lines = [line for line in proc.stdout.splitlines() if line.startswith("memory plan per GPU:")]
    assert len(plan_lines) == 1 and "(4 x 32, checkpointing none)" in plan_lines[0]
    with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if "loss" in json.loads(line)]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["eta_s"] >= 0 for r in records) and records[-1]["eta_s"] == 0 and records[0]["eta_s"] > 0
    bad = run("train.py", TINY + [f"train.out_dir={tmp_path / 'x'}", "train.memory_check=maybe"], check=False)
    assert bad.returncode == 2 and "train.memory_check=maybe is invalid" in bad.stderr
