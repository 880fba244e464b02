"""Pretrain a GPT whose attention is a config switch.

    python train.py                                   # tiny model on the bundled corpus (CPU ok)
    python train.py model=castle data=text train.max_steps=1000
    torchrun --nproc_per_node=8 train.py experiment=castle_paper_M

One process or many (torchrun: NCCL on GPU, gloo on CPU). The run directory train.out_dir
(default runs/<model group>-<n_layer>x<n_embd>-<data>) takes the checkpoints; `train.resume=auto`
continues exactly where its newest readable checkpoint stopped, with the model and data settings
saved in it. What happens to checkpoints (atomic writes, rotation, recovery, the run-directory lock)
is model/checkpoint.py's policy; the options are documented in configs/train/default.yaml.
"""
import contextlib
import json
import math
import os
import random
import re
import signal
import time

import numpy as np
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
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
from evaluation import ValSplit
from evaluation.heldout import mean_loss
from evaluation.plots import plot_runs
from evaluation.samples import stream_text
from kernels.sdpa import ATTENTION_BACKENDS, check_fa4_dropout, prefer_sdpa_backend
from model.checkpoint import (DcpSave, archive_earlier_run, archive_newer_checkpoints, atomic_write,
                              checkpoint_files, checkpoint_step, config_dict, disk_bytes, is_checkpoint,
                              load_checkpoint, load_dcp_state, locked_run_dir, model_from_checkpoint,
                              remove_stale_temp_files, run_dir_of, save_checkpoint, saved_model_config)
from model.gpt import ACTIVATION_CHECKPOINTING, GPT, NEUTRAL_OPTIONS, GPTConfig
from model.memory_plan import MEMORY_CHECKS, check_fits, describe, memory_plan
from model.fp8 import check_fp8_config, check_fp8_device, convert_to_fp8, fp8_left_out
from model.recurrent import check_trainable
from model.runtime import (DEVICE, Dist, autocast_context, check_dataclass_types, check_options, choose_dtype,
                           boolean, entry_point, integer, number, one_of, optional, pair, text)

# ----------------------------------------------------------------------------- options

OPTIONS = {
    "train.seq_len": integer(1), "train.micro_batch_size": integer(1),
    "train.global_batch_tokens": optional(integer(1)), "train.max_steps": integer(1),
    "train.out_dir": text(), "train.resume": text(), "train.if_exists": one_of("error", "archive"),
    "train.device": DEVICE, "train.dtype": one_of("auto", "bf16", "fp32"), "train.compile": one_of("auto", True, False),
    "train.sdpa_backend": one_of(*ATTENTION_BACKENDS), "train.parallel": one_of("ddp", "fsdp"),
    "train.activation_checkpointing": one_of(*ACTIVATION_CHECKPOINTING),
    "train.activation_checkpointing_every": integer(1), "train.memory_check": one_of(*MEMORY_CHECKS),
    "train.seed": integer(0), "train.log_interval": integer(1), "train.eval_interval": integer(1),
    "train.eval_tokens": integer(1), "train.ckpt_interval": integer(1), "train.keep_last": integer(1),
    "train.ckpt_format": one_of("full", "dcp"), "train.ckpt_async": one_of(True, False), "train.fp8": boolean(),
    "train.sample_tokens": integer(0), "train.peak_flops": number(above=0),
    "train.wandb.mode": one_of("disabled", "offline", "online"), "train.wandb.project": text(),
    "train.wandb.name": optional(text()),
    "optim.lr": number(above=0), "optim.betas": pair(number(0, 1)), "optim.eps": number(above=0),
    "optim.weight_decay": number(0), "optim.grad_clip": number(above=0),
    "optim.warmup_steps": optional(integer(0)), "optim.warmup_tokens": optional(integer(0)),
    "optim.min_lr_ratio": number(0, 1),
}


