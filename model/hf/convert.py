"""Checkpoints of this repo <-> Hugging Face model directories (transformers), both ways, exactly.

Export: `model=llama` / `transformer_llama` (RMSNorm, SwiGLU, RoPE, softmax attention) become a stock
`LlamaForCausalLM`, `model=gpt2` a stock `GPT2LMHeadModel`; every other model, and any option a stock
class cannot express, becomes `AttnLMForCausalLM` from modeling_attn_lm.py, which is copied into the
directory and loaded with `trust_remote_code=True`. Import: a `GPT2LMHeadModel`, a `LlamaForCausalLM`
with one key/value head per query head, or a directory written by export.

Key facts the mappings rest on (checked by tests/test_hf.py against transformers itself):
- RoPE: both rotate the two halves of each head (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin);
- our fused q/k/v projection stacks q, k, v row blocks: Llama's q_proj/k_proj/v_proj are its thirds,
  GPT-2's Conv1D c_attn is its transpose (Conv1D weights are (in, out));
- GPT-2 always has biases: a model without them exports with zero biases (exact).

Padded vocabulary: the embedding and head keep all `vocab_size` rows (the logits, and so every
log-likelihood, stay exactly ours); generation_config.json's `suppress_tokens` lists the padding ids
(>= the tokenizer's 50257), so `generate()` never produces them, as GPT.generate never does.
"""
import contextlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, GPT2Config, LlamaConfig

from model.checkpoint import CHECKPOINT_FORMAT, config_dict, load_checkpoint, strip_compile_prefix
from model.gpt import GPT, RECURRENT_ATTENTIONS, GPTConfig, mlp_hidden_size
from model.hf.modeling_attn_lm import AttnLMConfig
from model.hf.tokenizer import GPT2_VOCAB, check_gpt2_vocab, save_gpt2_tokenizer

EOT = 50256
MAX_PADDED_VOCAB = 50432          # 50257 rounded up to a multiple of 256: larger is another tokenizer
MODELING_FILE = Path(__file__).with_name("modeling_attn_lm.py")
CUSTOM_AUTO_MAP = {"AutoConfig": "modeling_attn_lm.AttnLMConfig",
                   "AutoModelForCausalLM": "modeling_attn_lm.AttnLMForCausalLM"}
HF_CLASSES = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel", "custom": "AttnLMForCausalLM"}
# tensors of published checkpoints that are buffers, not weights (GPT-2's causal masks, RoPE tables)
IGNORED_SUFFIXES = {"gpt2": (".attn.bias", ".attn.masked_bias"), "llama": (".rotary_emb.inv_freq",), "custom": ()}
PRO_OPTIONS = ("qk_norm", "kv_shift", "output_gate", "output_norm")


# ----------------------------------------------------------------------------- this repo's checkpoints
# The only two functions that know the checkpoint format (train.py's save_checkpoint writes it).

def read_checkpoint(path):
    """Checkpoint file or run dir -> (GPTConfig, model state dict, resolved training config dict)."""
    _, ckpt = load_checkpoint(path)
    return GPTConfig.from_dict(ckpt["model_config"]), strip_compile_prefix(ckpt["model"]), ckpt["config"]


def checkpoint_dict(config, state, train_cfg):
    """The dict train.py saves, for weights that come without training state: step 0 and no
    optimizer, loader or RNG state (None)."""
    return {"format": CHECKPOINT_FORMAT, "step": 0, "model": state, "model_config": config_dict(config),
            "optimizer": None, "loader": None, "rng": None, "config": train_cfg, "wandb_id": None}


# ----------------------------------------------------------------------------- architectures

