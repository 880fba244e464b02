"""Hugging Face export and import (model/hf, scripts/export_hf.py, scripts/import_hf.py) against the real
transformers library: tiny random models of every variant (CPU, fp32, no network)."""
import json
import os
import shutil
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from transformers import (AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                          LlamaForCausalLM)

from data.tokenizer import get_tokenizer
from evaluation.lm_eval_adapter import data_root
from model.checkpoint import load_model
from model.gpt import GPT, NEUTRAL_OPTIONS, GPTConfig, mlp_hidden_size
from model.hf.convert import atomic_dir, checkpoint_dict, read_checkpoint
from scripts import compare_lm_eval_hf, export_hf, import_hf

REPO = Path(__file__).resolve().parents[1]
EOT, N_TOKENS, VOCAB = 50256, 50257, 50304
TINY = ["model.n_layer=2", "model.n_embd=64", "model.n_head=4", "model.head_dim=16"]
# every configs/model group, plus options the groups leave at one value: name -> (group, overrides)
VARIANTS = {
    "llama": ("llama", []), "transformer_llama": ("transformer_llama", []), "gpt2": ("gpt2", []),
    "castle": ("castle", []), "castle_swl": ("castle_swl", ["model.castle_window=5"]),
    "fox_llama": ("fox_llama", []), "transformer_pro": ("transformer_pro", []), "fox_pro": ("fox_pro", []),
    "llama_bias_untied": ("llama", ["model.bias=true", "model.tie_embeddings=false"]),
    "gpt2_no_bias_untied": ("gpt2", ["model.bias=false", "model.tie_embeddings=false"]),
    "castle_rope_qkv": ("castle", ["model.castle_rope=qkv"]),
    "castle_no_causal_keys": ("castle", ["model.castle_causal_keys=false"]),
    "castle_swl_no_silu": ("castle_swl", ["model.castle_window=5", "model.castle_silu=false"]),
    "fox_pro_per_head_qk_norm": ("fox_pro", ["model.qk_norm_shared=false"]),
    "fox_llama_bias_only": ("fox_llama", ["model.fgate=bias_only"]),
    "fox_pro_fixed": ("fox_pro", ["model.fgate=fixed", "model.fgate_tmin=2", "model.fgate_tmax=64"]),
}
STOCK = {"llama": LlamaForCausalLM, "transformer_llama": LlamaForCausalLM, "llama_bias_untied": LlamaForCausalLM,
         "gpt2": GPT2LMHeadModel, "gpt2_no_bias_untied": GPT2LMHeadModel}


def train_config(overrides):
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        # train.out_dir set: its default names the model group through Hydra's runtime choices
        return OmegaConf.to_container(compose(config_name="config", overrides=overrides + ["train.out_dir=run"]),
                                      resolve=True)


def random_model(variant, seq_len=24):
    """A model of `variant` with weights far from their initialisation (norm scales off 1, large enough
    that every layer matters), whose padding rows (ids >= 50257) win the argmax unless generation
    suppresses them."""
    group, overrides = VARIANTS[variant]
    cfg = train_config([f"model={group}", *TINY, f"train.seq_len={seq_len}", *overrides])
    model = GPT(GPTConfig.from_dict({**cfg["model"], "tokenizer_vocab_size": N_TOKENS}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 1 or "wte" in name or "wpe" in name
                                               else p.size(-1) ** -0.5))
        model.lm_head.weight[N_TOKENS:] *= 4
    return model.eval(), cfg


