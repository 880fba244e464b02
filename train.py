"""Pretrain a GPT whose attention is a config switch.

    python train.py                                   # tiny model on the bundled corpus (CPU ok)
    torchrun --nproc_per_node=8 train.py size=S data=fineweb_edu
    python train.py train.max_steps=1000 model.attention=baseline train.resume=never

One process or many (torchrun: NCCL on GPU, gloo on CPU). Checkpoints go to train.out_dir and
`train.resume=auto` continues exactly where the last one stopped.
"""
import contextlib
import json
import math
import os
import random
import signal
import time

import hydra
import numpy as np
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from data.loader import build_loader
from data.tokenizer import tokenizer_for
from evaluation.heldout import mean_loss
from kernels.sdpa import prefer_sdpa_backend
from model.gpt import (CHECKPOINT_FORMAT, GPT, GPTConfig, checkpoint_files, config_dict,
                       load_checkpoint)
from scripts.plot_runs import plot_runs


# ----------------------------------------------------------------------------- setup

class Dist:
    """Rank, world size and device of this process; a process group when launched by torchrun."""

    def __init__(self, device_cfg):
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self.rank = int(os.environ.get("RANK", 0))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        use_cuda = device_cfg == "cuda" or (device_cfg == "auto" and torch.cuda.is_available())
        if use_cuda:
            torch.cuda.set_device(local_rank)
            self.device = torch.device("cuda", local_rank)
        else:
            self.device = torch.device(device_cfg if device_cfg not in ("auto", "cuda") else "cpu")
        if self.world > 1:
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        self.master = self.rank == 0

    def mean(self, value):
        """Mean of a float over ranks."""
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.item() / self.world

    def any(self, flag):
        """True on every rank when the flag is set on any rank."""
        if self.world == 1:
            return flag
        t = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item() > 0

    def close(self):
        if self.world > 1:
            dist.destroy_process_group()


def autocast_context(device, dtype_cfg):
    use_bf16 = dtype_cfg == "bf16" or (dtype_cfg == "auto" and device.type == "cuda")
    if dtype_cfg not in ("auto", "bf16", "fp32"):
        raise ValueError(f"train.dtype={dtype_cfg!r}; choose auto, bf16 or fp32")
    if use_bf16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def grad_accum_steps(cfg, world):
    """Micro-steps per optimizer step: global_batch_tokens / (micro_batch_size * seq_len * world);
    global_batch_tokens null means one micro-batch per rank."""
    per_micro = cfg.train.micro_batch_size * cfg.train.seq_len * world
    if cfg.train.global_batch_tokens is None:
        return 1
    if cfg.train.global_batch_tokens % per_micro:
        raise ValueError(f"train.global_batch_tokens={cfg.train.global_batch_tokens} is not a multiple of "
                         f"micro_batch_size * seq_len * world_size = {per_micro}; change one of them")
    return cfg.train.global_batch_tokens // per_micro


def validate(cfg):
    """Settings that would otherwise fail deep inside the loop."""
    for key in ("max_steps", "micro_batch_size", "seq_len", "log_interval", "eval_interval", "ckpt_interval",
                "keep_last"):
        if cfg.train[key] < 1:
            raise ValueError(f"train.{key}={cfg.train[key]} must be >= 1")
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device=cuda but no CUDA device is visible; use train.device=auto or cpu")


