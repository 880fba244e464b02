"""Several nodes on one machine: two torchrun launches with --nnodes=2 (one process each, c10d
rendezvous on a free localhost port, gloo) train exactly as one process with the same global batch,
and a run directory that is not shared between the nodes is refused on every rank."""
import os
import socket
import subprocess
import sys

import pytest

from tests.test_train import ROOT, TINY, run, train_losses

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two_nodes(args_of_node):
    """torchrun on "node" 0 and 1 at once (args_of_node(i): train.py's arguments there) -> their processes."""
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    port = free_port()
    procs = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
               "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
               "--rdzv_id=test-multinode", "--max_restarts=0", "train.py"] + args_of_node(node)
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outputs = [p.communicate(timeout=600) for p in procs]
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]


def test_two_nodes_train_as_one_process_with_the_same_global_batch(tmp_path):
    """Rank r reads sequences (k * world + r) * B ... at step k, which is what one process reads in its
    micro-steps 2k and 2k + 1 with gradient accumulation 2: the same tokens, and DDP's mean of the
    two ranks' gradients is the accumulated mean. Losses agree to fp32 rounding (rel 1e-5)."""
    B, T = 4, 32
    common = TINY + ["train.max_steps=4", f"train.global_batch_tokens={2 * B * T}", "train.ckpt_interval=100",
                     "train.device=cpu"]
    run("train.py", common + [f"train.out_dir={tmp_path / 'one'}"])
    two = tmp_path / "two"
    results = launch_two_nodes(lambda node: [a for a in common if not a.startswith("WANDB")]
                               + [f"train.out_dir={two}"])
    for code, out, err in results:
        assert code == 0, f"{out[-2000:]}\n{err[-4000:]}"
    one, both = train_losses(tmp_path / "one"), train_losses(two)
    assert sorted(both) == [1, 2, 3, 4]
    assert both == pytest.approx(one, rel=1e-5)
    assert sorted(os.listdir(two)) == ["ckpt_4.pt", "config.yaml", "loss.png", "metrics.jsonl"]
    banners = [line for _, out, _ in results for line in out.splitlines() if line.startswith("model:")]
    assert len(banners) == 1 and "2 rank(s)" in banners[0] and "grad accumulation 1" in banners[0]


def test_a_run_dir_local_to_each_node_is_refused(tmp_path):
    """Each "node" given its own train.out_dir, as a node-local disk would: every rank stops with the error."""
    results = launch_two_nodes(lambda node: [a for a in TINY if not a.startswith("WANDB")]
                               + ["train.max_steps=2", "train.device=cpu", f"train.out_dir={tmp_path / str(node)}"])
    for code, _, err in results:
        assert code != 0 and "is not the same directory on every node" in err
    assert not (tmp_path / "0").exists() and not (tmp_path / "1").exists()   # nothing left behind