def save_run(model, cfg, run_dir):
    run_dir.mkdir(parents=True)
    torch.save(checkpoint_dict(model.config, model.state_dict(), cfg), run_dir / "ckpt_3.pt")
    return run_dir


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(variant, --format) -> (our model, checkpoint run dir, exported directory), each built once."""
    cache = {}

    def get(variant, fmt="auto"):
        if (variant, fmt) not in cache:
            torch.manual_seed(list(VARIANTS).index(variant))
            model, cfg = random_model(variant)
            root = tmp_path_factory.mktemp(variant)
            run = save_run(model, cfg, root / "run")
            export_hf.main(["--ckpt", str(run), "--out", str(root / "hf"), "--format", fmt])
            cache[variant, fmt] = model, run, root / "hf"
        return cache[variant, fmt]
    return get


def load_hf(path):
    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()


def prompt(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.cat([torch.tensor([[EOT]]), torch.randint(0, N_TOKENS, (1, n - 1), generator=gen)], dim=1)


# ----------------------------------------------------------------------------- export

@pytest.mark.parametrize("variant", VARIANTS)
def test_export_logits_and_greedy_generation_equal_ours(variant, exported):
    model, _, out = exported(variant)
    hf = load_hf(out)
    expected = STOCK.get(variant)
    assert type(hf).__name__ == (expected.__name__ if expected else "AttnLMForCausalLM")
    assert (out / "modeling_attn_lm.py").is_file() == (expected is None)
    x = torch.randint(0, VOCAB, (2, model.config.block_size))
    with torch.no_grad():
        ours, theirs = model(x)[0], hf(x, labels=x)
        _, loss = model(x[:, :-1], targets=x[:, 1:])        # transformers shifts the labels itself
    assert (ours - theirs.logits).abs().max().item() <= 1e-4
    assert theirs.loss.item() == pytest.approx(loss.item(), abs=1e-5)
    idx = prompt(6, seed=1)
    with torch.no_grad():
        assert model(idx)[0][0, -1].argmax() >= N_TOKENS       # without suppression a padding id would win
    ours = model.generate(idx, 10, temperature=0, eot_token=EOT)
    theirs = hf.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=10, do_sample=False)
    assert theirs.tolist() == ours.tolist()
    assert json.loads((out / "generation_config.json").read_text())["suppress_tokens"] == list(range(N_TOKENS, VOCAB))


@pytest.mark.parametrize("variant", ["llama", "castle_swl", "fox_pro", "gpt2_no_bias_untied"])
def test_import_of_an_export_gives_back_the_checkpoint_bit_exactly(variant, exported, tmp_path):
    model, run, out = exported(variant)
    import_hf.main(["--src", str(out), "--out", str(tmp_path / "back")])
    config, state, cfg = read_checkpoint(tmp_path / "back")
    if variant.startswith("gpt2"):             # GPT-2 always has biases: ours come back as explicit zeros
        assert all(not v.any() for k, v in state.items() if k not in model.state_dict())
        state = {k: v for k, v in state.items() if k in model.state_dict()}
        config = replace(config, bias=False)
    if variant in STOCK:     # stock configs state the MLP width, not the ratio and rounding that gave it
        assert config.mlp_hidden == mlp_hidden_size(model.config)
        config = replace(config, mlp_hidden=None)
    assert config == model.config
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert cfg["model"]["attention"] == model.config.attention


@pytest.mark.parametrize("variant", ["fox_pro", "castle_swl", "transformer_pro", "gpt2"])
def test_custom_model_generates_left_padded_batches_like_single_prompts(variant, exported):
    """Batched generate() pads on the left: keys, KV-shift and (learned) positions must ignore the padding."""
    _, _, out = exported(variant, "custom")
    hf = load_hf(out)
    short, long = prompt(4, seed=2), prompt(9, seed=3)
    batch = torch.cat([torch.cat([torch.full((1, 5), EOT), short], dim=1), long])
    mask = torch.ones_like(batch)
    mask[0, :5] = 0
    together = hf.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False)[:, 9:]
    with torch.no_grad():
        padded = hf(batch, attention_mask=mask).logits
    for row, p in enumerate((short, long)):
        with torch.no_grad():
            assert (padded[row, -p.size(1):] - hf(p).logits[0]).abs().max() <= 1e-4
        alone = hf.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=6, do_sample=False)[:, p.size(1):]
        assert together[row].tolist() == alone[0].tolist()


def test_format_custom_and_stock(exported, tmp_path):
    model, run, _ = exported("llama")
    export_hf.main(["--ckpt", str(run), "--out", str(tmp_path / "custom"), "--format", "custom", "--check"])
    hf = load_hf(tmp_path / "custom")
    x = torch.randint(0, VOCAB, (1, 20))
    with torch.no_grad():
        assert type(hf).__name__ == "AttnLMForCausalLM" and (model(x)[0] - hf(x).logits).abs().max() <= 1e-4
    _, fox_run, _ = exported("fox_llama")
    with pytest.raises(SystemExit) as e:
        export_hf.main(["--ckpt", str(fox_run), "--out", str(tmp_path / "stock"), "--format", "stock"])
    assert e.value.code == 2 and not (tmp_path / "stock").exists()


def test_custom_config_defaults_are_gptconfigs():
    """modeling_attn_lm.py cannot import model/gpt.py: its copy of GPTConfig's fields must not drift."""
    from model.hf.modeling_attn_lm import MODEL_DEFAULTS
    assert MODEL_DEFAULTS == {f.name: f.default for f in fields(GPTConfig)
                              if f.name not in ("tie_embeddings", *NEUTRAL_OPTIONS)}   # HF runs unfused