class StopRequest:
    """Ctrl-C (SIGINT) or SIGTERM asks the run to stop at the next step boundary, where the
    checkpoint is consistent; every rank stops at the same step."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._request)

    def _request(self, *_):
        self.requested = True

    def agreed(self, dist_info):
        return dist_info.any(self.requested)


def lr_at(step, max_steps, warmup, lr, min_ratio):
    """Linear warmup from 0 over `warmup` steps, then cosine from lr to min_ratio * lr at max_steps;
    evaluated at the tokens consumed before the step (fox.md §3.2: lr(0) = 0)."""
    if step < warmup:
        return lr * step / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def warmup_steps(optim_cfg, tokens_per_step):
    if optim_cfg.warmup_tokens is not None:
        return math.ceil(optim_cfg.warmup_tokens / tokens_per_step)
    return optim_cfg.warmup_steps


def parallel_mode(cfg):
    if cfg.train.parallel not in ("ddp", "fsdp"):
        raise ValueError(f"train.parallel={cfg.train.parallel!r}; choose ddp or fsdp")
    return cfg.train.parallel


def shard_model(raw_model):
    """FSDP2: every block is its own unit (gathered just in time), the rest in the root unit."""
    for block in raw_model.blocks:
        fully_shard(block)
    fully_shard(raw_model)


@contextlib.contextmanager
def gradient_sync(model, raw_model, world, fsdp, sync):
    """Skip the gradient reduction on all but the last micro-step of an accumulation."""
    if world == 1:
        yield
    elif fsdp:
        raw_model.set_requires_gradient_sync(sync)
        yield
    else:
        with contextlib.nullcontext() if sync else model.no_sync():
            yield


def make_optimizer(model, optim_cfg, device):
    return torch.optim.AdamW(model.param_groups(optim_cfg.weight_decay), lr=optim_cfg.lr,
                             betas=tuple(optim_cfg.betas), eps=optim_cfg.eps,
                             fused=device.type == "cuda")


# ----------------------------------------------------------------------------- checkpoints

def rng_state():
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_training_state(raw_model, optimizer):
    """Unsharded model and optimizer state dicts (FSDP gathers them: call on every rank).

    The optimizer state is keyed by parameter names, so DDP, FSDP and single-process runs
    resume from each other's checkpoints."""
    return (get_model_state_dict(raw_model, options=FULL_STATE),
            get_optimizer_state_dict(raw_model, optimizer, options=FULL_STATE))


def load_training_state(raw_model, optimizer, ckpt):
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(raw_model, ckpt["model"], options=options)
    set_optimizer_state_dict(raw_model, optimizer, ckpt["optimizer"], options=options)


def save_checkpoint(out_dir, step, model_state, optim_state, raw_model, loader, cfg, wandb_id, keep_last):
    """Write ckpt_<step>.pt atomically (temp name + rename) and keep only the newest `keep_last`."""
    ckpt = {"format": CHECKPOINT_FORMAT, "step": step, "model": model_state,
            "model_config": config_dict(raw_model.config), "optimizer": optim_state,
            "loader": loader.state_dict(), "rng": rng_state(),
            "config": OmegaConf.to_container(cfg, resolve=True), "wandb_id": wandb_id}
    path = os.path.join(out_dir, f"ckpt_{step}.pt")
    tmp = path + ".tmp"
    torch.save(ckpt, tmp)
    os.replace(tmp, path)
    for old in checkpoint_files(out_dir)[:-keep_last]:
        os.remove(old)
    return path


def resume_checkpoint(cfg):
    """The checkpoint to resume from, or None for a fresh run."""
    mode = cfg.train.resume
    if mode == "never":
        return None
    if mode == "auto":
        if not checkpoint_files(cfg.train.out_dir):
            return None
        return load_checkpoint(cfg.train.out_dir)
    return load_checkpoint(mode)


def check_same_model(ckpt, model_config):
    saved = ckpt["model_config"]
    current = config_dict(model_config)
    diff = {k: (saved.get(k), v) for k, v in current.items() if saved.get(k) != v}
    if diff:
        raise ValueError(f"the checkpoint to resume comes from another model: (checkpoint, config) "
                         f"differ in {diff}. Use another train.out_dir or train.resume=never")


# ----------------------------------------------------------------------------- logging

class Metrics:
    """metrics.jsonl in the run dir, plus wandb on rank 0 when enabled."""

    def __init__(self, cfg, out_dir, wandb_id):
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self.wandb = None
        mode = os.environ.get("WANDB_MODE", cfg.train.wandb.mode)
        if mode != "disabled":
            import wandb
            self.wandb = wandb.init(project=cfg.train.wandb.project, name=cfg.train.wandb.name,
                                    id=wandb_id, resume="allow", mode=mode,
                                    config=OmegaConf.to_container(cfg, resolve=True))
        self.wandb_id = self.wandb.id if self.wandb else wandb_id

    def log(self, record):
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb:
            self.wandb.log(record, step=record["step"])

    def close(self):
        if self.wandb:
            self.wandb.finish()


