"""Tokenizer, shard format, loaders, build_loader and the data configs (CPU, fast)."""
import errno
import hashlib
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from omegaconf import OmegaConf

import data.tokenizer as tokenizer_module
from data import REPO_ROOT
from data.loader import TokenLoader, build_loader, ensure_prepared
from data.order import feistel_permutation, round_keys
from data.pipeline import prepare
from data.sources import expand_sources, list_units
from data.longcrawl64 import DOC_LEN, LongCrawl64Loader, check_values, open_split
from data.shards import HEADER_BYTES, MAGIC, read_shard, shard_num_tokens, write_shard
from data.tokenizer import EOT, get_tokenizer

CONFIGS = REPO_ROOT / "configs" / "data"
V = 50257  # the GPT-2 tokenizer's vocabulary


# ---- tokenizer ----

@pytest.fixture
def offline(monkeypatch):
    monkeypatch.delenv("GPT2_RANKS_PATH", raising=False)
    monkeypatch.setenv("GPT2_RANKS_OFFLINE", "1")


def test_gpt2_offline_from_bundled_file(offline):
    enc = get_tokenizer("gpt2")
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert (enc.eot_token, enc.n_vocab) == (EOT, 50257)
    assert enc.encode_ordinary("<|endoftext|>") != [EOT]  # special text is never the separator
    text = "Mrs. Hilbery's tea-party — “quite” 12,345 times.\n\tdone"
    assert enc.decode(enc.encode_ordinary(text)) == text


def test_ranks_path_argument_and_env(offline, tmp_path, monkeypatch):
    copy = tmp_path / "ranks.tiktoken"
    shutil.copy(tokenizer_module.BUNDLED_RANKS, copy)
    monkeypatch.setattr(tokenizer_module, "BUNDLED_RANKS", tmp_path / "absent.tiktoken")
    assert get_tokenizer("gpt2", ranks_path=str(copy)).encode_ordinary("Hello world") == [15496, 995]
    monkeypatch.setenv("GPT2_RANKS_PATH", str(copy))
    assert get_tokenizer("gpt2").encode_ordinary("Hello world") == [15496, 995]
    monkeypatch.delenv("GPT2_RANKS_PATH")
    monkeypatch.chdir(tmp_path)  # a relative path is also looked up in the repository root
    assert get_tokenizer("gpt2", "data/sample/r50k_base.tiktoken").encode_ordinary("Hello world") == [15496, 995]


def test_missing_ranks_offline_is_a_clear_error(offline, tmp_path, monkeypatch):
    monkeypatch.setattr(tokenizer_module, "BUNDLED_RANKS", tmp_path / "r50k_base.tiktoken")
    monkeypatch.setenv("GPT2_RANKS_PATH", str(tmp_path / "nowhere.tiktoken"))
    with pytest.warns(UserWarning, match="nowhere.tiktoken"), pytest.raises(FileNotFoundError) as err:
        get_tokenizer("gpt2_json")
    message = str(err.value)
    assert "r50k_base.tiktoken" in message and "nowhere.tiktoken" in message
    assert "GPT2_RANKS_PATH" in message and "GPT2_RANKS_OFFLINE" in message


def test_corrupt_ranks_file_is_rejected(offline, tmp_path):
    bad = tmp_path / "bad.tiktoken"
    bad.write_bytes(tokenizer_module.BUNDLED_RANKS.read_bytes()[:-10])
    with pytest.raises(ValueError, match="bad.tiktoken.*sha256"):
        get_tokenizer("gpt2", ranks_path=str(bad))


def test_unknown_tokenizer_name():
    with pytest.raises(ValueError, match="gpt2_json"):
        get_tokenizer("llama")


def test_json_tokenizer_encodes_escaped_text(offline):
    gpt2, js = get_tokenizer("gpt2"), get_tokenizer("gpt2_json")
    assert (js.eot_token, js.n_vocab) == (EOT, 50257)
    assert js.encode_ordinary('He said "hi"\nthen left.') == gpt2.encode_ordinary('He said \\"hi\\"\\nthen left.')
    assert js.encode_ordinary("café") == gpt2.encode_ordinary("caf\\u00e9")
    for text in ["plain", 'quote " and \\ backslash\n\ttab', "café — “curly” 😀 中文", "literal \\n stays"]:
        assert js.decode(js.encode_ordinary(text)) == text
    ids = js.encode_ordinary("a\nb 😀 c")
    assert all(isinstance(js.decode(ids[i:j]), str) for i in range(len(ids)) for j in range(i, len(ids) + 1))


# ---- shards ----

def test_shard_round_trip(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 65536, size=10_001)
    tokens[:2] = 0, 65535
    sha = write_shard(tmp_path / "a.bin", tokens)
    data = (tmp_path / "a.bin").read_bytes()
    assert sha == hashlib.sha256(data).hexdigest()
    assert np.frombuffer(data[:12], "<i4").tolist() == [MAGIC, 1, tokens.size]
    assert len(data) == HEADER_BYTES + 2 * tokens.size
    out = read_shard(tmp_path / "a.bin")
    assert out.dtype == np.uint16 and np.array_equal(out, tokens)
    write_shard(tmp_path / "empty.bin", [])
    assert read_shard(tmp_path / "empty.bin").size == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "empty.bin"]  # no temp files left