def test_tokenizer_encodes_real_text_like_tiktoken(exported):
    _, _, out = exported("llama")
    hf_tok, tok = AutoTokenizer.from_pretrained(out), get_tokenizer("gpt2")
    texts = [(REPO / "data" / "sample" / "night_and_day.txt").read_text()[:300_000],
             "  leading spaces\n\n\ttabs  and trailing   ", "naïve café, 日本語 😀 \u200b",
             "it's they'll I'M we've 1234567"]
    for text in texts:
        ids = tok.encode_ordinary(text)
        assert hf_tok(text, add_special_tokens=False)["input_ids"] == ids
        assert hf_tok.decode(ids) == text
    assert (hf_tok.eos_token_id, hf_tok.bos_token_id, len(hf_tok)) == (EOT, EOT, N_TOKENS)


# ----------------------------------------------------------------------------- import

def hf_gpt2(**kw):
    c = dict(vocab_size=N_TOKENS, n_positions=32, n_embd=64, n_layer=2, n_head=4)
    return GPT2LMHeadModel(GPT2Config(**{**c, **kw}))


def hf_llama(**kw):
    c = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=120, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=32, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    return LlamaForCausalLM(LlamaConfig(**{**c, **kw}))


def randomize(hf):
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * (1.0 if p.dim() == 1 else p.size(-1) ** -0.5))
    return hf.eval()


