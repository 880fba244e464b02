"""Faults during training, with real train.py processes on the CPU: kill -9 at random points and in the
middle of a checkpoint write, SIGTERM and SIGINT, a full disk, a corrupt newest checkpoint, a resume
from an older checkpoint by hand, two runs on one directory, a dead rank under torchrun. After each:
nothing earlier is lost, no partial or temp file is left, metrics.jsonl holds every step once, and the
resumed losses equal an uninterrupted run's bit for bit. Also the checkpoint module's rotation,
discovery and lock on small files."""
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from test_train import ROOT, TINY, run, train_losses

from model.checkpoint import (CHECKPOINT_FORMAT, RunDirectoryLocked, RunLock, checkpoint_files, is_readable,
                              load_checkpoint, load_model, locked_run_dir, save_checkpoint)

STEPS = 12
ARGS = TINY + ["train.global_batch_tokens=128", f"train.max_steps={STEPS}", "train.keep_last=3"]


def train_args(out, *extra):
    return [a for a in ARGS if not a.startswith("WANDB_MODE")] + [f"train.out_dir={out}", *extra]


def start(out, *extra, preexec_fn=None):
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.Popen([sys.executable, "train.py"] + train_args(out, *extra), cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn)


def logged_steps(out):
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line)["step"] for line in f if '"loss"' in line and line.endswith("\n")]


def wait_for(condition, proc, timeout=300):
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, f"train.py ended early ({proc.returncode}): {proc.communicate()[1][-3000:]}"
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def stop_mid_write(proc, out):
    """Stop train.py (SIGSTOP) while a checkpoint's .tmp file exists, so that a kill lands mid-write. Seeing the
    file and stopping the process race with the write's rename: when the write won, let the run go on to the next
    checkpoint (ckpt_interval=1) and try again. Linux: the stop is confirmed in /proc before the files are read."""
    has_tmp = lambda: any(n.endswith(".pt.tmp") for n in os.listdir(out))  # noqa: E731
    while True:
        wait_for(has_tmp, proc)
        proc.send_signal(signal.SIGSTOP)
        wait_for(lambda: process_state(proc.pid) == "T", proc)
        if has_tmp():
            return
        proc.send_signal(signal.SIGCONT)


