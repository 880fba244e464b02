"""Checkpoints and run directories: names, discovery, atomic writes, rotation, recovery, and the lock
that keeps two training runs out of one directory. train.py writes through this module; sample.py,
eval.py and the scripts load through it.

A run directory (train.out_dir) holds checkpoints, metrics.jsonl, config.yaml, loss.png, `.lock`
while a run uses it, and `archive/` (files moved out of the way, never deleted). A checkpoint is, in
the top level, a file `ckpt_<step>.pt` (the full format: one torch.save dict written by rank 0) or a
directory `ckpt_<step>.dcp` (the dcp format: torch.distributed.checkpoint's `.metadata` and one or
more `__<rank>_<n>.distcp` files per rank holding the model and optimizer state, every rank writing
its own shard, plus DCP_META, the rest of the checkpoint dict, written by rank 0). `ckpt_6_backup.pt`,
`ckpt_3.pt.tmp`, a file named `ckpt_3.dcp` or anything in a subdirectory is not one, and nothing here
reads, moves or deletes it. Both formats hold the same dict; every rule below applies to both.

Policy:
- Atomic writes: a file is written to `<name>.tmp` beside it, fsynced, renamed over the target, and
  the directory fsynced, so a checkpoint is complete or absent whenever the process dies. A DCP
  checkpoint is written into `ckpt_<step>.dcp.tmp/` and renamed by rank 0 once every rank's shard
  and DCP's .metadata are written (DCP's coordinator writes .metadata after gathering every rank's
  write results). A failed write (a full disk included) removes its temp file or directory; a full
  disk is reported with the directory, the bytes needed and the bytes free. A training run removes
  the temp files of the names it writes (TEMP_NAME) when it starts: they can only be a killed
  writer's, since it holds the lock.
- Discovery: a run directory's checkpoint is its newest *readable* one by step; newer files that do
  not load are skipped with a warning naming each, never deleted. A file that does not load is
  reported together with the newest readable checkpoint beside it. A DCP directory is readable
  when its DCP_META loads, its .metadata loads and every shard file that .metadata names is there
  in full; a missing or short one is named in the error.
- Resume from step S: checkpoints newer than S in the run directory (the unreadable ones discovery
  skipped, or a later state the user chose to go back from) are moved into
  `archive/<time>-after-step-S/` before training. Then the rotation cannot delete them, the run
  does not overwrite them when it reaches their step again, and "newest" means this run's latest.
- Rotation after writing step S keeps S and the newest keep_last - 1 readable older checkpoints and
  deletes the other older ones; it never deletes S or anything newer than S.
- A fresh run refuses a directory that holds checkpoints (train.py: unless train.if_exists=archive,
  which first moves every file of the earlier run into `archive/<time>-earlier-run/`).
- Lock: a training run holds `.lock` (its pid and host, created with O_CREAT | O_EXCL) while it
  runs. Another run on the same directory refuses, naming the holder. A lock whose process is gone
  (on this host) is taken over with a warning; one held from another host is only reported.
"""
import contextlib
import errno
import json
import os
import re
import shutil
import socket
import sys
import time
import warnings
from dataclasses import asdict

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from data.tokenizer import tokenizer_for
from model.gpt import GPT, GPTConfig
from model.runtime import DISK_FULL_ERRNOS, choose_device, choose_dtype

CHECKPOINT_FORMAT = "attn-lm-checkpoint-v1"
CHECKPOINT_NAME = re.compile(r"ckpt_(\d+)\.(pt|dcp)")
SUFFIX = {"full": ".pt", "dcp": ".dcp"}                  # train.ckpt_format -> checkpoint name suffix
TEMP_NAME = re.compile(r"(ckpt_\d+\.(pt|dcp)|metrics\.jsonl|config\.yaml|loss\.png)\.tmp")
DCP_META = "meta.pt"            # in a .dcp directory: the checkpoint dict without "model" and "optimizer"
DCP_STATE = ("model", "optimizer")                        # what DCP writes sharded
LOCK_NAME = ".lock"
ARCHIVE_DIR = "archive"


class UnreadableCheckpoint(ValueError):
    """A file that torch.load cannot read, or that train.py did not write; a DCP directory with a
    file missing or cut short, or whose tensors are another model's."""


class RunDirectoryLocked(ValueError):
    """Another training run holds the run directory."""