def test_shard_errors_name_the_file_and_the_problem(tmp_path):
    good = tmp_path / "good.bin"
    write_shard(good, np.arange(1000))
    truncated = tmp_path / "truncated.bin"
    truncated.write_bytes(good.read_bytes()[:-1])
    with pytest.raises(ValueError, match="truncated.bin: truncated shard: the header says 1000 tokens"):
        read_shard(truncated)
    short = tmp_path / "short.bin"
    short.write_bytes(good.read_bytes()[:100])
    with pytest.raises(ValueError, match="short.bin: truncated shard.*header"):
        read_shard(short)
    foreign = tmp_path / "foreign.bin"
    foreign.write_text("just some text, not tokens\n" * 100)
    with pytest.raises(ValueError, match="foreign.bin: not a token shard"):
        read_shard(foreign)
    tiny = tmp_path / "tiny.bin"
    tiny.write_bytes(b"\x01")
    with pytest.raises(ValueError, match="tiny.bin: not a token shard"):
        shard_num_tokens(tiny)
    version = tmp_path / "version.bin"
    raw = bytearray(good.read_bytes())
    raw[4:8] = np.array(7, "<i4").tobytes()
    version.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="version.bin: shard format version 7"):
        read_shard(version)
    longer = tmp_path / "longer.bin"
    longer.write_bytes(good.read_bytes() + b"\0\0")
    with pytest.raises(ValueError, match="longer.bin: corrupt shard"):
        read_shard(longer)


def test_write_shard_rejects_bad_tokens_and_leaves_nothing(tmp_path):
    with pytest.raises(ValueError, match=r"\[0, 65535\]"):
        write_shard(tmp_path / "big.bin", [1, 2, 70000])
    with pytest.raises(ValueError, match=r"\[0, 65535\]"):
        write_shard(tmp_path / "neg.bin", [-1, 2])
    with pytest.raises(ValueError, match="integer"):
        write_shard(tmp_path / "float.bin", [0.5])
    assert list(tmp_path.iterdir()) == []


def test_disk_full_leaves_no_partial_shard(tmp_path, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr("data.shards.os.fsync", full)
    with pytest.raises(OSError, match="disk full while writing shard .*x.bin"):
        write_shard(tmp_path / "x.bin", np.arange(100))
    assert list(tmp_path.iterdir()) == []


# ---- TokenLoader ----

@pytest.fixture
def stream_shards(tmp_path):
    """Five shards of uneven sizes whose concatenation is 0, 1, 2, ... (mod 65536)."""
    sizes = [700, 1, 333, 1200, 90]
    stream = np.arange(sum(sizes)) % 65536
    files, start = [], 0
    for i, n in enumerate(sizes):
        files.append(tmp_path / f"train_{i:06d}.bin")
        write_shard(files[-1], stream[start:start + n])
        start += n
    return files, stream


def test_loader_reads_the_stream_in_order_and_wraps(stream_shards):
    files, stream = stream_shards
    B, T = 3, 50
    loader = TokenLoader([files], B, T, vocab_size=V)
    n_chunks = (len(stream) - 1) // (B * T)
    for k in range(2 * n_chunks + 1):  # two epochs and a bit: crosses every shard boundary
        x, y = loader.next_batch()
        start = (k % n_chunks) * B * T
        assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x.flatten(), torch.from_numpy(stream[start:start + B * T]))
        assert torch.equal(y.flatten(), torch.from_numpy(stream[start + 1:start + B * T + 1]))


def test_loader_resume_gives_the_same_batches(stream_shards):
    files, _ = stream_shards
    loader = TokenLoader([files], 2, 64, rank=1, world_size=2, vocab_size=V)
    for _ in range(5):
        loader.next_batch()
    state = loader.state_dict()
    assert state["position"] == 5 * 2 * 2 * 64
    expected = [loader.next_batch() for _ in range(6)]
    resumed = TokenLoader([files], 2, 64, rank=1, world_size=2, vocab_size=V)
    resumed.load_state_dict(state)
    for (x, y), (xr, yr) in zip(expected, (resumed.next_batch() for _ in range(6)), strict=True):
        assert torch.equal(x, xr) and torch.equal(y, yr)
    with pytest.raises(ValueError, match="not a multiple"):
        TokenLoader([files], 3, 64, vocab_size=V).load_state_dict({"position": 100})


def test_two_ranks_read_what_one_rank_reads_in_two_steps(stream_shards):
    files, _ = stream_shards
    one = TokenLoader([files], 2, 32, vocab_size=V)
    ranks = [TokenLoader([files], 2, 32, rank=r, world_size=2, vocab_size=V) for r in range(2)]
    for _ in range(20):
        for rank in ranks:
            x, y = rank.next_batch()
            x1, y1 = one.next_batch()
            assert torch.equal(x, x1) and torch.equal(y, y1)
    assert ranks[0].state_dict() == ranks[1].state_dict() == one.state_dict()


def test_loader_needs_enough_tokens(stream_shards):
    files, _ = stream_shards
    with pytest.raises(ValueError, match="fewer than one batch"):
        TokenLoader([files[:2]], 4, 200, vocab_size=V)
    with pytest.raises(ValueError, match="at least one"):
        TokenLoader([], 1, 1, vocab_size=V)