def process_state(pid):
    """R (running), S (sleeping), T (stopped), ...: the field after the command name in /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def assert_intact(out):
    """No temp file or lock left behind, every checkpoint complete."""
    names = os.listdir(out)
    assert not [n for n in names if n.endswith(".tmp")], names
    assert ".lock" not in names, names
    for file in checkpoint_files(out):
        assert is_readable(file), file


def assert_matches_reference(out, reference):
    """Every step logged once, and the losses of the uninterrupted run, bit for bit."""
    assert logged_steps(out) == list(range(1, STEPS + 1))
    assert train_losses(out) == reference


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """The uninterrupted run: checkpoints at 4, 8 and 12 (other intervals elsewhere: checkpoints do not
    change the losses)."""
    out = tmp_path_factory.mktemp("reference")
    run("train.py", train_args(out, "train.ckpt_interval=4"))
    assert sorted(os.listdir(out)) == ["ckpt_12.pt", "ckpt_4.pt", "ckpt_8.pt", "config.yaml", "loss.png",
                                       "metrics.jsonl"]
    return out


@pytest.fixture(scope="module")
def reference(reference_run):
    return train_losses(reference_run)


def copy_at_step_4(reference_run, dest):
    """The reference run as it was after step 4 plus later metrics records (which a resume must drop)."""
    shutil.copytree(reference_run, dest, ignore=lambda _, names: ["ckpt_8.pt", "ckpt_12.pt"])
    return dest


# ----------------------------------------------------------------------------- kill -9, signals

@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2, "mid-write"])
def test_kill_9_then_resume_loses_nothing(tmp_path, reference, seed):
    """SIGKILL at a random moment after the first step (seeded), or while a checkpoint is being
    written; the resumed run ends exactly as the uninterrupted one."""
    proc = start(tmp_path, "train.ckpt_interval=1")
    wait_for(lambda: logged_steps(tmp_path), proc)
    if seed == "mid-write":
        stop_mid_write(proc, tmp_path)
    else:
        time.sleep(random.Random(seed).uniform(0, 1.5))
    proc.kill()
    proc.communicate()
    left = os.listdir(tmp_path)
    if seed == "mid-write":
        assert any(n.endswith(".pt.tmp") for n in left), left          # the kill landed mid-write
    for file in checkpoint_files(tmp_path):                          # written ones are whole
        assert is_readable(file), file
    resumed = run("train.py", train_args(tmp_path, "train.ckpt_interval=1"))
    if seed == "mid-write":
        assert "left by an interrupted write" in resumed.stderr
    assert_intact(tmp_path)
    assert_matches_reference(tmp_path, reference)


@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_saves_at_the_step_boundary_and_resume_matches(tmp_path, reference, sig, code):
    proc = start(tmp_path, "train.ckpt_interval=100")
    wait_for(lambda: len(logged_steps(tmp_path)) >= 2, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == code, err[-2000:]
    [saved] = checkpoint_files(tmp_path)
    assert "interrupted at step" in out and f"saved {saved}" in out
    assert_intact(tmp_path)
    run("train.py", train_args(tmp_path, "train.ckpt_interval=100"))
    assert_intact(tmp_path)
    assert_matches_reference(tmp_path, reference)


# ----------------------------------------------------------------------------- full disk

def file_size_limit(limit):
    """preexec_fn: writes past `limit` bytes fail with EFBIG (SIGXFSZ ignored, as a full disk fails)."""
    def apply():
        import resource
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def assert_disk_full_failure(proc, out, reason):
    """train.py stopped with one line naming the file, the reason and the bytes (about the size of the
    checkpoint it could not write); only the earlier checkpoint is there."""
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert "Traceback" not in stderr and lines[-1].startswith("train.py: error: could not write "), stderr[-3000:]
    assert f"ckpt_8.pt: {reason} (needs about " in lines[-1] and " MB free in " in lines[-1], lines[-1]
    needed = float(lines[-1].split("needs about ")[1].split(" MB")[0]) * 1e6
    assert 0.99 < needed / os.path.getsize(os.path.join(out, "ckpt_4.pt")) <= 1
    assert sorted(n for n in os.listdir(out) if n.startswith("ckpt")) == ["ckpt_4.pt"]
    assert_intact(out)


@pytest.mark.slow
def test_write_past_the_file_size_limit_fails_cleanly_and_resume_matches(tmp_path, reference_run, reference):
    """The checkpoint write fails part-way (EFBIG, as ENOSPC would): its temp file goes, the earlier
    checkpoint stays, the error names the bytes; with room again the run resumes exactly."""
    out = copy_at_step_4(reference_run, tmp_path / "run")
    proc = start(out, "train.ckpt_interval=4", preexec_fn=file_size_limit(8 << 20))
    assert_disk_full_failure(proc, out, "File too large")
    run("train.py", train_args(out, "train.ckpt_interval=4"))
    assert_intact(out)
    assert_matches_reference(out, reference)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 60 MB tmpfs (room for one checkpoint and a half), where the machine lets us mount one."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=60m", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.slow
def test_full_tmpfs_fails_before_writing_and_resume_elsewhere_matches(small_tmpfs, tmp_path, reference_run,
                                                                      reference):
    out = copy_at_step_4(reference_run, small_tmpfs / "run")
    proc = start(out, "train.ckpt_interval=4")
    assert_disk_full_failure(proc, out, "not enough free space")
    moved = shutil.copytree(out, tmp_path / "moved")
    run("train.py", train_args(moved, "train.ckpt_interval=4"))
    assert_intact(moved)
    assert_matches_reference(moved, reference)


# ----------------------------------------------------------------------------- corrupt and older checkpoints

@pytest.mark.slow
def test_corrupt_newest_checkpoint_is_skipped_and_kept(tmp_path, reference_run, reference):
    """sample.py, eval's loader and the resume skip a truncated newest checkpoint (naming it), use the
    older good one, and never delete either; stray names are ignored."""
    out = tmp_path / "run"
    shutil.copytree(reference_run, out)
    os.remove(out / "ckpt_12.pt")
    good_8 = (out / "ckpt_8.pt").read_bytes()
    (out / "ckpt_8.pt").write_bytes(good_8[:len(good_8) // 2])
    (out / "ckpt_6_backup.pt").write_bytes(b"not a checkpoint")
    (out / "ckpt_3.pt.tmp").write_bytes(b"a killed writer's")

    proc = run("sample.py", [f"ckpt={out}", "max_new_tokens=4", "temperature=0"])
    assert f"warning: skipping {out / 'ckpt_8.pt'} is not a readable checkpoint" in proc.stderr
    assert load_model(str(out))[3] == str(out / "ckpt_4.pt")          # eval.py's loader
    proc = run("sample.py", [f"ckpt={out / 'ckpt_8.pt'}"], check=False)
    assert proc.returncode == 2 and f"the newest readable checkpoint beside it is {out / 'ckpt_4.pt'}" in proc.stderr

    resumed = run("train.py", train_args(out, "train.ckpt_interval=4"))
    assert "resuming at step 4" in resumed.stdout and "skipping" in resumed.stderr
    [archived] = os.listdir(out / "archive")
    assert archived.endswith("-after-step-4") and os.listdir(out / "archive" / archived) == ["ckpt_8.pt"]
    assert len((out / "archive" / archived / "ckpt_8.pt").read_bytes()) == len(good_8) // 2
    assert (out / "ckpt_6_backup.pt").read_bytes() == b"not a checkpoint"
    assert steps_in(out) == [4, 8, 12]
    assert_intact(out)
    assert_matches_reference(out, reference)


@pytest.mark.slow
def test_resume_from_an_older_checkpoint_by_hand_moves_the_newer_ones_aside(tmp_path, reference_run, reference):
    out = tmp_path / "run"
    shutil.copytree(reference_run, out)
    run("train.py", train_args(out, "train.ckpt_interval=4", "train.keep_last=1", f"train.resume={out / 'ckpt_4.pt'}"))
    [archived] = os.listdir(out / "archive")
    assert sorted(os.listdir(out / "archive" / archived)) == ["ckpt_12.pt", "ckpt_8.pt"]
    assert [os.path.basename(f) for f in checkpoint_files(out)] == ["ckpt_12.pt"]     # keep_last=1
    assert_intact(out)
    assert_matches_reference(out, reference)


# ----------------------------------------------------------------------------- two runs, one directory

@pytest.mark.slow
def test_second_run_on_a_directory_refuses_while_the_first_lives(tmp_path):
    first = start(tmp_path, "train.max_steps=100000", "train.ckpt_interval=100000")
    wait_for(lambda: len(logged_steps(tmp_path)) >= 1, first)
    second = run("train.py", train_args(tmp_path), check=False)
    assert second.returncode == 2
    assert f"in use by another training run (pid {first.pid} on host {socket.gethostname()})" in second.stderr
    assert first.poll() is None
    first.send_signal(signal.SIGINT)
    assert first.wait(timeout=300) == 130
    first.communicate()
    steps = logged_steps(tmp_path)
    assert steps == list(range(1, len(steps) + 1))
    assert [os.path.basename(f) for f in checkpoint_files(tmp_path)] == [f"ckpt_{steps[-1]}.pt"]
    assert_intact(tmp_path)


@pytest.mark.slow
def test_a_dead_holders_lock_is_taken_over(tmp_path, reference):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / ".lock").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    resumed = run("train.py", train_args(tmp_path, "train.ckpt_interval=100"))
    assert f"taking over {tmp_path / '.lock'}: its run (pid {dead.pid}" in resumed.stderr
    assert_intact(tmp_path)
    assert_matches_reference(tmp_path, reference)


# ----------------------------------------------------------------------------- a dead rank

def children(pid):
    """Process ids below `pid` (from /proc)."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for child in map(int, f.read().split()):
                found += [child] + children(child)
    return found