def flatten(tree, prefix=""):
    """{"a": {"b": 1}} -> {"a.b": 1}"""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def check_train_options(cfg):
    """Types and ranges of every train.* and optim.* option, before anything starts."""
    check_options(flatten(OmegaConf.to_container(cfg, resolve=True)), OPTIONS)
    if cfg.optim.warmup_steps is None and cfg.optim.warmup_tokens is None:
        raise ValueError("optim.warmup_steps and optim.warmup_tokens are both null; set one of them")
    if cfg.train.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"train.device={cfg.train.device} but no CUDA device is visible; use train.device=auto or cpu")
    resume = cfg.train.resume
    if resume not in ("auto", "never") and not os.path.exists(resume):
        raise FileNotFoundError(f"train.resume={resume} does not exist; use auto, never, a run directory, "
                                "a ckpt_<step>.pt file or a ckpt_<step>.dcp directory")
    if cfg.train.ckpt_async and cfg.train.ckpt_format != "dcp":
        raise ValueError("train.ckpt_async=true needs train.ckpt_format=dcp (a full checkpoint is written by "
                         "rank 0 in one piece); set train.ckpt_format=dcp or train.ckpt_async=false")


def build_model_config(cfg):
    """GPTConfig of cfg.model (types checked), for the tokenizer of cfg.data and the context train.seq_len."""
    values = OmegaConf.to_container(cfg.model, resolve=True)
    check_dataclass_types(GPTConfig, values, "model.")
    n_vocab = tokenizer_for(cfg.data).n_vocab
    if values.get("vocab_size", n_vocab) < n_vocab:
        raise ValueError(f"model.vocab_size={values['vocab_size']} is smaller than the tokenizer's {n_vocab} "
                         "tokens; use 50304 (GPT-2's 50257 padded to a multiple of 64)")
    config = GPTConfig.from_dict({**values, "tokenizer_vocab_size": n_vocab})
    if config.block_size < cfg.train.seq_len:
        raise ValueError(f"model.block_size={config.block_size} is smaller than train.seq_len={cfg.train.seq_len}: "
                         "positions past block_size have no position table; leave model.block_size at its "
                         "default (it follows train.seq_len) or set it >= train.seq_len")
    return config


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


def compiles(cfg, device):
    return cfg.train.compile is True or (cfg.train.compile == "auto" and device.type == "cuda")


def check_memory_plan(cfg, model_config, dist_info, accum):
    """Print the estimated per-GPU peak (rank 0); on CUDA refuse (train.memory_check=error) or warn
    when it exceeds the device's memory, before anything is allocated."""
    device = dist_info.device
    plan = memory_plan(model_config, micro_batch=cfg.train.micro_batch_size, seq_len=cfg.train.seq_len,
                       world=dist_info.world, parallel=cfg.train.parallel,
                       activation_checkpointing=cfg.train.activation_checkpointing,
                       activation_checkpointing_every=cfg.train.activation_checkpointing_every,
                       autocast=choose_dtype(cfg.train.dtype, device) == torch.bfloat16, device_type=device.type,
                       compiled=compiles(cfg, device), grad_accum=accum)
    capacity = torch.cuda.mem_get_info(device)[1] if device.type == "cuda" else None
    if dist_info.master:
        print(describe(plan, capacity))
    warning = check_fits(plan, capacity, cfg.train.memory_check) if capacity else None
    if warning and dist_info.master:
        print(warning)


class StopRequest:
    """Ctrl-C (SIGINT) or SIGTERM asks the run to stop at the next step boundary, where the
    checkpoint is consistent; every rank stops at the same step. Exit code 128 + the signal."""

    def __init__(self):
        self.signal = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._request)

    def _request(self, signum, _frame):
        self.signal = self.signal or signum

    def agreed(self, dist_info):
        return dist_info.any(self.signal is not None)

    @property
    def exit_code(self):
        return 128 + (self.signal or signal.SIGINT)


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


# ----------------------------------------------------------------------------- resuming

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


def sharded_training_state(raw_model, optimizer):
    """{"model", "optimizer"}: this rank's state dicts (FSDP: its shards as DTensors; DDP or one
    process: full tensors, which DCP writes once, spread over the ranks), keyed by parameter names."""
    return {"model": get_model_state_dict(raw_model), "optimizer": get_optimizer_state_dict(raw_model, optimizer)}


def load_dcp_training_state(raw_model, optimizer, path):
    """Model and optimizer state of a DCP checkpoint directory, each rank reading the parts of its
    shards; DCP reshards, so the run may have another world size or parallelism than the writer."""
    state = sharded_training_state(raw_model, optimizer)
    load_dcp_state(path, state)
    set_model_state_dict(raw_model, state["model"])
    set_optimizer_state_dict(raw_model, optimizer, state["optimizer"])


