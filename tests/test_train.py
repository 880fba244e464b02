"""train.py end to end on the bundled corpus: exact resume, torchrun (gloo) == gradient
accumulation, NaN stop, clear config errors; then sample.py and eval.py on the checkpoint."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from train import lr_at

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["size=tiny", "model.n_layer=2", "model.n_embd=64", "model.n_head=4", "model.head_dim=16",
        "train.seq_len=32", "train.micro_batch_size=4", "train.log_interval=1",
        "train.eval_interval=1000", "train.eval_tokens=256", "train.sample_tokens=0",
        "optim.warmup_steps=2", "WANDB_MODE=disabled"]


def run(script, args, *, torchrun=0, check=True):
    """An entry point (`train.py`) or a module (`scripts.bench_train`, run with -m) in a subprocess,
    under torchrun with `torchrun` processes."""
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    args = [a for a in args if not a.startswith("WANDB_MODE")]
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc_per_node={torchrun}"] if torchrun else [sys.executable])
    target = [script] if script.endswith(".py") else ["-m", script]
    proc = subprocess.run(launcher + target + args, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def train_losses(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("run"))
    run("train.py", TINY + [f"train.out_dir={out}", "train.max_steps=6", "train.ckpt_interval=3",
                            "train.keep_last=5", "train.global_batch_tokens=256", "train.eval_interval=3"])
    return out


def test_training_writes_checkpoints_and_metrics(trained_run):
    assert sorted(os.listdir(trained_run)) == ["ckpt_3.pt", "ckpt_6.pt", "config.yaml", "loss.png", "metrics.jsonl"]
    losses = train_losses(trained_run)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    with open(os.path.join(trained_run, "metrics.jsonl")) as f:
        assert any("val_loss" in json.loads(line) for line in f)


def test_resume_reproduces_uninterrupted_losses_exactly(trained_run, tmp_path):
    """Drop the last checkpoint, resume from step 3: steps 4..6 give bit-identical losses."""
    out = str(tmp_path / "resumed")
    shutil.copytree(trained_run, out)
    os.remove(os.path.join(out, "ckpt_6.pt"))
    os.remove(os.path.join(out, "metrics.jsonl"))
    proc = run("train.py", TINY + [f"train.out_dir={out}", "train.max_steps=6", "train.ckpt_interval=3",
                                   "train.keep_last=5", "train.global_batch_tokens=256",
                                   "train.eval_interval=3"])
    assert "resuming at step 3" in proc.stdout
    resumed, full = train_losses(out), train_losses(trained_run)
    assert sorted(resumed) == [4, 5, 6]
    assert all(resumed[s] == full[s] for s in resumed), (resumed, full)


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_fsdp_matches_single_process_and_resumes(tmp_path):
    """FSDP2 on 2 ranks, with every fused option on (their torch references on CPU: the packed SwiGLU's weight
    concatenation, the norms' residual adds, the chunked loss, on sharded parameters): same losses as one
    unfused process; bit-identical ones with every block recomputed (activation checkpointing: the FSDP
    units are the blocks, the recomputed forward sits inside them); its checkpoint resumes there, unfused,
    and samples."""
    common = TINY + ["train.max_steps=4", "train.global_batch_tokens=256", "train.ckpt_interval=2",
                     "train.keep_last=5"]
    fsdp_args = common + ["model.fused_loss=chunked", "model.fused_loss_chunk=48", "model.fused_norm=true",
                          "model.fused_swiglu=triton", "train.parallel=fsdp", "train.sample_tokens=4"]
    run("train.py", common + [f"train.out_dir={tmp_path / 'one'}"])
    run("train.py", fsdp_args + [f"train.out_dir={tmp_path / 'fsdp'}"], torchrun=2)
    full = run("train.py", fsdp_args + [f"train.out_dir={tmp_path / 'full'}", "train.activation_checkpointing=full"],
               torchrun=2)
    one, fsdp = train_losses(tmp_path / "one"), train_losses(tmp_path / "fsdp")
    assert sorted(one) == sorted(fsdp) == [1, 2, 3, 4]
    for step in one:
        assert abs(one[step] - fsdp[step]) < 1e-4 * abs(one[step]), (one, fsdp)
    assert "2 rank(s)" in full.stdout and "activation checkpointing full (2 of 2 blocks recomputed)" in full.stdout
    assert train_losses(tmp_path / "full") == fsdp
    os.remove(tmp_path / "fsdp" / "ckpt_4.pt")       # resume the FSDP run from step 2 in one process
    os.remove(tmp_path / "fsdp" / "metrics.jsonl")
    run("train.py", common + [f"train.out_dir={tmp_path / 'fsdp'}"])
    resumed = train_losses(tmp_path / "fsdp")
    assert sorted(resumed) == [3, 4]
    for step in resumed:
        assert abs(resumed[step] - one[step]) < 1e-4 * abs(one[step]), (resumed, one)


def test_sample_script_streams_text(trained_run):
    proc = run("sample.py", [f"ckpt={trained_run}", "prompt=The river", "max_new_tokens=12",
                             "temperature=0"])
    assert "The river" in proc.stdout and len(proc.stdout.split("---")[-1].strip()) > len("The river")


def test_eval_script_writes_results(trained_run):
    run("eval.py", [f"ckpt={trained_run}", "eval.val_tokens=512", "eval.batch_size=2"])
    with open(os.path.join(trained_run, "results.json")) as f:
        results = json.load(f)
    assert results["attention"] == "baseline"
    assert 0 < results["heldout"]["loss"] < 11.5 and results["heldout"]["perplexity"] > 1


@pytest.mark.slow
def test_checkpoint_from_another_model_is_refused(trained_run, tmp_path):
    out = str(tmp_path / "other")
    shutil.copytree(trained_run, out)
    proc = run("train.py", TINY + [f"train.out_dir={out}", "model.n_layer=3", "train.max_steps=8",
                                   "train.global_batch_tokens=256"], check=False)
    assert proc.returncode != 0 and "another model" in proc.stderr and "n_layer" in proc.stderr


@pytest.mark.slow
def test_indivisible_batch_is_a_clear_error(tmp_path):
    proc = run("train.py", TINY + [f"train.out_dir={tmp_path}", "train.global_batch_tokens=100"],
               check=False)
    assert proc.returncode != 0 and "global_batch_tokens" in proc.stderr


@pytest.mark.slow
def test_nan_loss_stops_and_names_the_step(tmp_path):
    proc = run("train.py", TINY + [f"train.out_dir={tmp_path}", "optim.lr=1e12", "optim.warmup_steps=1",
                                   "optim.grad_clip=1e30", "train.max_steps=30",
                                   "train.global_batch_tokens=128"], check=False)
    assert proc.returncode != 0 and "non-finite" in proc.stderr and "at step" in proc.stderr


@pytest.mark.slow
def test_training_benchmark_script_runs():
    # --warmup 0: uncompiled, there is nothing to warm up (a step of the 160M model costs seconds on CPU)
    proc = run("scripts.bench_train", ["--device", "cpu", "--models", "tiny", "castle_paper_S", "--steps", "1",
                                          "--warmup", "0", "--batch-tokens", "16", "--seq-len", "16", "--no-compile",
                                          "--profile", "3", "--sdpa-backend", "math"])
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| tiny") or line.startswith("| castle")]
    assert len(rows) == 2 and "160.7M" in rows[1]
    assert proc.stdout.count("graph breaks 0, CPU ops of 2 steps") == 2 and "aten::mm" in proc.stdout


def test_training_benchmark_rounds():
    """--rounds: both models stay resident and are timed in alternation; rows add the range of tokens/s and
    the ratio to the first model (exactly 1 for the first). Two tiny models (the second with an override of
    its own): the --profile run measures a paper-sized one."""
    proc = run("scripts.bench_train", ["--device", "cpu", "--models", "tiny", "tiny:model=castle", "--steps", "1",
                                          "--warmup", "1", "--batch-tokens", "16", "--seq-len", "16", "--no-compile",
                                          "--rounds", "3", "--sdpa-backend", "math"])
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| tiny")]
    assert len(rows) == 2 and all(len(r) == 8 for r in rows)
    assert rows[0][7].strip() == "1.000x (1.000 - 1.000)" and rows[1][7].strip().endswith(")")
    lo, hi = (float(x.replace(",", "")) for x in rows[1][6].split(" - "))
    assert 0 < lo <= float(rows[1][3].replace(",", "")) <= hi


def test_training_benchmark_models_take_overrides_of_their_own():
    from scripts.bench_train import model_config
    config, T = model_config("compare_XS:model=castle,model.castle_silu=false", None, ["model.n_layer=3"])
    assert (config.attention, config.castle_silu, config.n_layer, T) == ("castle", False, 3, 2048)
    plain, _ = model_config("compare_XS", None)
    assert plain.attention != "castle" and plain.castle_silu and plain.n_layer == 6


def test_training_benchmark_refuses_fp8_off_a_float8_gpu():
    """train.fp8=true in a model's overrides converts it as train.py would, after the same checks."""
    proc = run("scripts.bench_train", ["--device", "cpu", "--models", "tiny:train.fp8=true", "--steps", "1",
                                          "--warmup", "1", "--batch-tokens", "16", "--seq-len", "16", "--no-compile"],
               check=False)
    assert proc.returncode != 0 and "train.fp8=true runs float8 matmuls, which need a CUDA GPU" in proc.stderr


@pytest.mark.distributed
def test_scaling_benchmark_script_runs(tmp_path):
    """scripts.bench_scaling under gloo: 1 and 2 ranks at one global batch follow the same curve. Its runs
    are train.py's DDP check: 2 ranks x 1 micro-batch give the losses of one process accumulating 2."""
    args = ["--gpus", "1", "2", "--parallel", "ddp", "--steps", "3", "--skip", "1", "--out", str(tmp_path), "--"]
    proc = run("scripts.bench_scaling", args + [a for a in TINY if not a.startswith("train.log")])
    rows = {line.split("|")[1].strip(): line.split("|") for line in proc.stdout.splitlines()
            if line.startswith("| 1 GPU") or line.startswith("| 2 GPUs")}
    assert set(rows) == {"1 GPU", "2 GPUs DDP"}
    assert float(rows["2 GPUs DDP"][6]) < 1e-3          # max loss difference from the 1-GPU curve
    assert (tmp_path / "loss.png").stat().st_size > 0
    one, two = train_losses(tmp_path / "ddp_1"), train_losses(tmp_path / "ddp_2")
    assert "grad accumulation 2" in proc.stdout and sorted(one) == sorted(two) == [1, 2, 3]
    for step in one:
        assert abs(one[step] - two[step]) < 1e-4 * abs(one[step]), (one, two)


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_and_resume_continues(tmp_path):
    """Ctrl-C saves the step reached; a resume with only train options continues it, the model and data
    settings taken from the checkpoint."""
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    args = [a for a in TINY if not a.startswith("WANDB_MODE")]
    proc = subprocess.Popen([sys.executable, "train.py"] + args + [
        f"train.out_dir={tmp_path}", "train.max_steps=100000", "train.global_batch_tokens=128",
        "train.ckpt_interval=100000"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.time() < deadline:
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted at step" in out and "saved" in out
    saved = [f for f in os.listdir(tmp_path) if f.startswith("ckpt_")]
    assert len(saved) == 1
    step = int(saved[0][5:-3])
    assert step >= 2
    # continuing needs no model or data override repeated: they come from the checkpoint
    train_only = [a for a in TINY if not a.startswith(("model.", "size="))]
    resumed = run("train.py", train_only + [f"train.out_dir={tmp_path}", f"train.max_steps={step + 1}",
                                            "train.global_batch_tokens=128"])
    assert "model: llama (baseline attention)" in resumed.stdout
    assert f"resuming at step {step}" in resumed.stdout and "with its model and data settings" in resumed.stdout
    assert sorted(train_losses(tmp_path)) == list(range(1, step + 2))


def test_streamed_text_equals_decoded_text_for_json_tokenizer(capsys):
    """Streaming never prints a JSON escape or UTF-8 character before it is complete."""
    from data.tokenizer import get_tokenizer
    from evaluation.samples import stream_text

    tok = get_tokenizer("gpt2_json")
    ids = tok.encode_ordinary('He said "hi"\nthen left. café ✓ 😀 end')

    class Replay:
        def generate_stream(self, idx, *args, **kwargs):
            yield from (torch.tensor([i]) for i in ids)

    text = stream_text(Replay(), tok, [tok.eot_token], "cpu", max_new_tokens=len(ids), temperature=0)
    assert text == 'He said "hi"\nthen left. café ✓ 😀 end'
    assert capsys.readouterr().out == text + "\n"


def test_lr_schedule_warms_up_from_zero_then_cosine_to_the_floor():
    """fox.md §3.2: lr(0) = 0, linear warmup to the peak, cosine down to min_ratio * peak, then flat."""
    lr, warmup, max_steps, floor = 1e-3, 10, 110, 0.1
    at = [lr_at(s, max_steps, warmup, lr, floor) for s in range(150)]
    assert at[0] == 0 and at[5] == pytest.approx(lr / 2) and at[warmup] == pytest.approx(lr)
    assert at[60] == pytest.approx(lr * (1 + floor) / 2)          # half-way down the cosine
    assert at[max_steps] == pytest.approx(lr * floor) and at[149] == pytest.approx(lr * floor)
    assert all(a >= b for a, b in zip(at[warmup:], at[warmup + 1:]))


@pytest.mark.slow
def test_a_mix_logs_its_realised_proportions(tmp_path):
    """data.mix through train.py: every logged record carries the shares read so far, near the weights."""
    text = open(os.path.join(ROOT, "data", "sample", "night_and_day.txt"), encoding="utf-8").read()
    folders = []
    for i, part in enumerate((text[:200_000], text[200_000:400_000])):
        (tmp_path / f"{i}.txt").write_text(part, encoding="utf-8")
        run("data.prepare_text", ["--source", str(tmp_path / f"{i}.txt"), "--out", str(tmp_path / f"d{i}"),
                                  "--val-tokens", "2000"])
        folders.append(str(tmp_path / f"d{i}"))
    mix = "data.mix=[{dir:%s,weight:3},{dir:%s,weight:1}]" % tuple(folders)
    run("train.py", TINY + ["data=mix", mix, f"train.out_dir={tmp_path / 'run'}", "train.max_steps=5",
                            "train.ckpt_interval=100", "data.val_tokens=1000"])
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        shares = [json.loads(line)["data_mix"] for line in f if '"loss"' in line]
    assert len(shares) == 5
    assert shares[-1] == {folders[0]: 0.75, folders[1]: 0.25}   # 5 steps x 4 sequences: 15 and 5
