"""prepare_text / prepare_fineweb_edu / prepare_longcrawl64 on small local fixtures (no network)."""
import gzip
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zarr
from omegaconf import OmegaConf

import data.sources
from data import REPO_ROOT, prepare_fineweb_edu, prepare_longcrawl64, prepare_text
from data.loader import build_loader
from data.longcrawl64 import DOC_LEN
from data.shards import read_shard, write_shard
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


def test_a_few_invalid_utf8_bytes_are_repaired_but_mostly_invalid_text_is_refused(tmp_path):
    rng = np.random.default_rng()
    text = bytearray(" ".join(WORDS[rng.integers(0, len(WORDS), 2000)]).encode())
    for i in rng.choice(len(text), 3, replace=False):  # 3 stray bytes in ~10 KB, as web text has
        text[i] = 0xFF
    (tmp_path / "mostly_ok.txt").write_bytes(bytes(text))
    prepare_text.main(["--source", str(tmp_path / "mostly_ok.txt"), "--out", str(tmp_path / "o"), "--val-tokens", "10",
                       "--workers", "1"])
    assert check_manifest(tmp_path / "o")["counts"]["repaired_invalid_utf8"] == 1  # counted once per document
    latin1 = "Ça coûte très cher, déjà à Noël. ".encode("latin-1") * 2000  # 7 of every 33 bytes invalid
    (tmp_path / "latin1.txt").write_bytes(b"a valid UTF-8 head " * 4000 + latin1)  # bad only after the checked head
    with pytest.raises(ValueError, match="latin1.txt: not UTF-8 text .* the first at byte 76,000.*iconv"):
        prepare_text.main(["--source", str(tmp_path / "latin1.txt"), "--out", str(tmp_path / "p"), "--workers", "1"])


# ---- bad input, through the command line (exit code 2 and one line naming the file or option) ----

WORDS = np.array("the of and a to in is was he for it with as his on be at by had not are but from or".split())