def load_training_state(raw_model, optimizer, loader, ckpt):
    """Weights, optimizer, loader position and RNG states of a checkpoint; one without training state
    (weights only, e.g. imported by scripts.import_hf) starts the optimizer, data and RNGs afresh."""
    options = StateDictOptions(full_state_dict=True)
    if "dcp" in ckpt:
        load_dcp_training_state(raw_model, optimizer, ckpt["dcp"])
    else:
        set_model_state_dict(raw_model, ckpt["model"], options=options)
        if ckpt.get("optimizer") is not None:
            set_optimizer_state_dict(raw_model, optimizer, ckpt["optimizer"], options=options)
    if ckpt.get("loader") is not None:
        loader.load_state_dict(ckpt["loader"])
    if ckpt.get("rng") is not None:
        set_rng_state(ckpt["rng"])


def same_path(a, b):
    return os.path.realpath(a) == os.path.realpath(b)


def resume_checkpoint(cfg):
    """(file, checkpoint) to resume from, or (None, None) for a fresh run; refuses a fresh run in a
    directory that holds checkpoints unless train.if_exists=archive."""
    out_dir, resume = cfg.train.out_dir, cfg.train.resume
    in_out_dir = resume == "auto" or same_path(resume, out_dir) or (
        is_checkpoint(resume) and same_path(run_dir_of(resume), out_dir))
    if in_out_dir:
        if resume == "auto" and not checkpoint_files(out_dir):
            return None, None
        return load_checkpoint(out_dir if resume == "auto" else resume, dcp_parts=())
    existing = checkpoint_files(out_dir)
    if existing and cfg.train.if_exists != "archive":
        names = ", ".join(os.path.basename(f) for f in existing)
        raise ValueError(f"train.out_dir={out_dir} holds checkpoints of an earlier run ({names}) and "
                         f"train.resume={resume} starts a new one there; continue it with train.resume=auto, "
                         "use another train.out_dir, or move its files into archive/ with train.if_exists=archive")
    return (None, None) if resume == "never" else load_checkpoint(resume, dcp_parts=())


def override_keys(overrides):
    """Option or group names set on the command line: `model.n_layer=3` -> model.n_layer, `+x=1` -> x."""
    return [re.match(r"[+~]*([^=]*)", o).group(1) for o in overrides]


# command-line groups that choose a whole config section: with one of them the section is the composed one
SECTION_GROUPS = {"model": ("model", "size", "experiment"), "data": ("data", "experiment")}


def settings_from_checkpoint(cfg, ckpt, overrides):
    """Resume with the model and data settings saved in the checkpoint, except those chosen on the
    command line: a section whose group (model=, size=, data=, experiment=) is chosen stays as
    composed, single options (model.n_layer=3) are applied on top. -> sections taken."""
    keys = override_keys(overrides)
    taken = []
    for section, groups in SECTION_GROUPS.items():
        if any(k in groups for k in keys):
            continue
        saved = OmegaConf.create(ckpt["config"][section])
        for key in keys:
            if key.startswith(section + "."):
                OmegaConf.update(saved, key[len(section) + 1:], OmegaConf.select(cfg, key), merge=False)
        cfg[section] = saved
        taken.append(section)
    return taken


def check_same_model(ckpt, model_config, file, overrides):
    """The model to resume is the model of the checkpoint (its saved config normalized through
    GPTConfig, so fields older checkpoints lack compare at their defaults)."""
    saved = config_dict(GPTConfig.from_dict(saved_model_config(ckpt)))
    diff = [f"{k}={saved.get(k)!r} in the checkpoint, {v!r} here" for k, v in config_dict(model_config).items()
            if saved.get(k) != v and k not in NEUTRAL_OPTIONS]   # kernels may change on resume
    if diff:
        chosen = [o for o, k in zip(overrides, override_keys(overrides))
                  if k.split(".")[0] in SECTION_GROUPS["model"]]
        raise ValueError(f"cannot resume {file}: it holds another model ({'; '.join(diff)}). To continue it, "
                         f"leave out the model overrides ({' '.join(chosen) or 'none given'}); to train this "
                         "model, use another train.out_dir")