# ---- shuffled order and mixes ----

SOURCE_STRIDE = 10_000  # source k's train tokens are k*10000 + their stream position, its val tokens from +8000
VAL_OFFSET = 8_000


def write_source(folder, n_tokens, k, rng, val_tokens=1_500):
    """A folder of train shards (random cut points) whose stream is k*10000, k*10000 + 1, ..., and a val shard:
    every token names its source and position, and every id is in the GPT-2 vocabulary."""
    folder.mkdir(parents=True)
    stream = SOURCE_STRIDE * k + np.arange(n_tokens)
    cuts = np.sort(rng.choice(np.arange(1, n_tokens), size=int(rng.integers(0, 4)), replace=False))
    for i, part in enumerate(np.split(stream, cuts)):
        write_shard(folder / f"train_{i:06d}.bin", part)
    write_shard(folder / "val_000000.bin", SOURCE_STRIDE * k + VAL_OFFSET + np.arange(val_tokens))
    return folder


@pytest.fixture
def sources(tmp_path):
    """Three prepared folders of 2,000-8,000 train tokens each."""
    rng = np.random.default_rng()
    return [write_source(tmp_path / f"source{k}", int(rng.integers(2_000, 8_000)), k, rng) for k in range(3)]


def train_files(folder):
    return sorted(folder.glob("train_*.bin"))


def n_sequences(folder, T):
    return (sum(shard_num_tokens(f) for f in train_files(folder)) - 1) // T


def decode(x, y, T, offset=0):
    """[(source, sequence index)] of a batch, after checking each row is that sequence's tokens."""
    out = []
    for xr, yr in zip(x.tolist(), y.tolist(), strict=True):
        source, start = divmod(xr[0], SOURCE_STRIDE)
        seq, rest = divmod(start - offset, T)
        assert rest == 0 and xr == list(range(xr[0], xr[0] + T)) and yr == [t + 1 for t in xr]
        out.append((source, seq))
    return out


def test_feistel_permutation_is_a_bijection_that_the_keys_change():
    rng = np.random.default_rng()
    seed = int(rng.integers(2**32))
    for n in [1, 2, 3, 4, 5, 17, 1024, *rng.integers(1, 100_000, size=4)]:
        perm = feistel_permutation(np.arange(n), n, round_keys(seed, 0, 0))
        assert np.array_equal(np.sort(perm), np.arange(n)), n
    n = 5000
    perms = [feistel_permutation(np.arange(n), n, round_keys(*key))
             for key in [(seed, 0, 0), (seed + 1, 0, 0), (seed, 1, 0), (seed, 0, 1)]]  # seed, source, epoch
    for i in range(4):
        assert abs(np.corrcoef(perms[i], np.arange(n))[0, 1]) < 0.1  # far from file order
        for d in 2 ** np.arange(12):  # sequences d apart land uncorrelated, also across the Feistel halves
            assert abs(np.corrcoef(perms[i][:-d], perms[i][d:])[0, 1]) < 0.1
        for j in range(i):
            assert np.mean(perms[i] == perms[j]) < 0.01  # random permutations agree on ~1/n of the places