def stock_blockers(config, arch):
    """The options of `config` that the stock class `arch` cannot express (empty: it can, exactly)."""
    want = {"llama": dict(norm="rmsnorm", mlp="swiglu", pos="rope"),
            "gpt2": dict(norm="layernorm", mlp="gelu", pos="learned")}[arch]
    blockers = [f"model.{k}={getattr(config, k)}" for k, v in {"attention": "baseline", **want}.items()
                if getattr(config, k) != v]
    blockers += [f"model.{k}=true" for k in PRO_OPTIONS if getattr(config, k)]
    blockers += [f"model.attention_window={config.attention_window}"] if config.attention_window is not None else []
    if config.n_embd % config.n_head:
        blockers.append(f"model.n_embd={config.n_embd} not divisible by model.n_head={config.n_head}")
    elif arch == "gpt2" and config.head_dim != config.n_embd // config.n_head:
        blockers.append(f"model.head_dim={config.head_dim} != n_embd / n_head (GPT-2 has no head_dim)")
    return blockers


def choose_architecture(config, fmt):
    """fmt auto: the stock class that expresses `config` exactly, else custom; stock: refuse (naming the
    options) when none does; custom: always the custom model."""
    if fmt == "custom":
        return "custom"
    blockers = {arch: stock_blockers(config, arch) for arch in ("llama", "gpt2")}
    for arch, why in blockers.items():
        if not why:
            return arch
    if fmt == "stock":
        nearest = min(blockers, key=lambda a: len(blockers[a]))
        raise ValueError(f"no stock transformers class expresses this model: {HF_CLASSES[nearest]} cannot "
                         f"take {', '.join(blockers[nearest])}; export with --format auto (custom model, "
                         "loaded with trust_remote_code=True)")
    if fmt != "auto":
        raise ValueError(f"--format {fmt!r}; choose auto, stock or custom")
    return "custom"


# ----------------------------------------------------------------------------- state-dict key maps
# A rule (our key, HF key or keys, how): "same" copies, "t" transposes (GPT-2's Conv1D), "split3"
# cuts our fused q/k/v rows into three tensors.

def linear_params(bias):
    return ("weight", "bias") if bias else ("weight",)


def llama_rules(config):
    rules = [("wte.weight", "model.embed_tokens.weight", "same")]
    for i in range(config.n_layer):
        ours, hf = f"blocks.{i}.", f"model.layers.{i}."
        rules.append((ours + "norm_attn.weight", hf + "input_layernorm.weight", "same"))
        for p in linear_params(config.bias):
            rules += [(ours + f"attn.qkv.{p}", tuple(hf + f"self_attn.{n}_proj.{p}" for n in "qkv"), "split3"),
                      (ours + f"attn.out.{p}", hf + f"self_attn.o_proj.{p}", "same"),
                      (ours + f"mlp.w_gate.{p}", hf + f"mlp.gate_proj.{p}", "same"),
                      (ours + f"mlp.w_up.{p}", hf + f"mlp.up_proj.{p}", "same"),
                      (ours + f"mlp.w_down.{p}", hf + f"mlp.down_proj.{p}", "same")]
        rules.append((ours + "norm_mlp.weight", hf + "post_attention_layernorm.weight", "same"))
    rules.append(("norm_f.weight", "model.norm.weight", "same"))
    return rules + untied_head(config)


def gpt2_rules(config):
    """GPT-2 (its biases are always there; see with_zero_biases)."""
    rules = [("wte.weight", "transformer.wte.weight", "same"), ("wpe.weight", "transformer.wpe.weight", "same")]
    for i in range(config.n_layer):
        ours, hf = f"blocks.{i}.", f"transformer.h.{i}."
        for p in ("weight", "bias"):
            linear = "t" if p == "weight" else "same"
            rules += [(ours + f"norm_attn.{p}", hf + f"ln_1.{p}", "same"),
                      (ours + f"attn.qkv.{p}", hf + f"attn.c_attn.{p}", linear),
                      (ours + f"attn.out.{p}", hf + f"attn.c_proj.{p}", linear),
                      (ours + f"norm_mlp.{p}", hf + f"ln_2.{p}", "same"),
                      (ours + f"mlp.w_up.{p}", hf + f"mlp.c_fc.{p}", linear),
                      (ours + f"mlp.w_down.{p}", hf + f"mlp.c_proj.{p}", linear)]
    rules += [("norm_f.weight", "transformer.ln_f.weight", "same"), ("norm_f.bias", "transformer.ln_f.bias", "same")]
    return rules + untied_head(config)