@pytest.mark.parametrize("make, save", [
    pytest.param(lambda: hf_gpt2(), {}, id="gpt2"),
    pytest.param(lambda: hf_gpt2(tie_word_embeddings=False, activation_function="gelu_pytorch_tanh"), {},
                 id="gpt2_untied"),
    pytest.param(lambda: hf_llama(tie_word_embeddings=False), {"max_shard_size": "2MB"}, id="llama_sharded"),
    pytest.param(lambda: hf_llama(tie_word_embeddings=True, attention_bias=True, mlp_bias=True, head_dim=32), {},
                 id="llama_tied_bias_head_dim"),
])
def test_import_matches_transformers_and_export_round_trips_bit_exactly(make, save, tmp_path, capsys):
    hf = randomize(make())
    hf.save_pretrained(tmp_path / "src", **save)
    import_hf.main(["--src", str(tmp_path / "src"), "--out", str(tmp_path / "run")])
    command = capsys.readouterr().out.split("continue pretraining: python train.py ")[1].split()
    model = load_model(str(tmp_path / "run"), "cpu", "fp32")[0]
    x = torch.randint(0, N_TOKENS, (2, 32))
    with torch.no_grad():
        assert (model(x)[0] - hf(x).logits).abs().max().item() <= 1e-4
    idx = prompt(5, seed=4)
    theirs = hf.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=8, do_sample=False,
                         pad_token_id=EOT, eos_token_id=EOT)
    assert model.generate(idx, 8, temperature=0, eot_token=EOT).tolist() == theirs.tolist()
    # the printed train.py overrides rebuild exactly this model
    overrides = [o for o in command if not o.startswith("train.resume=")]
    assert GPTConfig.from_dict(train_config(overrides)["model"]) == model.config

    export_hf.main(["--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "back")])
    src, back = load_tensors(tmp_path / "src"), load_tensors(tmp_path / "back")
    assert src.keys() == back.keys() and all(torch.equal(src[k], back[k]) for k in src)
    a, b = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("src", "back"))
    # left out: token ids (ours are GPT-2's), n_inner (None means 4 d), dropouts, and gelu_pytorch_tanh,
    # which is gelu_new's function
    same = {k for k in a if k not in ("bos_token_id", "eos_token_id", "n_inner", "transformers_version",
                                      "activation_function") and not k.endswith("pdrop")}
    assert {k: a[k] for k in same} == {k: b[k] for k in same}


def load_tensors(path):
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


@pytest.mark.slow
def test_imported_run_works_with_sample_and_eval(tmp_path):
    """The real entry points on an imported GPT-2, and the command-line error contract."""
    randomize(hf_gpt2(n_positions=64)).save_pretrained(tmp_path / "src")
    run = lambda *args: subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    r = run("-m", "scripts.import_hf", "--src", str(tmp_path / "src"), "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    r = run("sample.py", f"ckpt={tmp_path / 'run'}", "prompt=The history of", "max_new_tokens=5", "temperature=0",
            "device=cpu")
    assert r.returncode == 0 and "The history of" in r.stdout, r.stderr
    r = run("eval.py", f"ckpt={tmp_path / 'run'}", "eval.tasks=[heldout,tint]", "device=cpu", "tint.seq_len=32",
            "tint.batches=1", "tint.batch_size=1", "tint.task=null", "tint.methods=[vanilla,tint_ref,tint_sim]")
    assert r.returncode == 0 and (tmp_path / "run" / "results.json").is_file(), r.stderr
    assert "tint_sim" in json.dumps(json.loads((tmp_path / "run" / "results.json").read_text())["tint"]["text"])
    r = run("-m", "scripts.import_hf", "--src", str(tmp_path / "missing"), "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and r.stderr.startswith("import_hf.py: error: ") and "no config.json" in r.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.skipif(not data_root().is_dir(), reason="needs the local benchmark copies (../shared/data/eval)")
@pytest.mark.parametrize("variant", ["llama", pytest.param("fox_pro", marks=pytest.mark.slow)])
def test_our_lm_eval_adapter_agrees_with_lm_eval_hf_backend(variant, tmp_path, capsys):
    """scripts/compare_lm_eval_hf.py in fp32 on CPU: every request's log-likelihood and every accuracy."""
    model, cfg = random_model(variant, seq_len=256)
    run = save_run(model, cfg, tmp_path / "run")
    export_hf.main(["--ckpt", str(run), "--out", str(tmp_path / "hf")])
    failed = compare_lm_eval_hf.main(["--ckpt", str(run), "--hf", str(tmp_path / "hf"), "--tasks", "arc_easy",
                                      "lambada_openai", "--limit", "3", "--dtype", "fp32", "--device", "cpu",
                                      "--offline", "true"])
    out = capsys.readouterr().out
    assert failed == 0 and "== local_arc_easy: 12 requests" in out and "== local_lambada_openai: 3 requests" in out


# ----------------------------------------------------------------------------- bad input

@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama") / "src"
    hf_llama().save_pretrained(path)
    return path


def edited_copy(src, dst, config=None, tensors=None):
    shutil.copytree(src, dst)
    if config:
        c = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**c, **config}))
    if tensors:
        save_file(tensors(load_file(dst / "model.safetensors")), dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def import_error(src, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        import_hf.main(["--src", str(src), "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and not (tmp_path / "out").exists()
    return capsys.readouterr().err


def drop(key):
    return lambda t: {k: v for k, v in t.items() if k != key}


@pytest.mark.parametrize("config, tensors, message", [
    ({"model_type": "mistral"}, None, "model_type='mistral'"),
    ({"num_key_value_heads": 2}, None, "num_key_value_heads=2"),
    ({"vocab_size": 32000}, None, "vocab_size=32000"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, None, "rope_type"),
    ({"hidden_act": "gelu"}, None, "hidden_act='gelu'"),
    (None, drop("model.layers.1.mlp.up_proj.weight"), "'model.layers.1.mlp.up_proj.weight' is missing"),
    (None, lambda t: {**t, "model.norm.weight": torch.ones(65)}, "'model.norm.weight' has shape [65]"),
    (None, lambda t: {**t, "model.layers.0.extra.weight": torch.ones(2)}, "unexpected tensors"),
])
def test_import_refuses_bad_input_naming_the_option_or_tensor(config, tensors, message, llama_dir, tmp_path, capsys):
    src = edited_copy(llama_dir, tmp_path / "src", config, tensors)
    assert message in import_error(src, tmp_path, capsys)


def test_import_refuses_a_directory_without_model_or_with_another_tokenizer(llama_dir, exported, tmp_path, capsys):
    assert "no config.json" in import_error(tmp_path, tmp_path, capsys)
    (tmp_path / "no_weights").mkdir()
    shutil.copy(llama_dir / "config.json", tmp_path / "no_weights")
    assert "no weights" in import_error(tmp_path / "no_weights", tmp_path, capsys)
    src = edited_copy(exported("llama")[2], tmp_path / "other_tok")
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]
    (src / "tokenizer.json").write_text(json.dumps(tok))
    assert "token 'world' has id 31373, GPT-2's is 6894" in import_error(src, tmp_path, capsys)


def test_export_refuses_bad_input_and_leaves_nothing(exported, tmp_path, capsys):
    model, run, _ = exported("castle")
    config, state, cfg = read_checkpoint(run)

    def export_error(ckpt, out, *extra):
        with pytest.raises(SystemExit) as e:
            export_hf.main(["--ckpt", str(ckpt), "--out", str(out), *extra])
        assert e.value.code == 2
        return capsys.readouterr().err

    bad = tmp_path / "bad"
    bad.mkdir()
    state["blocks.1.attn.proj.weight"] = state["blocks.1.attn.proj.weight"][:-1]
    torch.save(checkpoint_dict(config, state, cfg), bad / "ckpt_1.pt")
    assert "'blocks.1.attn.proj.weight' has shape [191, 64]" in export_error(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert "gpt2_json" in export_error(save_run(model, {**cfg, "data": {**cfg["data"], "tokenizer": "gpt2_json"}},
                                                tmp_path / "json"), tmp_path / "out")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert "already exists" in export_error(run, tmp_path / "full")
    assert os.listdir(tmp_path / "full") == ["keep.txt"]
    assert "model.attention=castle" in export_error(run, tmp_path / "out", "--format", "stock")
    assert "does not exist" in export_error(tmp_path / "nowhere", tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["bad", "full", "json"]     # no temporary directories left


def test_atomic_dir_leaves_nothing_when_writing_fails(tmp_path):
    with pytest.raises(RuntimeError), atomic_dir(tmp_path / "out") as tmp:
        (tmp / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("disk full")
    assert os.listdir(tmp_path) == []
    with atomic_dir(tmp_path / "out") as tmp:
        (tmp / "done").write_text("ok")
    assert os.listdir(tmp_path / "out") == ["done"] and os.listdir(tmp_path) == ["out"]
