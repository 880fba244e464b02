"""prepare_text / prepare_fineweb_edu / prepare_longcrawl64 on small local fixtures (no network)."""
import gzip
import hashlib
import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zarr

import data.sources
from data import REPO_ROOT, prepare_fineweb_edu, prepare_longcrawl64, prepare_text
from data.longcrawl64 import DOC_LEN
from data.shards import read_shard
from data.tokenizer import EOT, get_tokenizer

WIKI = REPO_ROOT.parent / "shared" / "data" / "text" / "wikipedia_en_wikiextractor"  # ../shared beside the repo


def decoded_documents(out_dir, tokenizer="gpt2"):
    """The documents of all shards (val first), rebuilt by splitting the token stream at EOT."""
    manifest = json.loads((Path(out_dir) / "manifest.json").read_text())
    stream = np.concatenate([read_shard(Path(out_dir) / s["file"]) for s in manifest["shards"]])
    starts = np.flatnonzero(stream == EOT)
    assert starts[0] == 0
    enc = get_tokenizer(tokenizer)
    return [enc.decode(stream[a + 1:b].tolist()) for a, b in zip(starts, [*starts[1:], len(stream)], strict=True)]


def file_hashes(out_dir):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(out_dir).iterdir())
            if p.suffix in (".bin", ".json")}