def cli(script, *args, env=None):
    """Run `python -m data.<script> ARGS` as a user would."""
    return subprocess.run([sys.executable, "-m", f"data.{script}", *map(str, args)], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def assert_refused(result, *fragments):
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    for fragment in fragments:
        assert fragment in last, (fragment, last)


def write_text_files(folder, n, words=300):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng()
    for i in range(n):
        (folder / f"doc_{i:03d}.txt").write_text(" ".join(WORDS[rng.integers(0, len(WORDS), words)]) + ".\n")
    return folder


def no_output(out):
    return not out.exists() or not list(out.glob("*.bin")) and not (out / "manifest.json").exists()


@pytest.mark.parametrize("case", ["system binary"] + [pytest.param(case, marks=pytest.mark.slow) for case in [
    "binary named .txt", "latin-1 text", "unknown extension", "broken gzip", "not parquet", "empty file", "blank file",
    "empty folder", "missing path"]])
def test_prepare_text_refuses_bad_sources(tmp_path, case):
    rng = np.random.default_rng()
    src = write_text_files(tmp_path / "src", 3)  # good files beside the bad one: nothing is prepared from them
    bad = {"system binary": Path("/bin/ls"), "binary named .txt": src / "weights.txt",
           "latin-1 text": src / "latin1.txt", "unknown extension": src / "table.csv", "broken gzip": src / "x.txt.gz",
           "not parquet": src / "x.parquet", "empty file": tmp_path / "empty.txt", "blank file": tmp_path / "blank.txt",
           "empty folder": tmp_path / "nothing", "missing path": tmp_path / "no_such_file.txt"}[case]
    problem, fix = {  # what the message says is wrong, and what it says to do
        "system binary": ("/bin/ls: not a text file (a NUL byte at byte", "leave binary files out of the sources"),
        "binary named .txt": ("weights.txt: not a text file (a NUL byte at byte", "leave binary files out"),
        "latin-1 text": ("latin1.txt: not UTF-8 text (", "convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8)"),
        "unknown extension": ("table.csv: unknown file type '.csv'", "rename it to .txt if it is plain UTF-8 text"),
        "broken gzip": ("x.txt.gz: cannot decompress it", "replace it or leave it out of the sources"),
        "not parquet": ("x.parquet: not a readable parquet file", "replace it or leave it out of the sources"),
        "empty file": ("all 1 input files are empty", "name files that hold documents"),
        "blank file": ("the sources hold no documents", "check the source files"),
        "empty folder": ("nothing'] (looked for", "name the files or the folder that holds them"),
        "missing path": ("no_such_file.txt': no such file", "check the path")}[case]
    sources = [bad, src] if case not in ("empty file", "blank file", "empty folder") else [bad]
    if case == "system binary" and not bad.exists():
        pytest.skip("no /bin/ls")
    if case == "binary named .txt":
        payload = bytearray(rng.integers(1, 256, 5000, dtype=np.uint8).tobytes())
        payload[int(rng.integers(0, 5000))] = 0
        bad.write_bytes(bytes(payload))
    elif case == "latin-1 text":
        bad.write_bytes("Ça coûte très cher, déjà à Noël.\n".encode("latin-1") * 100)
    elif case == "unknown extension":
        bad.write_text("a,b\n1,2\n")
    elif case == "broken gzip":
        bad.write_bytes(b"\x1f\x8b" + rng.integers(0, 256, 100, dtype=np.uint8).tobytes())
    elif case == "not parquet":
        bad.write_text("not a parquet file at all\n" * 10)
    elif case == "empty file":
        bad.write_bytes(b"")
    elif case == "blank file":
        bad.write_text(" \n\n\t \n")
    elif case == "empty folder":
        bad.mkdir()
    out = tmp_path / "out"
    result = cli("prepare_text", "--source", *sources, "--out", out, "--val-tokens", "10", "--workers", "1")
    assert_refused(result, problem, fix)
    assert no_output(out)


def test_prepare_text_validation_split_larger_than_the_data(tmp_path):
    src = write_text_files(tmp_path / "src", 2, words=50)
    result = cli("prepare_text", "--source", src, "--out", tmp_path / "out", "--workers", "1")
    assert_refused(result, "nothing is left for training; give --val-tokens a value below")
    assert no_output(tmp_path / "out")  # no short val shard: the suggested rerun starts clean
    total = int(result.stderr.split("the sources gave ")[1].split(" tokens")[0].replace(",", ""))
    result = cli("prepare_text", "--source", src, "--out", tmp_path / "out", "--workers", "1",
                 "--val-tokens", total - 1)
    assert result.returncode == 0, result.stderr
    assert check_manifest(tmp_path / "out")["tokens"] == {"val": total - 1, "train": 1}


@pytest.mark.slow
def test_prepare_text_refuses_an_output_folder_holding_other_data(tmp_path):
    src = write_text_files(tmp_path / "src", 3)
    out = tmp_path / "out"
    out.mkdir()
    stray = np.random.default_rng().integers(0, 50257, 100)
    write_shard(out / "train_000007.bin", stray)  # shards of unknown origin, no manifest: never mixed in
    args = ["--source", src, "--out", out, "--val-tokens", "10", "--workers", "1"]
    assert_refused(cli("prepare_text", *args), f"{out} already holds shards without a manifest.json (train_000007.bin)",
                   "--overwrite")
    assert np.array_equal(read_shard(out / "train_000007.bin"), stray)  # untouched
    assert cli("prepare_text", *args, "--overwrite").returncode == 0
    assert not (out / "train_000007.bin").exists() and check_manifest(out)["complete"]
    assert cli("prepare_text", *args).returncode == 0  # the same preparation again: a no-op, not a refusal
    assert_refused(cli("prepare_text", *args[:-4], "--val-tokens", "20", "--workers", "1"),
                   "already holds a preparation with other settings (val_tokens: 10 -> 20)", "--overwrite")
    (tmp_path / "lc").mkdir()
    (tmp_path / "lc" / "manifest.json").write_text(json.dumps({"source": "/data/lc64", "arrays": {}}))
    assert_refused(cli("prepare_text", "--source", src, "--out", tmp_path / "lc"),
                   "already holds a manifest.json that is not a shard preparation's")
    (tmp_path / "file").write_text("x")
    assert_refused(cli("prepare_text", "--source", src, "--out", tmp_path / "file"), "file is a file; name a folder")


@pytest.mark.parametrize("option, value, expected", [
    ("--workers", "0", "argument --workers: 0 is not in [1, inf]"),
] + [pytest.param(*case, marks=pytest.mark.slow) for case in [
    ("--shard-tokens", "0", "argument --shard-tokens: 0 is not in [1, 2147483647]"),
    ("--shard-tokens", "3G", "argument --shard-tokens: 3000000000 is not in [1, 2147483647]"),
    ("--max-tokens", "1.5", "argument --max-tokens: not a whole number: '1.5'"),
    ("--val-tokens", "ten", "argument --val-tokens: not a count: 'ten'"),
    ("--max-shards", "0", "argument --max-shards: 0 is not in [1, inf]"),
]])
def test_prepare_text_refuses_out_of_range_options(tmp_path, option, value, expected):
    src = write_text_files(tmp_path / "src", 1)
    assert_refused(cli("prepare_text", "--source", src, "--out", tmp_path / "out", option, value), expected)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_fineweb_edu_refuses_bad_sources_and_options(tmp_path):
    assert_refused(cli("prepare_fineweb_edu", "--source", tmp_path / "typo", "--out", tmp_path / "o"),
                   f"--source {tmp_path / 'typo'}: no such file or folder (a Hub dataset is named owner/name")
    assert_refused(cli("prepare_fineweb_edu", "--source", tmp_path, "--out", tmp_path / "o", "--min-int-score", "9"),
                   "argument --min-int-score: 9 is not in [0, 5]")
    offline = {**os.environ, "HF_HUB_OFFLINE": "1"}
    assert_refused(cli("prepare_fineweb_edu", "--source", "someone/no-such-dataset", "--out", tmp_path / "o",
                       env=offline), "--source someone/no-such-dataset --config sample-10BT: cannot get the Hub")


# ---- interrupted preparation ----

def shards_are_whole(out):
    """Every file under a shard's name is a complete shard; the manifest lists only such files, with their hashes."""
    for path in [*out.glob("train_*.bin"), *out.glob("val_*.bin")]:
        read_shard(path)  # raises on a truncated or foreign file
    if (out / "manifest.json").exists():
        manifest = json.loads((out / "manifest.json").read_text())
        for shard in manifest["shards"]:
            assert hashlib.sha256((out / shard["file"]).read_bytes()).hexdigest() == shard["sha256"]
        return manifest
    return None


@pytest.mark.slow
def test_prepare_killed_at_random_points_resumes_to_the_same_bytes(tmp_path):
    """kill -9 mid-run, three times: no half shard under a shard's name, the loader refuses the unfinished
    folder, and the resumed result equals an uninterrupted run's bytes."""
    src = write_text_files(tmp_path / "src", 100, words=1000)
    args = ["--source", str(src), "--shard-tokens", "1000", "--val-tokens", "1000", "--workers", "1"]
    prepare_text.main([*args, "--out", str(tmp_path / "full")])
    out = tmp_path / "out"
    cfg = OmegaConf.load(REPO_ROOT / "configs" / "data" / "text.yaml")
    cfg.dir = str(out)
    rng = np.random.default_rng()
    unfinished = 0
    for kill in range(3):
        proc = subprocess.Popen([sys.executable, "-m", "data.prepare_text", *args, "--out", str(out)], cwd=REPO_ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shards_before = len(list(out.glob("*.bin")))
        deadline = time.monotonic() + 60
        while len(list(out.glob("*.bin"))) <= shards_before and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)  # until this run has written a shard of its own
        time.sleep(float(rng.uniform(0, 0.15)) * kill)  # the first kill right after a shard, later ones anywhere
        proc.send_signal(signal.SIGKILL)  # kill -9 (nothing, if this run has already finished)
        proc.wait()
        manifest = shards_are_whole(out)
        if manifest is not None and not manifest["complete"]:
            unfinished += 1
            with pytest.raises(ValueError, match="has not finished.*run the same prepare command again"):
                build_loader(cfg, "train", 1, 8)
    assert unfinished >= 1  # at least one kill landed mid-run (the first one lands right after a shard)
    assert prepare_text.main([*args, "--out", str(out)])["complete"]
    assert file_hashes(out) == file_hashes(tmp_path / "full")
    assert not list(out.glob("*.tmp*"))  # temp files of killed writes are cleaned up by the run that resumes
    build_loader(cfg, "train", 1, 8)


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


@pytest.mark.slow
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


def test_prepare_longcrawl64_never_writes_through_a_link_and_refuses_other_folders(tmp_path, monkeypatch, capsys):
    arrays = longcrawl_fixture(tmp_path / "src", docs=5)
    src, out = str(tmp_path / "src"), tmp_path / "out"
    prepare_longcrawl64.main(["--source", src, "--out", str(out), "--any-rows", "--splits", "train"])
    assert (out / "train.zarr").is_symlink()
    monkeypatch.setattr(prepare_longcrawl64, "BLOCK_BYTES", 2 * DOC_LEN * 2)  # blocks of 2 documents
    partial = prepare_longcrawl64.main(["--source", src, "--out", str(out), "--any-rows", "--splits", "train",
                                        "--copy", "--max-blocks", "1"])
    assert not (out / "train.zarr").is_symlink() and partial["arrays"]["train"]["documents_done"] == 2
    assert np.array_equal(zarr.open_array(tmp_path / "src" / "train.zarr")[:], arrays["train.zarr"])  # source intact
    cfg = OmegaConf.load(REPO_ROOT / "configs" / "data" / "longcrawl64.yaml")
    cfg.dir, cfg.check_rows = str(out), False
    with pytest.raises(ValueError, match="train.zarr is only partly copied .*2 of 5 documents"):
        build_loader(cfg, "train", 1, DOC_LEN)  # its missing chunks would read as zeros
    with pytest.raises(ValueError, match="train.zarr holds a copy made with --copy .*pass --copy to continue it"):
        prepare_longcrawl64.main(["--source", src, "--out", str(out), "--any-rows", "--splits", "train"])
    done = prepare_longcrawl64.main(["--source", src, "--out", str(out), "--any-rows", "--splits", "train", "--copy"])
    assert done["arrays"]["train"]["complete"]
    assert np.array_equal(zarr.open_array(out / "train.zarr")[:], arrays["train.zarr"])
    build_loader(cfg, "train", 1, DOC_LEN)
    with pytest.raises(ValueError, match="prepared from .*src, not .*elsewhere; use another --out"):
        prepare_longcrawl64.main(["--source", str(tmp_path / "elsewhere"), "--out", str(out)])
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "manifest.json").write_text(json.dumps({"settings": {}, "complete": True, "shards": []}))
    with pytest.raises(ValueError, match="manifest.json is not a LongCrawl64 copy's .*use another --out"):
        prepare_longcrawl64.main(["--source", src, "--out", str(shards)])
    for option in ("--workers", "--check-docs", "--max-blocks"):
        with pytest.raises(SystemExit) as exit_:
            prepare_longcrawl64.main(["--source", src, "--out", str(out), option, "0"])
        assert exit_.value.code == 2 and f"argument {option}: 0 is not in [1, inf]" in capsys.readouterr().err