class DiskFullError(OSError):
    """A write failed for lack of space; the message names the directory and the bytes."""


def warn(message):
    print(f"warning: {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- names, discovery

def checkpoint_path(run_dir, step, ckpt_format="full"):
    return os.path.join(run_dir, f"ckpt_{step}{SUFFIX[ckpt_format]}")


def run_dir_of(path):
    """The run directory holding a checkpoint file or DCP directory (`runs/x/ckpt_4.dcp/` -> runs/x)."""
    return os.path.dirname(os.path.normpath(path)) or "."


def checkpoint_step(path):
    """The step of a checkpoint name, or None for any other name."""
    match = CHECKPOINT_NAME.fullmatch(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def is_dcp(path):
    """A DCP checkpoint: a directory named ckpt_<step>.dcp."""
    return os.path.isdir(path) and checkpoint_step(path) is not None and path.rstrip(os.sep).endswith(".dcp")


def is_checkpoint(path):
    """A checkpoint of either format (a ckpt_<step>.pt file or a ckpt_<step>.dcp directory)."""
    return is_dcp(path) or (os.path.isfile(path) and checkpoint_step(path) is not None
                            and path.endswith(".pt"))


def checkpoint_files(run_dir):
    """The checkpoints in a run directory, oldest first (not checked for readability)."""
    if not os.path.isdir(run_dir):
        return []
    named = [(checkpoint_step(name), name) for name in os.listdir(run_dir)]
    return [os.path.join(run_dir, name) for step, name in sorted(n for n in named if n[0] is not None)
            if is_checkpoint(os.path.join(run_dir, name))]


def remove_checkpoint(path):
    if is_dcp(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def read_checkpoint(path, mmap=False, dcp_parts=DCP_STATE):
    """The checkpoint dict in `path` (tensors on the CPU; mmap: mapped, not read, which makes a cheap
    readability check). A DCP directory: the sharded parts named in dcp_parts ("model",
    "optimizer") are read in full; with none, ckpt["dcp"] names the directory instead (train.py
    reads them sharded: load_dcp_state). Raises UnreadableCheckpoint saying why it is not one."""
    if is_dcp(path):
        ckpt = read_dcp_meta(path)
        if dcp_parts and not mmap:
            del ckpt["dcp"]
            ckpt.update(read_dcp_state(path, ckpt, dcp_parts))
        return ckpt
    return read_torch_file(path, mmap)


def read_torch_file(path, mmap=False):
    """A dict that train.py wrote with torch.save."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as e:
        reason = " ".join(str(e).split()).split(". ")[0]      # torch's first sentence says what broke
        raise UnreadableCheckpoint(f"{path} is not a readable checkpoint ({reason})") from e
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise UnreadableCheckpoint(f"{path} was not written by this repo's train.py (expected format "
                                   f"{CHECKPOINT_FORMAT!r}); convert it or pass a checkpoint from train.py")
    return ckpt


def is_readable(path):
    try:
        read_checkpoint(path, mmap=True)
    except UnreadableCheckpoint:
        return False
    return True


def load_checkpoint(path, dcp_parts=DCP_STATE):
    """(checkpoint, its dict): a checkpoint (file or DCP directory), or a run directory's newest
    readable checkpoint (warning about each newer one skipped). dcp_parts: see read_checkpoint."""
    if os.path.isdir(path) and not is_dcp(path):
        files = checkpoint_files(path)
        if not files:
            raise FileNotFoundError(f"no checkpoint (ckpt_<step>.pt or ckpt_<step>.dcp) in run directory {path!r}; "
                                    f"train first with `python train.py train.out_dir={path}`")
        for file in reversed(files):
            try:
                return file, read_checkpoint(file, dcp_parts=dcp_parts)
            except UnreadableCheckpoint as e:
                warn(f"skipping {e}")
        raise UnreadableCheckpoint(f"no checkpoint in {path} is readable ({', '.join(map(os.path.basename, files))}); "
                                   "move them away and train again, or pass a checkpoint from elsewhere")
    if os.path.exists(path):
        path = os.path.normpath(path)           # `ckpt_4.dcp/` too is a checkpoint in its run directory
        try:
            return path, read_checkpoint(path, dcp_parts=dcp_parts)
        except UnreadableCheckpoint as e:
            others = [f for f in checkpoint_files(run_dir_of(path)) if not os.path.samefile(f, path)]
            good = next((f for f in reversed(others) if is_readable(f)), None)
            hint = (f"the newest readable checkpoint beside it is {good}" if good
                    else "no checkpoint beside it is readable")
            raise UnreadableCheckpoint(f"{e}; {hint}") from e
    raise FileNotFoundError(f"checkpoint {path!r} does not exist; pass a run directory, a ckpt_<step>.pt file "
                            "or a ckpt_<step>.dcp directory")


# ----------------------------------------------------------------------------- DCP directories

def read_dcp_meta(path):
    """The checkpoint dict of a DCP directory without its tensors, after checking that DCP_META,
    .metadata and every shard file .metadata names are there in full."""
    meta_file = os.path.join(path, DCP_META)
    if not os.path.isfile(meta_file):
        raise UnreadableCheckpoint(f"{meta_file} is missing: {path} is not a complete checkpoint")
    ckpt = read_torch_file(meta_file)
    metadata = read_dcp_metadata(path)
    sizes = {}
    for info in metadata.storage_data.values():
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), info.offset + info.length)
    for name, needed in sorted(sizes.items()):
        shard = os.path.join(path, name)
        if not os.path.isfile(shard):
            raise UnreadableCheckpoint(f"{shard} is missing: {path} lacks a rank's shard (its .metadata names it)")
        if os.path.getsize(shard) < needed:
            raise UnreadableCheckpoint(f"{shard} is cut short ({os.path.getsize(shard):,} bytes, its .metadata "
                                       f"names {needed:,}): {path} is not a complete checkpoint")
    ckpt["dcp"] = path
    return ckpt


def read_dcp_metadata(path):
    """DCP's .metadata of a checkpoint directory (tensor shapes and where each shard is stored)."""
    file = os.path.join(path, ".metadata")
    if not os.path.isfile(file):
        raise UnreadableCheckpoint(f"{file} is missing: {path} is not a complete checkpoint (DCP writes "
                                   ".metadata last, after every rank's shard)")
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except Exception as e:
        raise UnreadableCheckpoint(f"{file} is not readable ({' '.join(str(e).split())[:200]})") from e


def check_dcp_shapes(path, shapes):
    """Raise UnreadableCheckpoint naming the first tensor of `shapes` ({"model.<name>": shape}, the
    model that is to load it) that the DCP directory lacks or holds with another shape."""
    saved = read_dcp_metadata(path).state_dict_metadata
    file = os.path.join(path, ".metadata")
    fix = "it was written by another model; use a checkpoint of this model or another train.out_dir"
    for key, shape in shapes.items():
        if key not in saved or not hasattr(saved[key], "size"):
            raise UnreadableCheckpoint(f"{file} has no tensor {key}: {fix}")
        if tuple(saved[key].size) != tuple(shape):
            raise UnreadableCheckpoint(f"{file} holds {key} of shape {tuple(saved[key].size)}, but the model has "
                                       f"{tuple(shape)}: {fix}")


def meta_model(model_config):
    """The GPT of a config on the meta device (shapes and names, no memory)."""
    with torch.device("meta"):
        return GPT(GPTConfig.from_dict(model_config))


def tie_shared(model, state_dict):
    """Make the entries of parameters the model shares (tied embeddings) one tensor again: DCP
    stores each name separately, torch.save stores a shared tensor once."""
    first = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if name in state_dict:
            state_dict[name] = state_dict[first.setdefault(id(param), name)]


def load_dcp_state(path, state):
    """Fill `state` ({"model", "optimizer"}: this rank's state dicts, sharded or not) from a DCP
    directory, each rank reading the parts of the shards it holds, whatever world size wrote them;
    under a process group every rank calls it."""
    check_dcp_shapes(path, {f"model.{k}": v.shape for k, v in state["model"].items()})
    with one_process_quietly() as one_process:
        dcp.load(state, checkpoint_id=path, no_dist=one_process)


@contextlib.contextmanager
def one_process_quietly():
    """-> whether this process saves or loads alone (no process group), without DCP's warning
    that it assumes so."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield not torch.distributed.is_initialized()


def read_dcp_state(path, meta, parts=DCP_STATE):
    """{part: its full state dict} of a DCP directory for parts "model" and "optimizer", read in this
    process alone whatever world size wrote it (the shards are stitched together)."""
    model = meta_model(saved_model_config(meta))
    check_dcp_shapes(path, {f"model.{k}": v.shape for k, v in model.state_dict().items()})
    state = {}
    try:      # as torch's dcp_to_torch_save: the empty-state-dict planner rebuilds the saved structure in `state`
        _load_state_dict(state, storage_reader=dcp.FileSystemReader(path),
                         planner=_EmptyStateDictLoadPlanner(keys=set(parts)), no_dist=True)
    except (Exception, CheckpointException) as e:
        raise UnreadableCheckpoint(f"{path} is not a readable checkpoint ({' '.join(str(e).split())[:300]})") from e
    if state.get("model") is not None:
        tie_shared(model, state["model"])
    return {part: state.get(part) for part in parts}


# ----------------------------------------------------------------------------- model <-> checkpoint

def config_dict(config: GPTConfig):
    return asdict(config)


def saved_model_config(ckpt):
    """The checkpoint's GPTConfig fields; tokenizer_vocab_size, which older checkpoints lack, comes
    from the tokenizer of the checkpoint's data config."""
    config = dict(ckpt["model_config"])
    if config.get("tokenizer_vocab_size") is None:
        config["tokenizer_vocab_size"] = tokenizer_for(ckpt["config"]["data"]).n_vocab
    return config


def strip_compile_prefix(state_dict):
    """torch.compile wraps the model; its state-dict keys carry `_orig_mod.`."""
    return {k.replace("_orig_mod.", ""): v for k, v in state_dict.items()}


def model_from_checkpoint(ckpt, device="cpu"):
    """The GPT of a loaded checkpoint dict, with its weights."""
    model = GPT(GPTConfig.from_dict(saved_model_config(ckpt)))
    model.load_state_dict(strip_compile_prefix(ckpt["model"]))
    return model.to(device)


def load_model(path, device="auto", dtype="auto"):
    """Run directory or checkpoint (file or DCP directory) -> (uncompiled eval-mode model, its
    training config dict, device, checkpoint). device auto: CUDA when present; dtype auto: bf16
    weights on CUDA, fp32 elsewhere."""
    device = choose_device(device) if isinstance(device, str) else device
    dtype = choose_dtype(dtype, device)
    file, ckpt = load_checkpoint(path, dcp_parts=("model",))
    model = model_from_checkpoint(ckpt).to(device, dtype=dtype)
    return model.eval(), ckpt["config"], device, file


# ----------------------------------------------------------------------------- atomic writes

def atomic_write(path, write, needed_bytes=None):
    """Write `path` through `write(binary file)` so that it is complete or absent: a temp file
    beside it, fsync, rename over `path`, fsync of the directory. On failure the temp file is
    removed; a full disk raises DiskFullError (before writing when `needed_bytes` cannot fit)."""
    directory = os.path.dirname(os.path.abspath(path))
    free = shutil.disk_usage(directory).free
    if needed_bytes is not None and needed_bytes > free:
        raise disk_full(path, needed_bytes, free, "not enough free space")
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        cause = disk_full_cause(e)
        if cause is not None:
            raise disk_full(path, needed_bytes, shutil.disk_usage(directory).free, cause.strerror) from e
        raise
    fsync_directory(directory)


def disk_full_cause(error):
    """The OSError saying the disk (or the file-size limit) is full behind `error` (torch.save
    reports it as a RuntimeError whose context is the OSError), or None."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS:
            return error
        error = error.__cause__ or error.__context__
    return None


def disk_full(path, needed_bytes, free, reason):
    need = f"needs about {needed_bytes / 1e6:,.1f} MB, " if needed_bytes else ""
    error = DiskFullError(f"could not write {path}: {reason} ({need}{free / 1e6:,.1f} MB free in "
                          f"{os.path.dirname(os.path.abspath(path))}); free space there or write elsewhere")
    error.errno = errno.ENOSPC
    return error


def fsync_directory(directory):
    """Make a rename in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def disk_bytes(path):
    """Bytes of a checkpoint on disk: a file, or the files of a DCP directory."""
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def tensor_bytes(obj, seen=None):
    """Bytes of the tensor storages in a nested dict/list, each storage once (tied weights share
    one): the least a checkpoint of it takes on disk."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in obj)
    return 0


# ----------------------------------------------------------------------------- save, rotate

def save_checkpoint(run_dir, step, contents, keep_last):
    """Write ckpt_<step>.pt atomically, then rotate; -> its path."""
    path = checkpoint_path(run_dir, step)
    write_checkpoint_file(path, {"format": CHECKPOINT_FORMAT, "step": step, **contents})
    rotate(run_dir, step, keep_last)
    return path


def write_checkpoint_file(path, ckpt):
    """A checkpoint dict as one file (the full format), atomically."""
    atomic_write(path, lambda f: torch.save(ckpt, f), needed_bytes=tensor_bytes(ckpt))


class DcpSave:
    """One ckpt_<step>.dcp being written; every rank makes one, in step. Created: rank 0 has made
    the empty temp directory and every rank waited for it. write(): each rank writes its shards
    (async: copied to the CPU, then written by a thread while training goes on). finish(): waits
    for the write; rank 0 then adds DCP_META, renames the directory into place and rotates.

    Rank 0's write returns only after DCP's coordinator (rank 0) has gathered every rank's write
    result and written .metadata, so rank 0 renames a directory that every rank has finished."""

    def __init__(self, run_dir, step, contents, keep_last, master):
        self.path = checkpoint_path(run_dir, step, "dcp")
        self.tmp = self.path + ".tmp"
        self.run_dir, self.keep_last, self.master = run_dir, keep_last, master
        self.meta = {"format": CHECKPOINT_FORMAT, "step": step, **(contents or {})}
        self.future = None
        if master:
            if os.path.exists(self.tmp):
                shutil.rmtree(self.tmp)
            os.makedirs(self.tmp)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    def write(self, state, asynchronous=False, group=None):
        """state: {"model": ..., "optimizer": ...}, this rank's (sharded) state dicts. asynchronous:
        return once they are copied to the CPU, `group` (a process group nothing else uses, or None
        for one process) carrying the save's collectives from the writing thread."""
        try:
            with one_process_quietly() as one_process:
                if asynchronous:
                    self.future = dcp.async_save(state, checkpoint_id=self.tmp, process_group=group,
                                                 no_dist=one_process)
                else:
                    dcp.save(state, checkpoint_id=self.tmp, no_dist=one_process)
        except BaseException as e:
            self.failed(e)

    def done(self):
        return self.future is None or self.future.done()

    def finish(self):
        """-> the checkpoint's path (in place on rank 0's return)."""
        try:
            if self.future is not None:
                self.future.result()
            if self.master:
                atomic_write(os.path.join(self.tmp, DCP_META), lambda f: torch.save(self.meta, f))
                if os.path.exists(self.path):   # a directory cannot be swapped in one rename: move the old one
                    archive(self.run_dir, [os.path.basename(self.path)], "replaced")   # aside, never deleted
                os.replace(self.tmp, self.path)
                fsync_directory(self.run_dir)
        except BaseException as e:
            self.failed(e)
        if self.master:
            rotate(self.run_dir, checkpoint_step(self.path), self.keep_last)
        return self.path

    def failed(self, error):
        """A write failed: rank 0 removes the temp directory; raise `error`, or DiskFullError for a
        full disk."""
        if self.master:
            shutil.rmtree(self.tmp, ignore_errors=True)
        causes = [error, *(exc for exc, _ in getattr(error, "failures", {}).values())]  # DCP's: per rank
        cause = next((c for c in map(disk_full_cause, causes) if c is not None), None)
        if cause is None:
            raise error
        raise disk_full(self.path, None, shutil.disk_usage(self.run_dir).free, cause.strerror) from error


def rotate(run_dir, step, keep_last):
    """Keep checkpoint `step` and the newest keep_last - 1 readable older ones; delete the other
    older ones. Newer checkpoints are never touched."""
    kept = 1
    for file in reversed(checkpoint_files(run_dir)):
        if checkpoint_step(file) >= step:
            continue
        if kept < keep_last and is_readable(file):
            kept += 1
        else:
            remove_checkpoint(file)


# ----------------------------------------------------------------------------- recovery at start

def remove_stale_temp_files(run_dir):
    """Delete the temp files (and DCP temp directories) a killed writer left (only the names a
    training run writes)."""
    for name in sorted(os.listdir(run_dir)):
        if TEMP_NAME.fullmatch(name):
            path = os.path.join(run_dir, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            warn(f"removed {os.path.join(run_dir, name)}, left by an interrupted write")


def archive(run_dir, names, why):
    """Move `names` (top-level entries of run_dir) into a new archive/<time>-<why>/; -> its path."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest = os.path.join(run_dir, ARCHIVE_DIR, f"{stamp}-{why}")
    n = 1
    while os.path.exists(dest):
        n += 1
        dest = os.path.join(run_dir, ARCHIVE_DIR, f"{stamp}-{why}-{n}")
    os.makedirs(dest)
    for name in names:
        os.replace(os.path.join(run_dir, name), os.path.join(dest, name))
    fsync_directory(run_dir)
    return dest


def archive_newer_checkpoints(run_dir, step):
    """Move checkpoints newer than `step` (the one a run resumes from) out of its way."""
    newer = [os.path.basename(f) for f in checkpoint_files(run_dir) if checkpoint_step(f) > step]
    if newer:
        dest = archive(run_dir, newer, f"after-step-{step}")
        warn(f"moved {', '.join(newer)} (newer than the resumed step {step}) to {dest}")


def archive_earlier_run(run_dir):
    """Move every file of an earlier run (all but the lock and the archive) into the archive."""
    names = [n for n in sorted(os.listdir(run_dir)) if n not in (LOCK_NAME, ARCHIVE_DIR)]
    if names:
        dest = archive(run_dir, names, "earlier-run")
        print(f"moved the earlier run's {', '.join(names)} to {dest}")


# ----------------------------------------------------------------------------- lock

class RunLock:
    """`.lock` in a run directory: {"pid", "host"} of the one training run that uses it."""

    def __init__(self, run_dir):
        self.path = os.path.join(run_dir, LOCK_NAME)
        self.me = {"pid": os.getpid(), "host": socket.gethostname()}
        self.held = False

    def acquire(self):
        for _ in range(3):        # a lock that vanishes or goes stale between two looks: try again
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self.holder()
                if holder is None:
                    continue
                if not self.is_stale(holder):
                    raise RunDirectoryLocked(self.busy_message(holder)) from None
                warn(f"taking over {self.path}: its run (pid {holder.get('pid')} on {holder.get('host')}) is gone")
                self.remove_if(holder)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.me, f)
                f.flush()
                os.fsync(f.fileno())
            self.held = True
            return
        raise RunDirectoryLocked(f"could not take the lock {self.path}; try again")

    def release(self):
        if self.held:
            self.remove_if(self.me)
            self.held = False

    def holder(self):
        """The lock's content; None when the file is gone; {} when it does not parse."""
        try:
            with open(self.path) as f:
                content = f.read()
        except FileNotFoundError:
            return None
        try:
            holder = json.loads(content)
        except json.JSONDecodeError:
            return {}
        return holder if isinstance(holder, dict) else {}

    def is_stale(self, holder):
        """The holder ran on this host and its process is gone."""
        if holder.get("host") != self.me["host"] or not isinstance(holder.get("pid"), int):
            return False
        if holder["pid"] == self.me["pid"]:
            return True
        try:
            os.kill(holder["pid"], 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def remove_if(self, holder):
        """Remove the lock file if it still names `holder`."""
        if self.holder() == holder:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)

    def busy_message(self, holder):
        run_dir = os.path.dirname(self.path)
        if not holder:
            return (f"{run_dir} is locked by {self.path}, which names no process; if no training run uses "
                    f"this directory, delete {self.path}")
        who = f"pid {holder.get('pid')} on host {holder.get('host')}"
        if holder.get("host") == self.me["host"]:
            fix = "wait for it to finish or stop it, or use another train.out_dir"
        else:
            fix = f"if that run is gone, delete {self.path}; or use another train.out_dir"
        return f"{run_dir} is in use by another training run ({who}); {fix}"


@contextlib.contextmanager
def locked_run_dir(run_dir):
    """Create run_dir if needed and hold its lock; on exit release it, and remove run_dir again if
    this call created it and nothing was written there (a run that failed to start)."""
    created = not os.path.exists(run_dir)
    os.makedirs(run_dir, exist_ok=True)
    lock = RunLock(run_dir)
    try:
        lock.acquire()
        yield lock
    finally:
        lock.release()
        if created and not os.listdir(run_dir):
            os.rmdir(run_dir)