def test_shuffled_order_visits_every_sequence_once_per_epoch(sources):
    rng = np.random.default_rng()
    folder, T, B, seed = sources[0], int(rng.integers(8, 33)), int(rng.integers(2, 6)), int(rng.integers(2**31))
    S = n_sequences(folder, T)
    loader = TokenLoader([train_files(folder)], B, T, vocab_size=V, order="shuffled", seed=seed)
    seen = []
    while len(seen) < 3 * S:  # three epochs; batches cross the epoch boundaries
        seen += [seq for _, seq in decode(*loader.next_batch(), T)]
    epochs = [seen[e * S:(e + 1) * S] for e in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(S))  # each sequence exactly once
    assert epochs[0] != list(range(S)) and epochs[0] != epochs[1] != epochs[2]  # shuffled, anew each epoch

    def first_batches(seed):
        loader = TokenLoader([train_files(folder)], B, T, vocab_size=V, order="shuffled", seed=seed)
        return [loader.next_batch()[0] for _ in range(3)]
    assert all(map(torch.equal, first_batches(seed), first_batches(seed)))  # deterministic
    assert not all(map(torch.equal, first_batches(seed), first_batches(seed + 1)))  # the seed matters


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_ranks_read_disjoint_slices_of_every_global_batch(sources, world, mixed):
    rng = np.random.default_rng()
    T, B, seed = 16, int(rng.integers(1, 4)), int(rng.integers(2**31))
    files = [train_files(f) for f in (sources if mixed else sources[:1])]
    weights = list(rng.uniform(0.2, 1, size=len(files)))

    def loader(rank=0, world_size=1):
        return TokenLoader(files, B, T, rank, world_size, vocab_size=V, weights=weights, order="shuffled", seed=seed)
    one, ranks = loader(), [loader(r, world) for r in range(world)]
    seen = []
    for _ in range(60 // (B * world)):  # within every source's first epoch (>= 124 sequences)
        got = [rank.next_batch() for rank in ranks]
        want = [one.next_batch() for _ in range(world)]  # the global batch = one rank's next `world` batches
        for i in range(2):
            assert torch.equal(torch.cat([b[i] for b in got]), torch.cat([b[i] for b in want]))
        seen += [pair for x, y in got for pair in decode(x, y, T)]
    assert len(set(seen)) == len(seen)  # no rank reads what another reads (nor anything twice)
    assert all(rank.state_dict() == one.state_dict() for rank in ranks)
    assert all(rank.source_counts() == one.source_counts() for rank in ranks)


@pytest.mark.parametrize("mixed", [False, True])
def test_resume_mid_epoch_gives_the_batches_of_an_uninterrupted_run(sources, mixed):
    rng = np.random.default_rng()
    T, B, seed = int(rng.integers(8, 20)), 3, int(rng.integers(2**31))
    files = [train_files(f) for f in (sources if mixed else sources[:1])]
    weights = list(rng.uniform(0.2, 1, size=len(files)))

    def loader():
        return TokenLoader(files, B, T, rank=1, world_size=2, vocab_size=V, weights=weights, order="shuffled",
                           seed=seed)
    run = loader()
    for _ in range(int(rng.integers(1, 10))):  # mid-epoch: at most 60 of >= 100 sequences per source
        run.next_batch()
    state, counts = run.state_dict(), run.source_counts()
    assert set(state) == {"position"}  # the loader's whole state: one integer
    steps = 2 * max(n_sequences(f, T) for f in sources) // (2 * B) + 2  # past every source's epoch boundary
    after = [run.next_batch() for _ in range(steps)]
    resumed = loader()
    resumed.load_state_dict(state)
    assert resumed.source_counts() == counts
    for (x, y), (xr, yr) in zip(after, (resumed.next_batch() for _ in range(steps)), strict=True):
        assert torch.equal(x, xr) and torch.equal(y, yr)


def test_mix_draws_the_weights_proportions_and_each_source_runs_its_own_epochs(sources):
    rng = np.random.default_rng()
    T, B, seed = 32, int(rng.integers(4, 9)), int(rng.integers(2**31))
    sizes = np.array([n_sequences(f, T) for f in sources])
    weights = list(sizes * rng.uniform(1, 3, size=3))  # every source through 2+ epochs in 6.5 * sum(sizes) samples
    share = np.array(weights) / sum(weights)
    loader = TokenLoader([train_files(f) for f in sources], B, T, vocab_size=V, weights=weights, order="shuffled",
                         seed=seed)
    drawn = [[] for _ in sources]
    for step in range(1, 1 + int(6.5 * sizes.sum()) // B):
        for source, seq in decode(*loader.next_batch(), T):
            drawn[source].append(seq)
        counts = np.array([len(d) for d in drawn])
        assert np.abs(counts - share * step * B).max() < 1  # every prefix: within one sequence (MixSchedule)
        assert loader.source_counts() == {str(f): int(c) for f, c in zip(sources, counts, strict=True)}
    for seqs, S in zip(drawn, sizes, strict=True):  # each source: its own epochs, each a new permutation
        epochs = [seqs[i:i + S] for i in range(0, len(seqs), S)]
        assert len(epochs) >= 3 and epochs[0] != epochs[1]
        for epoch in epochs[:-1]:
            assert sorted(epoch) == list(range(S))
        assert len(set(epochs[-1])) == len(epochs[-1])


def test_shuffled_order_checks_token_ids_as_it_reads(tmp_path):
    rng = np.random.default_rng()
    tokens = rng.integers(0, V, size=4000)
    pos, bad_id = int(rng.integers(0, 1990)), int(rng.choice([50300, 60000]))  # sequences end at 3990
    tokens[2000 + pos] = bad_id
    write_shard(tmp_path / "train_000000.bin", tokens[:2000])
    write_shard(tmp_path / "train_000001.bin", tokens[2000:])
    loader = TokenLoader([train_files(tmp_path)], 2, 10, vocab_size=V, order="shuffled", seed=int(rng.integers(99)))
    with pytest.raises(ValueError) as err:
        for _ in range(200):  # one epoch: the sequence holding the bad id comes up somewhere in it
            loader.next_batch()
    assert_names_bad_token(err, tmp_path / "train_000001.bin", pos, bad_id)


def mix_config(folders, weights):
    cfg = OmegaConf.load(CONFIGS / "mix.yaml")
    cfg.mix = [{"dir": str(f), "weight": w} for f, w in zip(folders, weights, strict=True)]
    return cfg


def test_build_loader_mixes_train_and_validation_splits(sources):
    rng = np.random.default_rng()
    weights = [float(w) for w in rng.uniform(0.2, 1, size=3)]
    cfg = mix_config(sources, weights)
    T, B = 16, 4
    train = build_loader(cfg, "train", B, T, rank=1, world_size=2)
    assert train.names == [str(f) for f in sources] and train.orders[0].order == "shuffled"
    assert {source for source, _ in decode(*train.next_batch(), T)} <= {0, 1, 2}

    def val_batches():
        val = build_loader(cfg, "val", B, T)
        return [decode(*val.next_batch(), T, offset=VAL_OFFSET) for _ in range(25)]
    batches = val_batches()
    assert batches == val_batches()  # validation: the same batches every time
    drawn = [[seq for batch in batches for source, seq in batch if source == k] for k in range(3)]
    assert [seqs == list(range(len(seqs))) for seqs in drawn] == [True] * 3  # each val split in file order
    share = np.array(weights) / sum(weights)
    assert np.abs(np.array([len(d) for d in drawn]) - share * 100).max() < 1  # weighted as in training


def test_mix_option_composes_from_the_command_line():
    from hydra import compose, initialize_config_dir
    with initialize_config_dir(config_dir=str(REPO_ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "data=text", "data.order=shuffled", "data.seed=3", "data.mix=[{dir:a/b,weight:0.7},{dir:c,weight:3}]"])
    assert OmegaConf.to_container(cfg.data.mix) == [{"dir": "a/b", "weight": 0.7}, {"dir": "c", "weight": 3}]
    assert (cfg.data.order, cfg.data.seed) == ("shuffled", 3)


def write_prepared(folder, tokenizer):
    """A real preparation of a small random text with `tokenizer`."""
    rng = np.random.default_rng()
    words = ["river", "stone", "light", '"quoted"', "night", "day", "café", "north", "time"]
    text = folder.parent / f"{folder.name}.txt"
    text.write_text("\n\n".join(" ".join(rng.choice(words, size=300)) for _ in range(20)))
    prepare(list_units(expand_sources([str(text)])), folder, source=[str(text)], tokenizer=tokenizer,
            val_tokens=500, shard_tokens=100_000, progress=False)
    return folder


@pytest.mark.parametrize("change, error, message", [
    ({"mix": [{"weight": 1}]}, ValueError, r"data.mix\[0\] must be \{dir: FOLDER, weight: NUMBER\}"),
    ({"mix": []}, ValueError, r"data.mix must be a non-empty list"),
    ({"mix": "somewhere"}, ValueError, r"data.mix must be a non-empty list"),
    ({"weights": [1, 0]}, ValueError, r"data.mix\[1\].weight must be a positive number, got 0"),
    ({"weights": [-0.5, 1]}, ValueError, r"data.mix\[0\].weight must be a positive number, got -0.5"),
    ({"weights": [1, float("nan")]}, ValueError, r"data.mix\[1\].weight must be a positive number"),
    ({"weights": [1, "heavy"]}, ValueError, r"data.mix\[1\].weight must be a positive number, got 'heavy'"),
    ({"missing": 1}, FileNotFoundError, r"data.mix\[1\].dir: .*nowhere is not a folder; prepare it first"),
    ({"duplicate": 1}, ValueError, r"data.mix\[1\].dir: .*source0 is already in data.mix"),
    ({"order": "random"}, ValueError, r"data.order must be one of file, shuffled for token shards, got 'random'"),
    ({"seed": -1}, ValueError, r"data.seed must be a non-negative integer, got -1"),
])
def test_bad_data_options_are_refused_naming_the_option(sources, change, error, message):
    folders = list(sources[:2])
    if "missing" in change:
        folders[1] = folders[1].parent / "nowhere"
    if "duplicate" in change:
        folders[1] = folders[0]
    cfg = mix_config(folders, change.get("weights", [1, 1]))
    for key in ("mix", "order", "seed"):
        if key in change:
            cfg[key] = change[key]
    with pytest.raises(error, match=message):
        build_loader(cfg, "train", 2, 8)


def test_sources_of_another_tokenizer_are_refused(tmp_path):
    gpt2, gpt2_json = write_prepared(tmp_path / "plain", "gpt2"), write_prepared(tmp_path / "json", "gpt2_json")
    with pytest.raises(ValueError, match=r"data.mix\[1\].dir: .*json was prepared with tokenizer 'gpt2_json', but "
                                         r"data.tokenizer is 'gpt2'"):
        build_loader(mix_config([gpt2, gpt2_json], [1, 1]), "train", 2, 8)
    cfg = OmegaConf.load(CONFIGS / "text.yaml")
    cfg.dir, cfg.tokenizer = str(gpt2), "gpt2_json"
    with pytest.raises(ValueError, match=r"data.dir: .*plain was prepared with tokenizer 'gpt2'"):
        build_loader(cfg, "val", 2, 8)
    one = OmegaConf.merge(mix_config([gpt2], [1]), {"order": "file"})
    x, _ = build_loader(one, "train", 2, 8).next_batch()  # a mix of one folder reads as that folder
    assert torch.equal(x, build_loader(OmegaConf.merge(cfg, {"tokenizer": "gpt2"}), "train", 2, 8).next_batch()[0])


def test_longcrawl64_refuses_a_mix_and_a_token_shard_order(tmp_path):
    cfg = OmegaConf.load(CONFIGS / "longcrawl64.yaml")
    cfg.dir, cfg.check_rows = str(make_longcrawl(tmp_path, train_docs=2, val_docs=2)), False
    with pytest.raises(ValueError, match="data.mix is not supported with data=longcrawl64"):
        build_loader(OmegaConf.merge(cfg, {"mix": [{"dir": str(tmp_path), "weight": 1}]}), "train", 1, DOC_LEN)
    with pytest.raises(ValueError, match="data.order must be 'paper' or 'shuffled' for LongCrawl64, got 'file'"):
        build_loader(OmegaConf.merge(cfg, {"order": "file"}), "train", 1, DOC_LEN)


# ---- build_loader and configs ----

def test_every_data_config_has_the_keys(tmp_path):
    names = sorted(p.stem for p in CONFIGS.glob("*.yaml"))
    assert names == ["fineweb_edu", "longcrawl64", "mix", "sample", "text"]
    for name in names:
        cfg = OmegaConf.load(CONFIGS / f"{name}.yaml")
        assert cfg.name == name and cfg.tokenizer in ("gpt2", "gpt2_json") and cfg.val_tokens > 0
        assert ("dir" in cfg or cfg.mix) and "ranks_path" in cfg and cfg.seed == 0
        if name != "longcrawl64":
            assert cfg.train_pattern and cfg.val_pattern and "auto_prepare" in cfg and "mix" in cfg
            assert cfg.order == ("shuffled" if name == "mix" else "file")


def sample_config(tmp_path):
    cfg = OmegaConf.load(CONFIGS / "sample.yaml")
    cfg.dir = str(tmp_path / "sample")
    return cfg


def test_build_loader_prepares_the_bundled_sample(tmp_path):
    cfg = sample_config(tmp_path)
    train = build_loader(cfg, "train", 4, 128, rank=1, world_size=2)
    val = build_loader(cfg, "val", 2, 256)
    assert val.streams[0].n_tokens == cfg.auto_prepare.val_tokens and train.streams[0].n_tokens > 200_000
    x, y = train.next_batch()
    assert x.shape == (4, 128) and torch.equal(x[:, 1:], y[:, :-1])
    first = val.next_batch()[0][0].tolist()
    source = (REPO_ROOT / "data" / "sample" / "night_and_day.txt").read_text()
    assert first[0] == EOT and source.startswith(get_tokenizer().decode(first[1:]))
    shards = sorted((tmp_path / "sample").glob("*.bin"))
    stamps = [p.stat().st_mtime_ns for p in shards]
    build_loader(cfg, "train", 4, 128)  # prepared once: the second call rewrites nothing
    assert [p.stat().st_mtime_ns for p in shards] == stamps
    with pytest.raises(ValueError, match="split"):
        build_loader(cfg, "test", 1, 8)


def test_sample_preparation_is_safe_when_ranks_race(tmp_path):
    cfg = sample_config(tmp_path)
    errors = []

    def rank():
        try:
            ensure_prepared(cfg)
        except Exception as e:  # surfaced below
            errors.append(e)
    threads = [threading.Thread(target=rank) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    names = sorted(p.name for p in (tmp_path / "sample").iterdir() if not p.name.startswith("."))
    assert names == ["manifest.json", "train_000000.bin", "val_000000.bin"]


RANK = """
import pathlib, sys, time
from omegaconf import OmegaConf
from data.loader import build_loader
cfg, ready, go = OmegaConf.load(sys.argv[1]), pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
ready.touch()
while not go.exists():
    time.sleep(0.001)
x, y = build_loader(cfg, "train", 4, 128).next_batch()
print(int(x.sum()), int(y.sum()))
"""


@pytest.mark.slow
def test_sample_preparation_is_safe_when_processes_race(tmp_path):
    """Three processes (as torchrun ranks, or two runs) build the data=sample loader at the same instant:
    one prepares, the others wait on the lock, all read the same complete shards."""
    cfg = sample_config(tmp_path)
    OmegaConf.save(cfg, tmp_path / "cfg.yaml")
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path / "cfg.yaml"), str(tmp_path / f"ready{r}"),
                               str(tmp_path / "go")], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(3)]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready{r}").exists() for r in range(3)) and time.monotonic() < deadline:
        time.sleep(0.01)
    (tmp_path / "go").touch()
    results = [rank.communicate(timeout=300) for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), [err for _, err in results]
    assert len({out for out, _ in results}) == 1  # every rank read the same first batch
    reference = sample_config(tmp_path / "ref")
    ensure_prepared(reference)
    for name in ("train_000000.bin", "val_000000.bin"):
        assert (tmp_path / "sample" / name).read_bytes() == (tmp_path / "ref" / "sample" / name).read_bytes()
    assert json.loads((tmp_path / "sample" / "manifest.json").read_text())["complete"]
    assert sorted(p.name for p in (tmp_path / "sample").iterdir()) == [".lock", "manifest.json", "train_000000.bin",
                                                                       "val_000000.bin"]


