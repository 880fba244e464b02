"""train.fp8 (model/fp8.py): which layers become torchao Float8Linear, checkpoints unchanged, the device check.
The float8 matmuls themselves need a GPU of compute capability >= 8.9 (the gpu-marked test); the conversion
needs torchao, an optional package (requirements.txt), installed on the GPU machines."""
import pytest
import torch
import torch.nn as nn
from test_train import TINY, run

from model.fp8 import (FP8_MIN_CAPABILITY, check_fp8_config, check_fp8_device, convert_to_fp8, fp8_layer_names,
                       fp8_left_out)
from model.gpt import GPT, GPTConfig


CONFIG = dict(n_layer=2, n_embd=64, n_head=4, head_dim=16, vocab_size=128, block_size=32, mlp_multiple_of=64)


def needs_torchao():
    """torchao is optional (requirements.txt says why): installed with the GPU wheels, where fp8 runs."""
    return pytest.importorskip("torchao.float8.float8_linear", reason="train.fp8's conversion needs torchao "
                               "(pip install torchao; a GPU install)").Float8Linear


def test_the_blocks_linear_layers_are_converted_and_the_head_is_not():
    Float8Linear = needs_torchao()
    model = GPT(GPTConfig(**CONFIG))
    names = fp8_layer_names(model)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert names == [n for n in linears if n.startswith("blocks.")] and "lm_head" in linears
    assert len(names) == 2 * 5                                   # qkv, out, SwiGLU gate, up, down per block
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert convert_to_fp8(model) == sorted(names)
    assert all(block.mlp.fused == "none" for block in model.blocks)   # the packed path would bypass Float8Linear
    modules = dict(model.named_modules())
    assert all(type(modules[n]) is Float8Linear for n in names) and type(modules["lm_head"]) is nn.Linear
    after = model.state_dict()                                    # checkpoints are unchanged
    assert after.keys() == state.keys() and all(torch.equal(after[k], v) for k, v in state.items())
    GPT(GPTConfig(**CONFIG)).load_state_dict(after)


def test_widths_that_are_not_multiples_of_16_stay_unconverted():
    odd = GPT(GPTConfig(**{**CONFIG, "mlp_multiple_of": 1}))                          # SwiGLU hidden 170
    odd_mlp = fp8_layer_names(odd)
    assert odd_mlp and all(".mlp." not in n for n in odd_mlp)
    assert fp8_left_out(odd) == ("6 block linear layers stay bf16, a width not a multiple of 16 (e.g. "
                                 "blocks.0.mlp.w_gate: 64 -> 170) (model.mlp_multiple_of=16 rounds the SwiGLU's "
                                 "hidden size so that they convert)")
    assert fp8_left_out(GPT(GPTConfig(**CONFIG))) == ""
    model = GPT(GPTConfig(**{**CONFIG, "n_embd": 72, "n_head": 3, "head_dim": 24}))   # 72 % 16 = 8
    assert fp8_layer_names(model) == []
    castle = GPT(GPTConfig(**{**CONFIG, "attention": "castle"}))
    assert any(".attn." in n for n in fp8_layer_names(castle))   # CASTLE's projections are ordinary linears


def test_fp8_on_cpu_is_refused_before_training(tmp_path):
    proc = run("train.py", TINY + [f"train.out_dir={tmp_path}/run", "train.max_steps=2", "train.fp8=true"],
               check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith("this run is on cpu: set train.fp8=false")
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").glob("ckpt_*"))
    with pytest.raises(ValueError, match="train.fp8=true .* compute capability >= 8.9"):
        check_fp8_device(torch.device("cpu"))


def test_fp8_refuses_an_explicitly_packed_swiglu():
    for packed in ("packed", "triton"):
        with pytest.raises(ValueError, match=f"model.fused_swiglu={packed} .* set model.fused_swiglu=auto"):
            check_fp8_config(GPTConfig(**CONFIG, fused_swiglu=packed))
    for fine in ("auto", "none"):
        check_fp8_config(GPTConfig(**CONFIG, fused_swiglu=fine))


@pytest.mark.gpu
def test_fp8_training_steps_follow_bf16_on_gpu():
    """A few steps of a small model: float8 losses within a few percent of bf16's from the same init."""
    if torch.cuda.get_device_capability() < FP8_MIN_CAPABILITY:
        pytest.skip("needs float8 matmuls (compute capability >= 8.9)")
    needs_torchao()
    torch.manual_seed(0)
    config = GPTConfig(**{**CONFIG, "n_embd": 256, "n_head": 4, "head_dim": 64, "vocab_size": 512, "block_size": 128})
    models = [GPT(config).cuda() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    convert_to_fp8(models[1])
    idx = torch.randint(0, 512, (8, 129), device="cuda")
    losses = []
    for model in models:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(5):
            with torch.autocast("cuda", torch.bfloat16):
                _, loss = model(idx[:, :-1], targets=idx[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    assert abs(losses[1] - losses[0]) < 0.03 * losses[0], losses