def custom_rules(config):
    """modeling_attn_lm.py uses our names; a tied head is stored once, as the embedding."""
    return [(k, k, "same") for k in model_shapes(config) if not (config.tie_embeddings and k == "lm_head.weight")]


def untied_head(config):
    return [] if config.tie_embeddings else [("lm_head.weight", "lm_head.weight", "same")]


RULES = {"llama": llama_rules, "gpt2": gpt2_rules, "custom": custom_rules}


def to_hf(rules, state):
    out = {}
    for ours, hf, how in rules:
        t = state[ours]
        if how == "split3":
            out.update(zip(hf, t.chunk(3)))
        else:
            out[hf] = t.t() if how == "t" else t
    return {k: v.contiguous() for k, v in out.items()}


def from_hf(rules, tensors, config):
    state = {}
    for ours, hf, how in rules:
        if how == "split3":
            state[ours] = torch.cat([tensors[k] for k in hf])
        else:
            state[ours] = tensors[hf].t().contiguous() if how == "t" else tensors[hf]
    if config.tie_embeddings:
        state["lm_head.weight"] = state["wte.weight"]
    return {k: state[k] for k in model_shapes(config)}     # GPT.state_dict()'s order


def model_shapes(config):
    """{key: shape} of GPT(config).state_dict(), built on the meta device (no memory, no init)."""
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in GPT(config).state_dict().items()}


def with_zero_biases(state, config):
    """GPT-2 has biases everywhere: give a model without them explicit zero biases (exact)."""
    full = model_shapes(replace(config, bias=True))
    return {k: state[k] if k in state else torch.zeros(full[k], dtype=state["wte.weight"].dtype) for k in full}


def check_tensors(tensors, expected, where):
    """Every expected key present with its shape, nothing else; errors name the key and shapes."""
    for key, shape in expected.items():
        if key not in tensors:
            raise ValueError(f"{where}: tensor {key!r} is missing (expected shape {list(shape)})")
        if tuple(tensors[key].shape) != tuple(shape):
            raise ValueError(f"{where}: tensor {key!r} has shape {list(tensors[key].shape)}, the config "
                             f"needs {list(shape)}")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise ValueError(f"{where}: unexpected tensors {extra[:5]}{' ...' if len(extra) > 5 else ''} "
                         f"({len(extra)}) that the config does not use")


# ----------------------------------------------------------------------------- writing directories

