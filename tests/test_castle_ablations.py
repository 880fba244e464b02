"""The CASTLE paper's ablations as model options and experiment configs (CASTLE, arXiv:2509.07301 §5.2):
model.castle_causal_keys=false (Table 5), model.castle_silu=false (Table 10) and the -16 models (Tables
7-9). The attention itself is tested against its definitions in tests/test_castle_kernels.py and
test_castle_decode.py; here the model: parameter counts, cached decoding, and the errors for options set on a
model that has none.
"""
import pytest
import torch
import test_model
from test_entry_errors import assert_one_line_error, run
from test_model import experiment_model, tiny

from model.gpt import GPT, GPTConfig

LLAMA = dict(norm="rmsnorm", mlp="swiglu", pos="rope", bias=False)
ABLATED = {
    "castle_no_causal_keys": dict(attention="castle", castle_causal_keys=False, **LLAMA),
    "castle_no_silu": dict(attention="castle", castle_silu=False, **LLAMA),
    "castle_swl_neither": dict(attention="castle_swl", castle_window=3, castle_causal_keys=False, castle_silu=False,
                               **LLAMA),
}

# Tables 7-9 (-16: 8 heads) and Table 5 print these counts, truncated; the configs use the vocabulary, tying and
# SwiGLU width that reproduce Table 4's (tests/test_model.py, CASTLE_PARAMS). w/o SiLU: Table 10's CASTLE-SWL-XL.
PAPER_PARAMS = {"castle_paper_M_16": 340e6, "castle_swl_paper_M_16": 340e6, "castle_paper_XL_16": 1260e6,
                "castle_swl_paper_XL_16": 1260e6, "castle_paper_120M": 120e6,
                "castle_no_causal_keys_paper_120M": 120e6, "castle_swl_no_silu_paper_XL": 1304e6}
PAPER_HEADS = {"castle_paper_M_16": 8, "castle_swl_paper_M_16": 8, "castle_paper_XL_16": 8,
               "castle_swl_paper_XL_16": 8, "castle_paper_120M": 6, "castle_no_causal_keys_paper_120M": 7,
               "castle_swl_no_silu_paper_XL": 9}


@pytest.mark.parametrize("name", PAPER_PARAMS)
def test_ablation_configs_parameter_counts(name):
    model = experiment_model(name)
    assert abs(model.num_params() - PAPER_PARAMS[name]) / PAPER_PARAMS[name] < 0.01
    config = model.config
    assert config.n_head == PAPER_HEADS[name]
    assert config.castle_causal_keys == ("no_causal_keys" not in name)
    assert config.castle_silu == ("no_silu" not in name)
    assert config.castle_window == (512 if "swl" in name else None)


def test_table5_pair_has_equal_parameters():
    """Table 5: dropping W^C_K leaves 6 matrices per head, so 7 heads match CASTLE's 6 heads of 7 exactly."""
    with_keys, without = (experiment_model(n) for n in ("castle_paper_120M", "castle_no_causal_keys_paper_120M"))
    assert with_keys.num_params() == without.num_params()


def test_attention_parameters_without_causal_keys():
    """Five projections per head plus W_O: 6 n_head d d_model; SiLU off changes no parameter."""
    for kw, matrices in ((dict(castle_causal_keys=False), 6), (dict(castle_silu=False), 7)):
        attn = GPT(tiny(attention="castle", n_embd=64, n_head=3, head_dim=16, **kw)).blocks[0].attn
        assert sum(p.numel() for p in attn.parameters()) == matrices * 3 * 16 * 64


@pytest.mark.parametrize("name", ABLATED)
def test_cached_logits_equal_parallel_logits(name):
    """Prefill, single positions, then three at once through the UQ-KV cache: the full forward's logits
    (test_model's check), with the cache built for the ablation."""
    config = tiny(**ABLATED[name])
    test_model.test_cached_logits_equal_parallel_logits(config)
    cache = GPT(config).new_cache(2, 15)
    assert all(c.causal_keys == config.castle_causal_keys for c in cache.layers)


def test_cached_greedy_generation_equals_uncached():
    model = GPT(tiny(**ABLATED["castle_swl_neither"])).eval()
    prompt = torch.randint(0, 97, (2, 7))
    assert torch.equal(model.generate(prompt, 12, temperature=0),
                       model.generate(prompt, 12, temperature=0, use_cache=False))


@pytest.mark.parametrize("attention", ["baseline", "fox"])
def test_ablation_options_off_castle_are_named(attention):
    for option in ("castle_causal_keys", "castle_silu"):
        with pytest.raises(ValueError, match=f"model.{option}=false only applies to attention=castle or "
                                             "castle_swl .model=castle or model=castle_swl., not attention="):
            GPTConfig(attention=attention, **{option: False})


@pytest.mark.slow
def test_train_names_the_models_that_take_the_option():
    """From the command line an ablation option on another model group is one line naming the groups."""
    proc = run("train.py", ["model=fox_pro", "model.castle_silu=false"])
    assert_one_line_error(proc, "model.castle_silu", "model=castle|castle_swl")