# ----------------------------------------------------------------------------- logging

def drop_records_after(path, step):
    """Rewrite metrics.jsonl without the records past `step` (steps a resumed run repeats) and
    without a line that a killed writer cut short."""
    if not os.path.isfile(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("step", 0) <= step:
                kept.append(json.dumps(record) + "\n")
    atomic_write(path, lambda f: f.write("".join(kept).encode()))


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


def check_val_split(cfg):
    """Validation (every train.eval_interval steps and after the last step) reads micro-batches of train.seq_len
    tokens from the val split: a split too small for one is refused before training, naming the option to lower,
    not at the first evaluation."""
    ValSplit(cfg.data).check(cfg.train.seq_len, cfg.train.micro_batch_size, "train.seq_len", "train.micro_batch_size")


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
    print("\n--- sample ---")
    stream_text(model, tok, [tok.eot_token], device, max_new_tokens=cfg.train.sample_tokens, temperature=0.8,
                top_k=200)
    print("--------------")


def realised_mix(loader):
    """{"data_mix": {source: share of the sequences read so far}} for a data.mix run, else {}."""
    counts = loader.source_counts()
    total = sum(counts.values())
    return {"data_mix": {name: n / total for name, n in counts.items()}} if len(counts) > 1 and total else {}


def print_summary(step, tokens_per_step, seconds, summary, last_ckpt, out_dir):
    """Final lines of a run, and loss.png in the run dir."""
    plot = plot_runs([out_dir], os.path.join(out_dir, "loss.png"))
    parts = [f"{step} steps", f"{step * tokens_per_step:,} tokens", f"{seconds / 60:.1f} min"]
    if "loss" in summary:
        parts += [f"train loss {summary['loss']:.4f}", f"{summary['tok_per_s']:,.0f} tok/s"]
    if summary.get("mfu") is not None:
        parts.append(f"MFU {summary['mfu']:.1%}")
    if summary.get("peak_gib") is not None:
        parts.append(f"peak {summary['peak_gib']:.1f} GiB")
    if "val_loss" in summary:
        parts.append(f"val loss {summary['val_loss']:.4f}")
    print("done: " + " | ".join(parts) + f"\ncheckpoint: {last_ckpt}\nloss curve: {plot}")


# ----------------------------------------------------------------------------- training

def train(cfg, overrides, model_group):
    """overrides: the command line's Hydra overrides; model_group: the chosen model config's name."""
    dist_info = Dist(cfg.train.device)
    out_dir = cfg.train.out_dir
    with locked_run_dir(out_dir) if dist_info.master else contextlib.nullcontext():
        dist_info.check_shared_dir(out_dir, "train.out_dir")
        run(cfg, overrides, model_group, dist_info, out_dir)


def run(cfg, overrides, model_group, dist_info, out_dir):
    device = dist_info.device
    accum = grad_accum_steps(cfg, dist_info.world)
    torch.manual_seed(cfg.train.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    resume_file, ckpt = resume_checkpoint(cfg)
    taken = settings_from_checkpoint(cfg, ckpt, overrides) if ckpt else []
    if "model" in taken:
        model_group = ckpt.get("model_group", ckpt["config"]["model"]["attention"])
    model_config = build_model_config(cfg)
    if ckpt:
        check_same_model(ckpt, model_config, resume_file, overrides)
    check_memory_plan(cfg, model_config, dist_info, accum)
    check_trainable(model_config.attention, device)
    if cfg.train.fp8:
        check_fp8_config(model_config)
        check_fp8_device(device)
    if cfg.train.sdpa_backend == "fa4":
        check_fa4_dropout(model_config.dropout)
    raw_model = GPT(model_config).to(device)
    recomputed = raw_model.checkpoint_activations(cfg.train.activation_checkpointing,
                                                  cfg.train.activation_checkpointing_every)
    fp8_note = fp8_left_out(raw_model) if cfg.train.fp8 else ""
    fp8_layers = convert_to_fp8(raw_model) if cfg.train.fp8 else []
    fsdp = dist_info.world > 1 and cfg.train.parallel == "fsdp"
    if fsdp:       # in place, before the optimizer sees the parameters
        shard_model(raw_model)
    optimizer = make_optimizer(raw_model, cfg.optim, device)
    B, T = cfg.train.micro_batch_size, cfg.train.seq_len
    loader = build_loader(cfg.data, "train", B, T, dist_info.rank, dist_info.world)
    check_val_split(cfg)

    step, wandb_id = 0, None
    if ckpt is not None:
        load_training_state(raw_model, optimizer, loader, ckpt)
        step, wandb_id = ckpt["step"], ckpt.get("wandb_id")
        del ckpt
    # the checkpoint already in out_dir for this step, if the run resumes from one there
    last_ckpt = resume_file if resume_file and same_path(run_dir_of(resume_file), out_dir) else None

    if dist_info.master:
        prepare_run_dir(cfg, out_dir, step, resumed_here=last_ckpt is not None)
        print(f"model: {model_group} ({model_config.attention} attention), {raw_model.num_params() / 1e6:.2f}M "
              f"parameters | {dist_info.world} rank(s) on {device.type} | grad accumulation {accum} | "
              f"{accum * B * T * dist_info.world} tokens/step | activation checkpointing "
              f"{cfg.train.activation_checkpointing} ({recomputed} of {model_config.n_layer} blocks recomputed) | "
              + (f"fp8 matmuls in {len(fp8_layers)} linear layers{'; ' + fp8_note if fp8_note else ''} | "
                 if cfg.train.fp8 else "") +
              f"run dir {out_dir} | "
              + (f"resuming at step {step} from {resume_file}" if resume_file else "fresh run")
              + (f" with its {' and '.join(taken)} settings" if taken else ""))
    metrics = Metrics(cfg, out_dir, wandb_id) if dist_info.master else None

    model = torch.compile(raw_model) if compiles(cfg, device) else raw_model
    if dist_info.world > 1 and not fsdp:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    autocast = autocast_context(device, choose_dtype(cfg.train.dtype, device))
    tokens_per_step = accum * B * T * dist_info.world
    warmup = warmup_steps(cfg.optim, tokens_per_step)
    flops_per_step = raw_model.flops_per_token(T) * tokens_per_step
    saved_step = step if last_ckpt else None

    # a DCP save written by a thread (train.ckpt_async) runs on a process group of its own
    async_group = dist.new_group(backend="gloo") if cfg.train.ckpt_async and dist_info.world > 1 else None
    pending = None          # the DCP save in flight: (DcpSave, seconds training waited for it, its start)

    def checkpoint(at_step):
        """Every rank. The loader's state is the global stream position, the same on every rank, and
        the RNG states are seeded alike: rank 0's stand for all (as in the full format)."""
        nonlocal saved_step, pending
        saved_step = at_step
        finish_checkpoint()                  # one save at a time
        start = time.perf_counter()
        contents = {"model_config": config_dict(raw_model.config), "loader": loader.state_dict(),
                    "rng": rng_state(), "config": OmegaConf.to_container(cfg, resolve=True),
                    "model_group": model_group, "wandb_id": metrics.wandb_id} if dist_info.master else None
        if cfg.train.ckpt_format == "full":
            model_state, optim_state = full_training_state(raw_model, optimizer)
            if dist_info.master:
                path = save_checkpoint(out_dir, at_step, {"model": model_state, "optimizer": optim_state,
                                                          **contents}, cfg.train.keep_last)
                log_checkpoint(path, time.perf_counter() - start)
        else:
            save = DcpSave(out_dir, at_step, contents, cfg.train.keep_last, dist_info.master)
            save.write(sharded_training_state(raw_model, optimizer), cfg.train.ckpt_async, async_group)
            pending = (save, time.perf_counter() - start, start)
            if not cfg.train.ckpt_async:
                finish_checkpoint()
        if dist_info.world > 1:
            dist.barrier()

    def finish_checkpoint():
        """Wait for the DCP save in flight, if any (rank 0: then it is in place)."""
        nonlocal pending
        if pending is not None:
            save, waited, start = pending
            pending = None
            path = save.finish()
            if dist_info.master:
                log_checkpoint(path, waited if cfg.train.ckpt_async else time.perf_counter() - start,
                               time.perf_counter() - start)

    def log_checkpoint(path, seconds, written_seconds=None):
        """Rank 0: the checkpoint is in place; ckpt_seconds: training stopped for it (an asynchronous
        save: the copy to the CPU), ckpt_write_seconds: until it was in place (asynchronous saves,
        logged at the step they finish, which may be after ckpt_step)."""
        nonlocal last_ckpt
        last_ckpt = path
        record = {"step": step, "ckpt_step": checkpoint_step(path), "ckpt_seconds": seconds,
                  "ckpt_bytes": disk_bytes(path)}
        if cfg.train.ckpt_async:
            record["ckpt_write_seconds"] = written_seconds
        metrics.log(record)

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
    with tqdm(total=cfg.train.max_steps, initial=step, disable=not dist_info.master, desc="train",
              dynamic_ncols=True) as bar:     # closed however the loop ends: an error starts its own line
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
                          "tok_per_s": tok_s, "eta_s": (cfg.train.max_steps - step) * tokens_per_step / tok_s}
                if device.type == "cuda":
                    record["mfu"] = flops_per_step / dt / (cfg.train.peak_flops * dist_info.world)
                    record["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30   # this rank's, so far
                record.update(realised_mix(loader))
                losses = []
                summary.update(loss=record["loss"], tok_per_s=tok_s, mfu=record.get("mfu"),
                               peak_gib=record.get("peak_gib"))
                if dist_info.master:
                    bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{tok_s:,.0f}",
                                    **({"mfu": f"{record['mfu']:.1%}"} if "mfu" in record else {}),
                                    eta=tqdm.format_interval(record["eta_s"]))
                    metrics.log(record)
            if step % cfg.train.ckpt_interval == 0 or step == cfg.train.max_steps:   # saved before its evaluation,
                untimed(lambda: checkpoint(step))                                     # which cannot lose it then
            if step % cfg.train.eval_interval == 0 or step == cfg.train.max_steps:
                val = untimed(lambda: validation_loss(model, cfg, dist_info, autocast))
                summary["val_loss"] = val
                if dist_info.master:
                    bar.write(f"step {step}: val loss {val:.4f}")
                    metrics.log({"step": step, "val_loss": val})
            if pending is not None and pending[0].done():
                finish_checkpoint()
            if stop.agreed(dist_info):
                bar.close()
                if saved_step != step:
                    checkpoint(step)
                finish_checkpoint()
                if dist_info.master:
                    print(f"interrupted at step {step}: saved {last_ckpt}; resume with train.resume=auto")
                del model                  # DDP's reducer must die before its process group (gloo deadlock)
                dist_info.close()
                raise SystemExit(stop.exit_code)
    finish_checkpoint()
    if dist_info.master:
        print_summary(step, tokens_per_step, time.perf_counter() - t_start, summary, last_ckpt, out_dir)
        if cfg.train.sample_tokens:   # FSDP holds shards only: sample from the saved checkpoint
            sampler = model_from_checkpoint(load_checkpoint(last_ckpt)[1], device) if fsdp else raw_model
            print_sample(sampler.eval(), cfg, device)
        metrics.close()
    del model                          # DDP's reducer must die before its process group (gloo deadlock)
    dist_info.close()


def prepare_run_dir(cfg, out_dir, step, resumed_here):
    """Rank 0, holding the lock, once the run is known to start: clear what killed writers left,
    move an earlier run (train.if_exists=archive) or checkpoints newer than the resumed step out of
    the way, drop metrics past the step, save the config."""
    remove_stale_temp_files(out_dir)
    if resumed_here:
        archive_newer_checkpoints(out_dir, step)
    elif checkpoint_files(out_dir):         # resume_checkpoint let a fresh run in: if_exists=archive
        archive_earlier_run(out_dir)
    drop_records_after(os.path.join(out_dir, "metrics.jsonl"), step)
    atomic_write(os.path.join(out_dir, "config.yaml"), lambda f: f.write(OmegaConf.to_yaml(cfg, resolve=True).encode()))


@entry_point("config")
def main(cfg):
    hydra_cfg = HydraConfig.get()
    check_train_options(cfg)
    cfg.train.out_dir = cfg.train.out_dir     # resolved now: it names the model the command line chose
    with prefer_sdpa_backend(cfg.train.sdpa_backend):
        train(cfg, list(hydra_cfg.overrides.task), hydra_cfg.runtime.choices.model)


if __name__ == "__main__":
    main()