@contextlib.contextmanager
def atomic_dir(out):
    """Yield a temporary directory next to `out` that becomes `out` only when the block succeeds."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} already exists and is not an empty directory; choose a new path")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ----------------------------------------------------------------------------- export

def tokenizer_vocab(config, train_cfg, allow_json_tokenizer):
    """The tokenizer's vocabulary size (ids >= it are padding rows); errors when it is not GPT-2's."""
    tokenizer = train_cfg.get("data", {}).get("tokenizer", "gpt2")
    if tokenizer == "gpt2_json" and not allow_json_tokenizer:
        raise ValueError("this model was trained with data.tokenizer=gpt2_json (GPT-2 BPE of JSON-escaped text, "
                         "LongCrawl64); the exported tokenizer is plain GPT-2, so text must be escaped by hand "
                         "(json.dumps(text)[1:-1]). Pass --allow-json-tokenizer to export anyway")
    n = config.tokenizer_vocab_size or GPT2_VOCAB
    if n != GPT2_VOCAB or config.vocab_size < GPT2_VOCAB:
        raise ValueError(f"model.vocab_size={config.vocab_size}, tokenizer_vocab_size={config.tokenizer_vocab_size}: "
                         f"only the GPT-2 tokenizer ({GPT2_VOCAB} tokens, padding rows after them) is exported")
    return n


def hf_config(config, arch, n_tokens, dtype):
    """The transformers config object for `arch` (stock classes: their own names and defaults)."""
    common = dict(vocab_size=config.vocab_size, tokenizer_vocab_size=n_tokens, bos_token_id=EOT, eos_token_id=EOT,
                  tie_word_embeddings=config.tie_embeddings, initializer_range=config.init_std, dtype=dtype,
                  architectures=[HF_CLASSES[arch]])
    if arch == "llama":
        return LlamaConfig(hidden_size=config.n_embd, intermediate_size=mlp_hidden_size(config),
                           num_hidden_layers=config.n_layer, num_attention_heads=config.n_head,
                           num_key_value_heads=config.n_head, head_dim=config.head_dim, hidden_act="silu",
                           max_position_embeddings=config.block_size, rms_norm_eps=config.norm_eps,
                           rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
                           attention_bias=config.bias, mlp_bias=config.bias,
                           attention_dropout=config.dropout, **common)
    if arch == "gpt2":
        return GPT2Config(n_positions=config.block_size, n_embd=config.n_embd, n_layer=config.n_layer,
                          n_head=config.n_head, n_inner=mlp_hidden_size(config), activation_function="gelu_new",
                          layer_norm_epsilon=config.norm_eps, resid_pdrop=config.dropout,
                          embd_pdrop=config.dropout, attn_pdrop=config.dropout, **common)
    fields = {k: v for k, v in asdict(config).items() if k != "tie_embeddings"}
    return AttnLMConfig(**{**fields, **common}, auto_map=CUSTOM_AUTO_MAP)


def export_hf(ckpt, out, fmt="auto", dtype=None, allow_json_tokenizer=False):
    """Write the checkpoint `ckpt` (file or run dir) as a transformers model directory `out`; return
    the architecture written (llama, gpt2 or custom)."""
    config, state, train_cfg = read_checkpoint(ckpt)
    if config.attention in RECURRENT_ATTENTIONS:
        raise ValueError(f"checkpoint {ckpt}: attention={config.attention} (a recurrent layer of fla) has no "
                         "Hugging Face export; export takes attention=baseline, fox, castle or castle_swl")
    n_tokens = tokenizer_vocab(config, train_cfg, allow_json_tokenizer)
    check_tensors(state, model_shapes(config), f"checkpoint {ckpt}")
    arch = choose_architecture(config, fmt)
    if arch == "gpt2":
        state = with_zero_biases(state, config)
        config = replace(config, bias=True)
    tensors = to_hf(RULES[arch](config), state)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    stored = next(iter(tensors.values())).dtype
    generation = GenerationConfig(bos_token_id=EOT, eos_token_id=EOT, pad_token_id=EOT,
                                  suppress_tokens=list(range(n_tokens, config.vocab_size)) or None,
                                  use_cache=arch != "custom")
    with atomic_dir(out) as tmp:
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        hf_config(config, arch, n_tokens, stored).save_pretrained(tmp)
        generation.save_pretrained(tmp)
        save_gpt2_tokenizer(tmp, model_max_length=config.block_size)
        if arch == "custom":
            shutil.copyfile(MODELING_FILE, tmp / MODELING_FILE.name)
    return arch


# ----------------------------------------------------------------------------- import

def read_hf_config(src):
    """(architecture, raw config.json dict, typed transformers config or None for custom)."""
    path = Path(src) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{src} is not a Hugging Face model directory: no config.json in it")
    raw = json.loads(path.read_text())
    model_type = raw.get("model_type")
    if model_type == "attn_lm":
        return "custom", raw, None
    if model_type not in ("llama", "gpt2"):
        raise ValueError(f"{path}: model_type={model_type!r} (architectures {raw.get('architectures')}) is not "
                         "supported; import takes GPT2LMHeadModel, LlamaForCausalLM or a directory written by "
                         "scripts/export_hf.py")
    archs = raw.get("architectures") or [HF_CLASSES[model_type]]
    if archs != [HF_CLASSES[model_type]]:
        raise ValueError(f"{path}: architectures={archs}; only {HF_CLASSES[model_type]} (a causal LM with its "
                         "output head) is supported")
    return model_type, raw, AutoConfig.from_pretrained(src)


def refuse(path, option, value, why):
    raise ValueError(f"{path}: {option}={value!r} is not supported: {why}")


def llama_config(c, path):
    if c.num_key_value_heads != c.num_attention_heads:
        refuse(path, "num_key_value_heads", c.num_key_value_heads,
               f"grouped-query attention (num_attention_heads={c.num_attention_heads}); this repo's "
               "attention has one key/value head per query head")
    if c.hidden_act != "silu":
        refuse(path, "hidden_act", c.hidden_act, "the SwiGLU MLP uses silu")
    rope = c.rope_parameters or {}
    if rope.get("rope_type", "default") != "default":
        refuse(path, "rope_parameters.rope_type", rope.get("rope_type"), "only plain RoPE (no scaling)")
    if c.attention_bias != c.mlp_bias:
        refuse(path, "attention_bias", c.attention_bias, f"this repo has one bias option for attention and MLP "
               f"(mlp_bias={c.mlp_bias})")
    return dict(n_embd=c.hidden_size, n_layer=c.num_hidden_layers, n_head=c.num_attention_heads,
                head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                block_size=c.max_position_embeddings, bias=c.attention_bias, norm="rmsnorm", norm_eps=c.rms_norm_eps,
                mlp="swiglu", mlp_hidden=c.intermediate_size, pos="rope", rope_theta=rope.get("rope_theta", 10000.0))


def gpt2_config(c, path):
    if c.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        refuse(path, "activation_function", c.activation_function, "the GELU MLP uses the tanh approximation")
    if not c.scale_attn_weights or c.scale_attn_by_inverse_layer_idx:
        refuse(path, "scale_attn_weights / scale_attn_by_inverse_layer_idx",
               (c.scale_attn_weights, c.scale_attn_by_inverse_layer_idx), "attention scales by 1/sqrt(head_dim) only")
    if c.add_cross_attention:
        refuse(path, "add_cross_attention", True, "a decoder-only model has no cross-attention")
    return dict(n_embd=c.n_embd, n_layer=c.n_layer, n_head=c.n_head, head_dim=c.n_embd // c.n_head,
                block_size=c.n_positions, bias=True, norm="layernorm", norm_eps=c.layer_norm_epsilon, mlp="gelu",
                mlp_hidden=c.n_inner or 4 * c.n_embd, pos="learned")


def gpt_config_from_hf(src):
    """(architecture, GPTConfig) of a transformers model directory; errors name the option."""
    arch, raw, typed = read_hf_config(src)
    path = Path(src) / "config.json"
    if arch == "custom":
        known = set(GPTConfig.__dataclass_fields__) - {"tie_embeddings"}
        fields = {k: raw[k] for k in known if k in raw}
        config = GPTConfig(**fields, tie_embeddings=raw.get("tie_word_embeddings", True))
    else:
        fields = (llama_config if arch == "llama" else gpt2_config)(typed, path)
        config = GPTConfig(vocab_size=typed.vocab_size, tie_embeddings=typed.tie_word_embeddings,
                           init_std=typed.initializer_range, **fields)
    n_tokens = raw.get("tokenizer_vocab_size") or GPT2_VOCAB
    if n_tokens != GPT2_VOCAB or not GPT2_VOCAB <= config.vocab_size <= MAX_PADDED_VOCAB:
        raise ValueError(f"{path}: vocab_size={config.vocab_size} (tokenizer_vocab_size={n_tokens}) is not GPT-2's "
                         f"{GPT2_VOCAB} tokens plus at most {MAX_PADDED_VOCAB - GPT2_VOCAB} padding rows; only the "
                         "GPT-2 tokenizer is supported")
    return arch, replace(config, tokenizer_vocab_size=GPT2_VOCAB)


def check_tokenizer_files(src):
    """When `src` has tokenizer files, they must be GPT-2's (vocabularies are compared token by token)."""
    src = Path(src)
    if (src / "tokenizer.json").is_file():
        tokenizer = json.loads((src / "tokenizer.json").read_text())
        vocab = dict(tokenizer.get("model", {}).get("vocab", {}))
        vocab.update({t["content"]: t["id"] for t in tokenizer.get("added_tokens", [])})
        check_gpt2_vocab(vocab, src / "tokenizer.json")
    elif (src / "vocab.json").is_file():
        check_gpt2_vocab(json.loads((src / "vocab.json").read_text()), src / "vocab.json")


