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


# ---- build_loader and configs ----

def test_every_data_config_has_the_keys(tmp_path):
    names = sorted(p.stem for p in CONFIGS.glob("*.yaml"))
    assert names == ["fineweb_edu", "longcrawl64", "sample", "text"]
    for name in names:
        cfg = OmegaConf.load(CONFIGS / f"{name}.yaml")
        assert cfg.name == name and cfg.tokenizer in ("gpt2", "gpt2_json") and cfg.val_tokens > 0
        assert "dir" in cfg and "ranks_path" in cfg
        if name != "longcrawl64":
            assert cfg.train_pattern and cfg.val_pattern and "auto_prepare" in cfg


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