def rank_of(pid):
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    return int(env[b"RANK"]) if b"RANK" in env else None


@pytest.mark.slow
@pytest.mark.distributed
def test_dead_rank_under_torchrun_then_resume_matches(tmp_path):
    args = [a for a in ARGS if not a.startswith("WANDB_MODE")] + ["train.ckpt_interval=3",
                                                                 "train.global_batch_tokens=256"]
    reference = tmp_path / "reference"
    run("train.py", args + [f"train.out_dir={reference}"], torchrun=2)
    out = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             "train.py"] + args + [f"train.out_dir={out}"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(logged_steps(out)) >= 4, proc)
    [rank1] = [p for p in children(proc.pid) if rank_of(p) == 1]
    os.kill(rank1, signal.SIGKILL)
    proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert checkpoint_files(out)
    for file in checkpoint_files(out):
        assert is_readable(file), file
    run("train.py", args + [f"train.out_dir={out}"], torchrun=2)
    assert_intact(out)
    assert logged_steps(out) == list(range(1, STEPS + 1))
    assert train_losses(out) == train_losses(reference)


# ----------------------------------------------------------------------------- the checkpoint module

def save_tiny(run_dir, step, keep_last=100):
    return save_checkpoint(str(run_dir), step, {"model": {"w": torch.randn(3)}}, keep_last)