def read_hf_tensors(src):
    """{name: tensor} of every weight file of a model directory (safetensors or PyTorch .bin, sharded or not)."""
    src = Path(src)
    for single, index, load in (("model.safetensors", "model.safetensors.index.json", load_file),
                                ("pytorch_model.bin", "pytorch_model.bin.index.json",
                                 lambda f: torch.load(f, map_location="cpu", weights_only=True))):
        if (src / index).is_file():
            files = sorted(set(json.loads((src / index).read_text())["weight_map"].values()))
        elif (src / single).is_file():
            files = [single]
        else:
            continue
        tensors = {}
        for f in files:
            tensors.update(load(str(src / f)))
        return tensors
    raise FileNotFoundError(f"{src}: no weights (model.safetensors, pytorch_model.bin or their sharded index)")


def read_hf_model(src):
    """A transformers model directory -> (GPTConfig, our state dict in fp32); errors name the key/shape."""
    arch, config = gpt_config_from_hf(src)
    check_tokenizer_files(src)
    tensors = read_hf_tensors(src)
    rules = RULES[arch](config)
    meta = {k: torch.empty(shape, device="meta") for k, shape in model_shapes(config).items()}
    expected = {k: tuple(v.shape) for k, v in to_hf(rules, meta).items()}
    # published checkpoints may carry buffers, and may name the keys of the base model without its prefix
    prefix = {"llama": "model.", "gpt2": "transformer.", "custom": ""}[arch]
    tensors = {(k if k in expected or prefix + k not in expected else prefix + k): v for k, v in tensors.items()
               if not k.endswith(IGNORED_SUFFIXES[arch])}
    check_tensors(tensors, expected, src)
    return config, from_hf(rules, {k: v.float() for k, v in tensors.items()}, config)