def test_build_loader_without_shards_says_how_to_prepare(tmp_path):
    cfg = OmegaConf.load(CONFIGS / "text.yaml")
    cfg.dir = str(tmp_path)
    with pytest.raises(FileNotFoundError, match="prepare"):
        build_loader(cfg, "train", 1, 8)



def assert_names_bad_token(err, file, position, token_id):
    message = str(err.value)
    assert f"{file}: token {position:,} " in message and f"token id {token_id}," in message, message
    assert "[0, 50257)" in message and "data.tokenizer" in message and "python -m data.prepare_text" in message


@pytest.mark.parametrize("bad_id", [60000, 50300])  # beyond the model's 50304 outputs; inside them, no token
def test_out_of_vocabulary_ids_are_refused_with_file_and_position(tmp_path, bad_id):
    rng = np.random.default_rng()
    cfg = OmegaConf.load(CONFIGS / "text.yaml")
    cfg.dir = str(tmp_path)
    clean, bad = rng.integers(0, V, size=5000), rng.integers(0, V, size=5000)
    pos = int(rng.integers(0, 5000))
    bad[pos] = bad_id
    write_shard(tmp_path / "train_000000.bin", clean)
    write_shard(tmp_path / "train_000001.bin", bad)
    write_shard(tmp_path / "val_000000.bin", clean)
    loader = build_loader(cfg, "train", 2, 100)
    for _ in range(4999 // 200):  # the batches inside the clean shard
        loader.next_batch()
    with pytest.raises(ValueError) as err:  # the first batch reaching the bad shard, wherever its bad id is
        loader.next_batch()
    assert_names_bad_token(err, tmp_path / "train_000001.bin", pos, bad_id)
    write_shard(tmp_path / "val_000000.bin", bad)
    with pytest.raises(ValueError) as err:
        build_loader(cfg, "val", 1, 8).next_batch()
    assert_names_bad_token(err, tmp_path / "val_000000.bin", pos, bad_id)
    bad[pos] = V - 1  # the largest id the tokenizer has is fine
    write_shard(tmp_path / "val_000000.bin", bad)
    build_loader(cfg, "val", 1, 8).next_batch()


def test_loader_refuses_an_unfinished_preparation(tmp_path):
    cfg = OmegaConf.load(CONFIGS / "text.yaml")
    cfg.dir = str(tmp_path)
    write_shard(tmp_path / "train_000000.bin", np.arange(1000))
    write_shard(tmp_path / "val_000000.bin", np.arange(1000))
    build_loader(cfg, "train", 1, 8)  # shards without manifest.json (e.g. llm.c's) load as they are
    (tmp_path / "manifest.json").write_text(json.dumps({"complete": False, "shards": [{}, {}]}))
    with pytest.raises(ValueError, match="manifest.json: the preparation .* not finished.*run the same prepare"):
        build_loader(cfg, "train", 1, 8)


# ---- LongCrawl64 ----

def token_at(doc, pos):
    return (doc * 1009 + pos * 7) % 50257 + (pos == 0)  # never an all-zero document


def make_longcrawl(root, train_docs=12, val_docs=4, chunks=(2, 16384), cols=DOC_LEN):
    for name, n in (("train.zarr", train_docs), ("heldout.zarr", val_docs)):
        d, p = np.meshgrid(np.arange(n), np.arange(cols), indexing="ij")
        array = zarr.create_array(Path(root) / name, shape=(n, cols), chunks=chunks, dtype="uint16", zarr_format=2)
        array[:] = token_at(d, p).astype(np.uint16)
    return Path(root)


@pytest.fixture(scope="module")
def longcrawl(tmp_path_factory):
    return make_longcrawl(tmp_path_factory.mktemp("longcrawl64"))


def chunk(doc, col, T):
    positions = np.arange(col * T, (col + 1) * T)[None]
    return torch.from_numpy(token_at(np.asarray(doc)[:, None], positions).astype(np.int64))


def test_longcrawl_paper_order_bos_and_resume(longcrawl):
    array = open_split(longcrawl, "train", check_rows=False)
    B, T = 4, 16384
    loader = LongCrawl64Loader(array, B, T, vocab_size=V)  # 12 docs: 3 batches per column, 4 columns
    for step in range(3 * 4 + 2):  # one epoch, then it starts over
        x, y = loader.next_batch()
        col, block = divmod(step % 12, 3)
        expected = chunk(np.arange(block * B, block * B + B), col, T)
        assert torch.equal(y, expected)
        assert (x[:, 0] == EOT).all() and torch.equal(x[:, 1:], y[:, :-1])
        if step == 6:
            state = loader.state_dict()
            after = [loader.next_batch() for _ in range(3)]
            resumed = LongCrawl64Loader(array, B, T, vocab_size=V)
            resumed.load_state_dict(state)
            assert resumed.source_counts() == {str(longcrawl / "train.zarr"): 7 * B}
            assert all(torch.equal(a[1], resumed.next_batch()[1]) for a in after)
            loader.load_state_dict(state)


def test_longcrawl_ranks_split_each_global_batch(longcrawl):
    array = open_split(longcrawl, "train", check_rows=False)
    T = 8192
    one = LongCrawl64Loader(array, 2, T, vocab_size=V)
    ranks = [LongCrawl64Loader(array, 2, T, rank=r, world_size=2, vocab_size=V) for r in range(2)]
    seen = set()
    for _ in range(12):  # 12 docs / 4 per global batch = 3 steps per column
        for rank in ranks:
            y = rank.next_batch()[1]
            assert torch.equal(y, one.next_batch()[1])
            key = (y[:, :4].numpy().tobytes())
            assert key not in seen  # no chunk is read twice within an epoch
            seen.add(key)


def test_longcrawl_shuffled_order(longcrawl):
    array = open_split(longcrawl, "train", check_rows=False)
    B, T = 3, 32768  # 2 columns
    first = [LongCrawl64Loader(array, B, T, order="shuffled", seed=1, vocab_size=V).next_batch()[1] for _ in range(2)]
    assert torch.equal(first[0], first[1])  # deterministic
    loader = LongCrawl64Loader(array, B, T, order="shuffled", seed=1, vocab_size=V)
    batches = [loader.next_batch()[1] for _ in range(8)]  # one epoch: 4 batches per column pass, 2 passes
    where = {chunk([d], c, T)[0, :8].numpy().tobytes(): (d, c) for d in range(12) for c in range(2)}
    found = [where[row[:8].numpy().tobytes()] for y in batches for row in y]
    assert sorted(found) == [(d, c) for d in range(12) for c in range(2)]  # every chunk once per epoch
    assert [d for d, _ in found[:12]] != list(range(12))  # not file order
    assert len({c for _, c in found[:12]}) == 1  # one column per pass


def test_longcrawl_array_checks(tmp_path, longcrawl):
    with pytest.raises(ValueError, match="6,609,334"):
        open_split(longcrawl, "train")  # the fixture is not the official size
    with pytest.raises(ValueError, match="nothing.*train.zarr.*cannot open"):
        open_split(tmp_path / "nothing", "train")
    wrong = make_longcrawl(tmp_path / "wrong", train_docs=2, val_docs=2, chunks=(2, 1000), cols=1000)
    with pytest.raises(ValueError, match="shape \\(2, 1000\\).*65536"):
        open_split(wrong, "val", check_rows=False)
    zarr.create_array(tmp_path / "f" / "heldout.zarr", shape=(2, DOC_LEN), dtype="float32", zarr_format=2)
    with pytest.raises(ValueError, match="dtype float32"):
        open_split(tmp_path / "f", "val", check_rows=False)
    zeros = zarr.create_array(tmp_path / "z.zarr", shape=(3, DOC_LEN), dtype="uint16", zarr_format=2)
    zeros[0] = 5
    with pytest.raises(ValueError, match="all zeros"):
        check_values("z.zarr", zeros)


@pytest.mark.parametrize("split", ["train", "val"])
def test_longcrawl_out_of_vocabulary_id_names_document_and_position(tmp_path, split):
    rng = np.random.default_rng()
    root = make_longcrawl(tmp_path, train_docs=4, val_docs=4, chunks=(1, DOC_LEN))
    name = {"train": "train.zarr", "val": "heldout.zarr"}[split]
    doc, pos, bad_id = int(rng.integers(0, 4)), int(rng.integers(0, DOC_LEN)), int(rng.choice([50300, 60000]))
    zarr.open_array(root / name, mode="r+")[doc, pos] = bad_id
    cfg = OmegaConf.load(CONFIGS / "longcrawl64.yaml")
    cfg.dir, cfg.check_rows = str(root), False
    loader = build_loader(cfg, split, 1, DOC_LEN)
    for _ in range(doc):
        loader.next_batch()
    with pytest.raises(ValueError) as err:
        loader.next_batch()
    message = str(err.value)
    assert f"{root / name}: document {doc:,}, token {pos:,} holds token id {bad_id}," in message, message
    assert "data.tokenizer" in message and "data.prepare_longcrawl64" in message


def test_longcrawl_loader_refuses_an_unfinished_copy(tmp_path):
    root = make_longcrawl(tmp_path, train_docs=2, val_docs=2)
    (root / "manifest.json").write_text(json.dumps({"arrays": {"train": {
        "complete": False, "documents_done": 1, "documents": 2}}}))
    cfg = OmegaConf.load(CONFIGS / "longcrawl64.yaml")
    cfg.dir, cfg.check_rows = str(root), False
    with pytest.raises(ValueError, match="train.zarr is only partly copied .*1 of 2 documents.*run the same"):
        build_loader(cfg, "train", 1, DOC_LEN)
    build_loader(cfg, "val", 1, DOC_LEN)  # the other split is not refused


def test_build_loader_longcrawl64(longcrawl):
    cfg = OmegaConf.load(CONFIGS / "longcrawl64.yaml")
    cfg.dir, cfg.check_rows = str(longcrawl), False
    train = build_loader(cfg, "train", 2, 16384, rank=1, world_size=2)
    assert torch.equal(train.next_batch()[1], chunk([2, 3], 0, 16384))
    val = build_loader(cfg, "val", 1, DOC_LEN)
    x, y = val.next_batch()
    assert y.shape == (1, DOC_LEN) and torch.equal(y, chunk([0], 0, DOC_LEN)) and x[0, 0] == EOT
    cfg.order = "shuffled"
    assert build_loader(cfg, "val", 1, DOC_LEN).order == "paper"  # validation is always file order


def test_distinct_tokens_of_a_mix_stop_where_the_first_source_wraps(tmp_path):
    """A mix reads sources in proportion to their weights; the distinct tokens it serves end when the
    first source runs out: 1000 tokens at share 3/4 last 1333 tokens, 4000 at 1/4 would last 16000."""
    write_shard(tmp_path / "a.bin", np.random.randint(0, 50257, 1000))
    write_shard(tmp_path / "b.bin", np.random.randint(0, 50257, 4000))
    one = TokenLoader([[tmp_path / "b.bin"]], 2, 8, vocab_size=50257)
    mix = TokenLoader([[tmp_path / "a.bin"], [tmp_path / "b.bin"]], 2, 8, vocab_size=50257, weights=[3, 1])
    assert one.distinct_tokens() == 4000
    assert mix.distinct_tokens() == 1333