def check_manifest(out_dir):
    manifest = json.loads((Path(out_dir) / "manifest.json").read_text())
    for shard in manifest["shards"]:
        path = Path(out_dir) / shard["file"]
        tokens = read_shard(path)
        assert len(tokens) == shard["tokens"] and shard["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        assert shard["documents"] == int(np.count_nonzero(tokens == EOT))
    for split in ("train", "val"):
        assert manifest["tokens"][split] == sum(s["tokens"] for s in manifest["shards"] if s["split"] == split)
        assert manifest["documents"][split] == sum(s["documents"] for s in manifest["shards"] if s["split"] == split)
    return manifest


# ---- prepare_text ----

def wiki_documents(path):
    """WikiExtractor documents with a body, parsed independently of data/sources.py."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        text = f.read()
    docs = re.findall(r"<doc [^>]*>\n(.*?)</doc>", text, flags=re.S)
    return [d.strip() for d in docs if "\n" in d.strip()]


@pytest.mark.skipif(not WIKI.exists(), reason="needs ../shared/data/text (.ci/run requires it)")
def test_prepare_text_wikiextractor(tmp_path):
    files = [str(WIKI / "wiki_00.gz"), str(WIKI / "wiki_01.gz")]
    manifest = prepare_text.main(["--source", *files, "--out", str(tmp_path), "--val-tokens", "20000",
                                  "--shard-tokens", "150K", "--workers", "2"])
    expected = wiki_documents(files[0]) + wiki_documents(files[1])
    assert decoded_documents(tmp_path) == expected
    manifest = check_manifest(tmp_path)
    assert manifest["complete"] and manifest["tokens"]["val"] == 20000
    assert [s["tokens"] for s in manifest["shards"] if s["split"] == "train"][:-1] == [150_000] * 2
    assert manifest["counts"]["documents_kept"] == len(expected) and manifest["counts"]["skipped_empty"] > 1000


def test_prepare_text_mixed_formats_decode_exactly(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a_story.txt").write_text("Once upon a time.\n\nThe end — “fin”.\n")
    rows = [{"text": f"json doc {i}: \"quoted\" line\nsecond line ünïcödé", "id": i} for i in range(40)]
    rows[3]["text"] = "   "  # empty: skipped and counted
    with open(src / "b.jsonl", "wb") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False).encode() + b"\n")
        f.write(b'{"text": "bad byte \xff here"}\n')  # not UTF-8: repaired and counted
    with gzip.open(src / "c.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": "from a gzipped jsonl"}) + "\n")
    pq.write_table(pa.table({"text": ["parquet one", "parquet two", ""], "id": ["x", "y", "z"]}), src / "d.parquet",
                   row_group_size=2)
    monkeypatch.setattr(data.sources, "UNIT_BYTES", 300)  # several byte-range units in b.jsonl
    assert len([u for u in data.sources.list_units(data.sources.expand_sources([str(src)]))
                if u.path.endswith("b.jsonl")]) > 3
    prepare_text.main(["--source", str(src), "--out", str(tmp_path / "out"), "--val-tokens", "10",
                       "--workers", "1"])
    expected = (["Once upon a time.\n\nThe end — “fin”.\n"] + [r["text"] for r in rows if r["text"].strip()]
                + ["bad byte \ufffd here", "from a gzipped jsonl", "parquet one", "parquet two"])
    assert decoded_documents(tmp_path / "out") == expected
    counts = check_manifest(tmp_path / "out")["counts"]
    assert counts == {"documents_kept": len(expected), "skipped_empty": 2, "repaired_invalid_utf8": 1}


def test_missing_text_column_is_a_clear_error(tmp_path):
    pq.write_table(pa.table({"content": ["no text column"]}), tmp_path / "x.parquet")
    with pytest.raises(ValueError, match=r"x.parquet: no 'text' column \(found: content\)"):
        prepare_text.main(["--source", str(tmp_path / "x.parquet"), "--out", str(tmp_path / "o"), "--workers", "1"])
    (tmp_path / "y.jsonl").write_text('{"body": "no text field"}\n')
    with pytest.raises(ValueError, match=r"y.jsonl \(byte 0\): no 'text'"):
        prepare_text.main(["--source", str(tmp_path / "y.jsonl"), "--out", str(tmp_path / "p"), "--workers", "1"])


def test_all_tokens_in_validation_is_an_error(tmp_path):
    (tmp_path / "a.txt").write_text("too short to train on")
    with pytest.raises(ValueError, match="nothing is left for training; give --val-tokens a value below 6"):
        prepare_text.main(["--source", str(tmp_path / "a.txt"), "--out", str(tmp_path / "o"), "--workers", "1"])


# ---- prepare_fineweb_edu ----

def fineweb_fixture(folder, n_files=2, rows_per_file=60):
    """Parquet files in FineWeb-Edu's schema, several row groups each."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    words = "the of education learning science history students teachers a physics math".split()
    docs = []
    for f in range(n_files):
        texts = [" ".join(rng.choice(words, rng.integers(20, 120))).capitalize() + "." for _ in range(rows_per_file)]
        scores = rng.uniform(1.5, 4.5, rows_per_file)
        table = pa.table({
            "text": texts, "id": [f"<urn:uuid:{f}-{i}>" for i in range(rows_per_file)],
            "dump": ["CC-MAIN-2024-10"] * rows_per_file,
            "url": [f"https://example.org/{f}/{i}" for i in range(rows_per_file)],
            "file_path": ["s3://commoncrawl/x.warc.gz"] * rows_per_file, "language": ["en"] * rows_per_file,
            "language_score": np.full(rows_per_file, 0.97), "token_count": [len(t.split()) for t in texts],
            "score": scores, "int_score": np.round(scores).astype(np.int64)})
        pq.write_table(table, folder / f"{f:03d}_00000.parquet", row_group_size=16)
        docs += list(zip(texts, table.column("int_score").to_pylist(), strict=True))
    return docs


def run_fineweb(src, out, *extra):
    return prepare_fineweb_edu.main(["--source", str(src), "--out", str(out), "--val-tokens", "500",
                                     "--shard-tokens", "1000", "--min-int-score", "3", *extra])


def test_fineweb_edu_filter_decode_and_workers(tmp_path):
    docs = fineweb_fixture(tmp_path / "src")
    manifest = run_fineweb(tmp_path / "src", tmp_path / "w1", "--workers", "1")
    kept = [t for t, s in docs if s >= 3]
    assert 0 < len(kept) < len(docs)
    assert decoded_documents(tmp_path / "w1") == kept
    manifest = check_manifest(tmp_path / "w1")
    assert manifest["counts"] == {"documents_kept": len(kept), "skipped_below_min_int_score": len(docs) - len(kept)}
    assert manifest["tokens"]["val"] == 500 and len(manifest["shards"]) > 3
    assert {s["tokens"] for s in manifest["shards"][1:-1]} == {1000}
    assert manifest["settings"]["tokenizer"] == "gpt2" and manifest["settings"]["source"] == str(tmp_path / "src")
    run_fineweb(tmp_path / "src", tmp_path / "w2", "--workers", "2")
    assert file_hashes(tmp_path / "w1") == file_hashes(tmp_path / "w2")  # same bytes with any process count


def test_fineweb_edu_resume_is_byte_identical_and_rerun_is_a_no_op(tmp_path):
    fineweb_fixture(tmp_path / "src")
    run_fineweb(tmp_path / "src", tmp_path / "full", "--workers", "1")
    out = tmp_path / "resumed"
    partial = run_fineweb(tmp_path / "src", out, "--workers", "1", "--max-shards", "2")
    assert not partial["complete"] and len(partial["shards"]) == 2
    # a crash mid-write leaves a temp file; one between shard and manifest leaves an unlisted shard
    (out / "train_000005.bin.tmp123").write_bytes(b"half a shard")
    (out / "train_000001.bin").write_bytes((tmp_path / "full" / "train_000001.bin").read_bytes())
    run_fineweb(tmp_path / "src", out, "--workers", "2", "--max-shards", "1")
    done = run_fineweb(tmp_path / "src", out, "--workers", "1")
    assert done["complete"]
    assert file_hashes(out) == file_hashes(tmp_path / "full")
    assert not list(out.glob("*.tmp*"))
    stamps = {p: p.stat().st_mtime_ns for p in out.iterdir()}
    assert run_fineweb(tmp_path / "src", out, "--workers", "1") == done  # finished: nothing rewritten
    assert {p: p.stat().st_mtime_ns for p in out.iterdir()} == stamps


def test_fineweb_edu_budget_settings_and_damage(tmp_path):
    fineweb_fixture(tmp_path / "src")
    out = tmp_path / "out"
    manifest = run_fineweb(tmp_path / "src", out, "--workers", "1", "--max-tokens", "2500")
    assert manifest["tokens"]["train"] == 2500 and [s["tokens"] for s in manifest["shards"]] == [500, 1000, 1000, 500]
    with pytest.raises(ValueError, match="shard_tokens: 1000 -> 2000.*--overwrite"):
        run_fineweb(tmp_path / "src", out, "--workers", "1", "--max-tokens", "2500", "--shard-tokens", "2000")
    (out / "train_000001.bin").write_bytes((out / "train_000001.bin").read_bytes()[:-2])  # damaged shard
    with pytest.raises(ValueError, match="train_000001.bin: truncated"):
        run_fineweb(tmp_path / "src", out, "--workers", "1", "--max-tokens", "2500")
    manifest = run_fineweb(tmp_path / "src", out, "--workers", "1", "--max-tokens", "2500", "--overwrite")
    assert manifest["complete"] and check_manifest(out)["tokens"]["train"] == 2500


def test_fineweb_edu_min_int_score_needs_the_column(tmp_path):
    (tmp_path / "src").mkdir()
    pq.write_table(pa.table({"text": ["a doc"], "id": ["1"]}), tmp_path / "src" / "a.parquet")
    with pytest.raises(ValueError, match="no 'int_score' column"):
        run_fineweb(tmp_path / "src", tmp_path / "out", "--workers", "1")


def test_prepare_scripts_document_their_options(capsys):
    for script in (prepare_text, prepare_fineweb_edu, prepare_longcrawl64):
        with pytest.raises(SystemExit):
            script.main(["--help"])
        usage = capsys.readouterr().out
        assert "--source" in usage and "--out" in usage
    for name in ("prepare_text", "prepare_fineweb_edu", "prepare_longcrawl64"):
        result = subprocess.run([sys.executable, "-m", f"data.{name}", "--help"], cwd=REPO_ROOT,
                                capture_output=True, text=True, check=True)
        assert result.stdout.startswith(f"usage: python -m data.{name} ")
        assert f"python -m data.{name} --source" in result.stdout  # the examples show the command that works
        assert "--max-" in result.stdout


def hub_reachable():
    try:
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
        return True
    except OSError:
        return False


@pytest.mark.slow
def test_fineweb_edu_from_the_hub(tmp_path):
    if not hub_reachable():
        pytest.skip("needs network access to huggingface.co")
    files = prepare_fineweb_edu.hub_files("HuggingFaceFW/fineweb-edu", "sample-10BT", download=False)
    assert files and all(f.startswith("hf://") and f.endswith(".parquet") for f in files)
    manifest = prepare_fineweb_edu.main(["--out", str(tmp_path), "--val-tokens", "10K", "--max-tokens", "50K",
                                         "--shard-tokens", "20K", "--workers", "2"])
    assert manifest["complete"] and manifest["tokens"]["train"] == 50_000


# ---- prepare_longcrawl64 ----

def longcrawl_fixture(root, docs=6, chunks=(2, DOC_LEN)):
    rng = np.random.default_rng(0)
    arrays = {}
    for name in ("train.zarr", "heldout.zarr"):
        array = zarr.create_array(root / name, shape=(docs, DOC_LEN), chunks=chunks, dtype="uint16", zarr_format=2)
        arrays[name] = rng.integers(1, 50257, size=(docs, DOC_LEN), dtype=np.uint16)
        array[:] = arrays[name]
    return arrays


def test_prepare_longcrawl64_link_and_checks(tmp_path):
    arrays = longcrawl_fixture(tmp_path / "src")
    with pytest.raises(ValueError, match="6,609,334"):
        prepare_longcrawl64.main(["--source", str(tmp_path / "src"), "--out", str(tmp_path / "out")])
    manifest = prepare_longcrawl64.main(["--source", str(tmp_path / "src"), "--out", str(tmp_path / "out"),
                                         "--any-rows"])
    assert (tmp_path / "out" / "train.zarr").is_symlink()
    assert manifest["tokenizer"] == "gpt2_json" and manifest["arrays"]["val"]["tokens"] == 6 * DOC_LEN
    assert all(entry["complete"] for entry in manifest["arrays"].values())
    assert np.array_equal(zarr.open_array(tmp_path / "out" / "heldout.zarr")[:], arrays["heldout.zarr"])
    zarr.open_array(tmp_path / "src" / "heldout.zarr", mode="r+")[4] = 0  # a broken copy
    with pytest.raises(ValueError, match="document 4 is all zeros"):
        prepare_longcrawl64.main(["--source", str(tmp_path / "src"), "--out", str(tmp_path / "o2"), "--any-rows",
                                  "--check-docs", "6"])


def test_prepare_longcrawl64_copy_resumes(tmp_path, monkeypatch):
    arrays = longcrawl_fixture(tmp_path / "src", docs=7)
    monkeypatch.setattr(prepare_longcrawl64, "BLOCK_BYTES", 2 * DOC_LEN * 2)  # blocks of 2 documents
    args = ["--source", str(tmp_path / "src"), "--out", str(tmp_path / "out"), "--any-rows", "--copy",
            "--splits", "train"]
    partial = prepare_longcrawl64.main([*args, "--max-blocks", "2"])
    assert partial["arrays"]["train"]["documents_done"] == 4 and not partial["arrays"]["train"]["complete"]
    done = prepare_longcrawl64.main(args)
    assert done["arrays"]["train"]["complete"] and "val" not in done["arrays"]
    copy = zarr.open_array(tmp_path / "out" / "train.zarr")
    assert copy.chunks == (2, DOC_LEN) and np.array_equal(copy[:], arrays["train.zarr"])
    assert prepare_longcrawl64.main(args) == done  # finished: re-run only checks