def steps_in(run_dir):
    return [int(os.path.basename(f)[5:-3]) for f in checkpoint_files(str(run_dir))]


def test_rotation_keeps_the_newest_readable_and_never_the_newer_ones(tmp_path):
    for step in (2, 4, 6):
        save_tiny(tmp_path, step)
    (tmp_path / "ckpt_5.pt").write_bytes(b"corrupt")
    (tmp_path / "ckpt_40.pt").write_bytes(b"a foreign run's, newer than anything written here")
    (tmp_path / "ckpt_6_backup.pt").write_bytes(b"stray")
    save_tiny(tmp_path, 7, keep_last=3)              # keeps 7 and the two newest readable older ones
    assert steps_in(tmp_path) == [4, 6, 7, 40]
    save_tiny(tmp_path, 8, keep_last=1)
    assert steps_in(tmp_path) == [8, 40]
    assert (tmp_path / "ckpt_6_backup.pt").exists()


def test_discovery_skips_unreadable_newer_files_and_ignores_stray_names(tmp_path, capsys):
    good = save_tiny(tmp_path, 3)
    (tmp_path / "ckpt_9.pt").write_bytes(b"truncated")
    torch.save({"not": "ours"}, tmp_path / "ckpt_10.pt")
    for stray in ("ckpt_6_backup.pt", "ckpt_3.pt.tmp", "ckpt_.pt", "ckpt_x.pt"):
        (tmp_path / stray).write_bytes(b"stray")
    file, ckpt = load_checkpoint(str(tmp_path))
    assert file == good and ckpt["format"] == CHECKPOINT_FORMAT and ckpt["step"] == 3
    err = capsys.readouterr().err
    assert "skipping" in err and "ckpt_10.pt was not written by this repo's train.py" in err and "ckpt_9.pt" in err
    assert steps_in(tmp_path) == [3, 9, 10]


def test_a_lock_is_exclusive_and_released(tmp_path):
    with locked_run_dir(str(tmp_path / "run")):
        other = RunLock(str(tmp_path / "run"))
        other.me = {"pid": os.getpid() + 1, "host": other.me["host"]}      # how another process sees it
        with pytest.raises(RunDirectoryLocked, match=f"in use by another training run \\(pid {os.getpid()} on"):
            other.acquire()
    assert not (tmp_path / "run").exists()                # made and left empty: removed again


def test_a_lock_from_another_host_is_reported_not_taken(tmp_path):
    (tmp_path / ".lock").write_text(json.dumps({"pid": 12345, "host": "elsewhere"}))
    with pytest.raises(RunDirectoryLocked, match=f"pid 12345 on host elsewhere.*delete {tmp_path / '.lock'}"):
        RunLock(str(tmp_path)).acquire()
    assert json.loads((tmp_path / ".lock").read_text())["host"] == "elsewhere"