def write_imported_run(out, config, state, train_cfg):
    """Write `out` as a run directory: ckpt_0.pt (weights only, see checkpoint_dict) and config.yaml."""
    with atomic_dir(out) as tmp:
        torch.save(checkpoint_dict(config, state, train_cfg), tmp / "ckpt_0.pt")
        OmegaConf.save(OmegaConf.create(train_cfg), tmp / "config.yaml")
    return Path(out) / "ckpt_0.pt"


# ----------------------------------------------------------------------------- checking an export

def check_export(ckpt, out, dtype=None, seq_len=32, seed=0):
    """Load `out` with transformers and the checkpoint with model/gpt.py (its weights rounded to the
    exported `dtype`), both computing in fp32 on CPU; return the largest |logit difference| and |logit|
    on one random sequence of real (non-padding) tokens."""
    config, state, _ = read_checkpoint(ckpt)
    ours = GPT(config)
    ours.load_state_dict({k: v.to(dtype or v.dtype).float() for k, v in state.items()})
    theirs = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, GPT2_VOCAB, (1, min(seq_len, config.block_size)), generator=gen)
    with torch.no_grad():
        a = ours.eval().float()(idx)[0]
        b = theirs.eval()(idx).logits
    return (a - b).abs().max().item(), a.abs().max().item()
