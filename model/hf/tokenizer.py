"""The GPT-2 tokenizer as Hugging Face files, built offline from the tiktoken ranks this repo uses.

GPT-2's BPE is byte-level: vocab.json maps each token's bytes, spelled through GPT-2's byte-to-unicode
table, to its id (= its tiktoken rank), and merges.txt lists, in rank order, the pair of tokens that
every multi-byte token is merged from. Both follow from the ranks alone: a token's pair is what BPE
produces from its bytes using only the merges ranked below it.
"""
import functools

from transformers import GPT2Tokenizer

from data.tokenizer import get_tokenizer

GPT2_VOCAB = 50257       # 50256 BPE tokens + <|endoftext|>
EOT_TEXT = "<|endoftext|>"


@functools.lru_cache(maxsize=None)
def byte_to_unicode():
    """GPT-2's table: printable bytes map to themselves, the others to code points from 256 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def spell(token_bytes):
    table = byte_to_unicode()
    return "".join(table[b] for b in token_bytes)


def merge_pair(ranks, token, rank):
    """The two tokens BPE merges into `token`, applying only merges ranked below `rank`."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        pairs = [(ranks.get(a + b, rank), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        best, i = min(pairs)
        if best >= rank:
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise ValueError(f"GPT-2 token {rank} ({token!r}) is not a merge of two lower-ranked tokens")
    return parts


@functools.lru_cache(maxsize=None)
def gpt2_vocab_and_merges():
    """(vocab: spelled token -> id, merges: [(left, right)] in rank order) of the GPT-2 tokenizer."""
    enc = get_tokenizer("gpt2")
    ranks = {enc.decode_single_token_bytes(i): i for i in range(enc.eot_token)}
    vocab = {spell(token): rank for token, rank in ranks.items()}
    vocab[EOT_TEXT] = enc.eot_token
    merges = [tuple(spell(part) for part in merge_pair(ranks, token, rank))
              for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]) if len(token) > 1]
    return vocab, merges


def save_gpt2_tokenizer(out_dir, model_max_length):
    """Write GPT-2's tokenizer (tokenizer.json and tokenizer_config.json) into out_dir."""
    vocab, merges = gpt2_vocab_and_merges()
    tok = GPT2Tokenizer(vocab=dict(vocab), merges=list(merges), model_max_length=model_max_length)
    tok.save_pretrained(out_dir)


def check_gpt2_vocab(vocab, where):
    """Raise naming the first difference when a {token: id} vocabulary is not GPT-2's."""
    expected, _ = gpt2_vocab_and_merges()
    if len(vocab) != len(expected):
        raise ValueError(f"{where}: the tokenizer has {len(vocab)} tokens, GPT-2's has {len(expected)}; "
                         "only the GPT-2 tokenizer is supported")
    for token, i in expected.items():
        if vocab.get(token) != i:
            raise ValueError(f"{where}: token {token!r} has id {vocab.get(token)}, GPT-2's is {i}; "
                             "only the GPT-2 tokenizer is supported")