@torch.no_grad()
def validation_loss(model, cfg, dist_info, autocast):
    """Mean loss over cfg.train.eval_tokens validation tokens, read from the start every time."""
    B, T = cfg.train.micro_batch_size, cfg.train.seq_len
    loader = build_loader(cfg.data, "val", B, T, dist_info.rank, dist_info.world)
    steps = max(1, cfg.train.eval_tokens // (B * T * dist_info.world))
    model.eval()
    loss = mean_loss(model, loader, steps, dist_info.device, autocast)
    model.train()
    return dist_info.mean(loss)


def print_sample(model, cfg, device):
    tok = tokenizer_for(cfg.data)
    idx = torch.tensor([[tok.eot_token]], device=device)
    out = model.generate(idx, cfg.train.sample_tokens, temperature=0.8, top_k=200)
    print("\n--- sample ---\n" + tok.decode(out[0, 1:].tolist()) + "\n--------------")


# ----------------------------------------------------------------------------- training

def train(cfg):
    validate(cfg)
    dist_info = Dist(cfg.train.device)
    device = dist_info.device
    torch.manual_seed(cfg.train.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out_dir = cfg.train.out_dir
    os.makedirs(out_dir, exist_ok=True)

    model_config = GPTConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True))
    n_vocab = tokenizer_for(cfg.data).n_vocab
    if model_config.vocab_size < n_vocab:
        raise ValueError(f"model.vocab_size={model_config.vocab_size} is smaller than the tokenizer's {n_vocab} "
                         "tokens; use 50304 (GPT-2's 50257 padded to a multiple of 64)")
    raw_model = GPT(model_config).to(device)
    fsdp = dist_info.world > 1 and parallel_mode(cfg) == "fsdp"
    if fsdp:       # in place, before the optimizer sees the parameters
        shard_model(raw_model)
    optimizer = make_optimizer(raw_model, cfg.optim, device)
    accum = grad_accum_steps(cfg, dist_info.world)
    B, T = cfg.train.micro_batch_size, cfg.train.seq_len
    loader = build_loader(cfg.data, "train", B, T, dist_info.rank, dist_info.world)

    step, wandb_id = 0, None
    ckpt = resume_checkpoint(cfg)
    if ckpt is not None:
        check_same_model(ckpt, model_config)
        load_training_state(raw_model, optimizer, ckpt)
        loader.load_state_dict(ckpt["loader"])
        set_rng_state(ckpt["rng"])
        step, wandb_id = ckpt["step"], ckpt["wandb_id"]
        del ckpt

    if dist_info.master:
        OmegaConf.save(cfg, os.path.join(out_dir, "config.yaml"), resolve=True)
        print(f"model: {model_config.attention}, {raw_model.num_params() / 1e6:.2f}M parameters | "
              f"{dist_info.world} rank(s) on {device.type} | grad accumulation {accum} | "
              f"{accum * B * T * dist_info.world} tokens/step | "
              + (f"resuming at step {step}" if step else "fresh run"))
    metrics = Metrics(cfg, out_dir, wandb_id) if dist_info.master else None

    use_compile = cfg.train.compile is True or (cfg.train.compile == "auto" and device.type == "cuda")
    model = torch.compile(raw_model) if use_compile else raw_model
    if dist_info.world > 1 and not fsdp:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    autocast = autocast_context(device, cfg.train.dtype)
    tokens_per_step = accum * B * T * dist_info.world
    warmup = warmup_steps(cfg.optim, tokens_per_step)
    flops_per_step = raw_model.flops_per_token(T) * tokens_per_step
    last_ckpt = (checkpoint_files(out_dir) or [None])[-1]

    saved_step = step if last_ckpt else None

    def checkpoint(at_step):
        nonlocal last_ckpt, saved_step
        saved_step = at_step
        model_state, optim_state = full_training_state(raw_model, optimizer)
        if dist_info.master:
            last_ckpt = save_checkpoint(out_dir, at_step, model_state, optim_state, raw_model, loader, cfg,
                                        metrics.wandb_id, cfg.train.keep_last)
        if dist_info.world > 1:
            dist.barrier()

    bar = tqdm(total=cfg.train.max_steps, initial=step, disable=not dist_info.master, desc="train",
               dynamic_ncols=True)
    model.train()
    t_start = t_last = time.perf_counter()
    losses, summary = [], {}

    def untimed(fn):
        """Run fn without counting its time in tokens/s (evaluation, checkpoints)."""
        nonlocal t_last
        start = time.perf_counter()
        result = fn()
        t_last += time.perf_counter() - start
        return result

    stop = StopRequest()
    while step < cfg.train.max_steps:
        lr = lr_at(step, cfg.train.max_steps, warmup, cfg.optim.lr, cfg.optim.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = 0.0
        for micro in range(accum):
            x, y = (t.to(device, non_blocking=True) for t in loader.next_batch())
            sync = micro == accum - 1     # reduce gradients across ranks once per step
            with gradient_sync(model, raw_model, dist_info.world, fsdp, sync), autocast:
                _, loss = model(x, y)
            (loss / accum).backward()
            loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.optim.grad_clip)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        loss_value = dist_info.mean(loss_sum.item() / accum)
        if not math.isfinite(loss_value) or not math.isfinite(grad_norm.item()):
            raise FloatingPointError(
                f"non-finite loss ({loss_value}) or gradient norm at step {step}; stopping. "
                f"Last good checkpoint: {last_ckpt or 'none yet'}")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        losses.append(loss_value)
        bar.update(1)

        if step % cfg.train.log_interval == 0 or step == cfg.train.max_steps:
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = (time.perf_counter() - t_last) / len(losses)
            t_last = time.perf_counter()
            tok_s = tokens_per_step / dt
            record = {"step": step, "loss": sum(losses) / len(losses), "lr": lr,
                      "grad_norm": grad_norm.item(), "tokens": step * tokens_per_step,
                      "tok_per_s": tok_s}
            if device.type == "cuda":
                record["mfu"] = flops_per_step / dt / (cfg.train.peak_flops * dist_info.world)
            losses = []
            summary.update(loss=record["loss"], tok_per_s=tok_s, mfu=record.get("mfu"))
            if dist_info.master:
                bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{tok_s:,.0f}",
                                **({"mfu": f"{record['mfu']:.1%}"} if "mfu" in record else {}))
                metrics.log(record)
        if step % cfg.train.eval_interval == 0 or step == cfg.train.max_steps:
            val = untimed(lambda: validation_loss(model, cfg, dist_info, autocast))
            summary["val_loss"] = val
            if dist_info.master:
                bar.write(f"step {step}: val loss {val:.4f}")
                metrics.log({"step": step, "val_loss": val})
        if step % cfg.train.ckpt_interval == 0 or step == cfg.train.max_steps:
            untimed(lambda: checkpoint(step))
        if stop.agreed(dist_info):
            bar.close()
            if saved_step != step:
                checkpoint(step)
            if dist_info.master:
                print(f"interrupted at step {step}: saved {last_ckpt}; resume with train.resume=auto")
            del model                  # DDP's reducer must die before its process group (gloo deadlock)
            dist_info.close()
            raise SystemExit(130)
    bar.close()
    if dist_info.master:
        print_summary(step, tokens_per_step, time.perf_counter() - t_start, summary, last_ckpt, out_dir)
        if cfg.train.sample_tokens:   # FSDP holds shards only: sample from the saved checkpoint
            sampler = GPT.from_checkpoint(last_ckpt, device) if fsdp else raw_model
            print_sample(sampler.eval(), cfg, device)
        metrics.close()
    del model                          # DDP's reducer must die before its process group (gloo deadlock)
    dist_info.close()


def print_summary(step, tokens_per_step, seconds, summary, last_ckpt, out_dir):
    """Final lines of a run, and loss.png in the run dir."""
    plot = plot_runs([out_dir], os.path.join(out_dir, "loss.png"))
    parts = [f"{step} steps", f"{step * tokens_per_step:,} tokens", f"{seconds / 60:.1f} min"]
    if "loss" in summary:
        parts += [f"train loss {summary['loss']:.4f}", f"{summary['tok_per_s']:,.0f} tok/s"]
    if summary.get("mfu") is not None:
        parts.append(f"MFU {summary['mfu']:.1%}")
    if "val_loss" in summary:
        parts.append(f"val loss {summary['val_loss']:.4f}")
    print("done: " + " | ".join(parts) + f"\ncheckpoint: {last_ckpt}\nloss curve: {plot}")


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg):
    with prefer_sdpa_backend(cfg.train.sdpa_backend):
        train(cfg)


if __name__ == "__main__":
    main()
