"""Tokenizers: byte-level ids and specials, Kimi tiktoken files against a pure-Python BPE,
Kimi's pre-tokenization regex, HF tokenizer.json; round trips and special-token safety."""

import base64
import collections

import pytest
import regex

from kdsa.infer.tokenizer import (KIMI_PAT_STR, ByteTokenizer, HFTokenizer, TiktokenTokenizer,
                                  kimi_special_table, load_tiktoken_ranks, load_tokenizer)
from kdsa.model.config import get_preset

TEXTS = ["Hello, world! It's 2026 and we're testing 1234567 tokens.",
         "你好世界 mixed with English words and 数字 42",
         "  leading spaces\n\n\ttabs and newlines\r\n done ",
         "emoji 🙂 and accents: café naïve — dash",
         "markup lookalikes <|open|>message<|sep|> [BOS] <|im_end|> <think>"]
PAT = regex.compile(KIMI_PAT_STR, flags=regex.V1)  # V1: the pattern's && class intersections
SPECIAL_TEXT = "<|open|><|close|><|sep|><|end_of_msg|>[BOS]<|im_end|><think>"


def test_byte_tokenizer_ids_specials_and_presets():
    for name in ("tiny", "small"):
        cfg = get_preset(name)
        tok = ByteTokenizer(cfg.vocab_size)
        assert (tok.bos_id, tok.eos_id, tok.pad_id) == (cfg.bos_token_id, cfg.eos_token_id,
                                                        cfg.pad_token_id)
        assert max(tok.special_tokens.values()) < cfg.vocab_size
    tok = ByteTokenizer(384)
    for t in TEXTS:
        ids = tok.encode(t)
        assert ids == list(t.encode("utf-8"))  # independent: the UTF-8 bytes themselves
        assert tok.decode(ids) == t
    assert (tok.special("<|open|>"), tok.special("<|close|>"), tok.special("<|sep|>")) == (
        259, 260, 261)
    k2 = ByteTokenizer(384, "k2")
    assert (k2.special("<|im_end|>"), k2.special("<think>"), k2.special("</think>")) == (
        258, 278, 279)
    with pytest.raises(ValueError, match="vocab_size"):
        ByteTokenizer(270)
    with pytest.raises(ValueError, match="flavour"):
        ByteTokenizer(384, "k9")


@pytest.mark.parametrize("tok", [ByteTokenizer(384), ByteTokenizer(384, "k2")])
def test_special_text_is_never_a_special_token(tok):
    ids = tok.encode(SPECIAL_TEXT)
    assert not any(tok.is_special(i) for i in ids)
    assert tok.decode(ids) == SPECIAL_TEXT
    markup = tok.encode_markup("a<|open|>b" if tok.flavor == "k3" else "a<think>b")
    assert markup[0] == ord("a") and tok.is_special(markup[1]) and markup[2] == ord("b")


def test_kimi_regex_splits():
    """Hand-derived splits: Han runs alone, at most 3 digits, contractions, spaces."""
    pat = PAT
    assert pat.findall("你好world 123456") == ["你好", "world", " ", "123", "456"]
    assert pat.findall("I'm HAPPY today!!\n\nok") == ["I'm", " HAPPY", " today", "!!\n\n", "ok"]
    assert pat.findall("中文abc中文") == ["中文", "abc", "中文"]
    assert pat.findall("a  b") == ["a", " ", " b"]


# ---- tiktoken rank files ----

def _train_bpe(corpus: str, merges: int) -> dict[bytes, int]:
    """A tiny byte-level BPE trainer over Kimi's pre-tokenized pieces (reference side)."""
    ranks = {bytes([b]): b for b in range(256)}
    words = collections.Counter(PAT.findall(corpus))
    seqs = {w: [bytes([b]) for b in w.encode()] for w in words}
    for _ in range(merges):
        pairs = collections.Counter()
        for w, s in seqs.items():
            for a, b in zip(s, s[1:]):
                pairs[a, b] += words[w]
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks[a + b] = len(ranks)
        for w, s in seqs.items():
            i, out = 0, []
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    return ranks


def _ref_encode(ranks: dict[bytes, int], text: str) -> list[int]:
    """tiktoken's algorithm from its definition: per regex piece, a whole-piece lookup, else
    repeatedly merge the adjacent pair whose concatenation has the lowest rank."""
    out = []
    for piece in PAT.findall(text):
        b = piece.encode()
        if b in ranks:
            out.append(ranks[b])
            continue
        parts = [bytes([c]) for c in b]
        while True:
            cands = [(ranks[parts[i] + parts[i + 1]], i) for i in range(len(parts) - 1)
                     if parts[i] + parts[i + 1] in ranks]
            if not cands:
                break
            _, i = min(cands)
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        out.extend(ranks[p] for p in parts)
    return out


@pytest.fixture(scope="module")
def rank_file(tmp_path_factory):
    ranks = _train_bpe(" ".join(TEXTS[:4]) * 3 + " the the then there 你好你好", 120)
    path = tmp_path_factory.mktemp("tk") / "tiktoken.model"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return path, ranks


def test_tiktoken_matches_reference_bpe(rank_file):
    path, ranks = rank_file
    tok = TiktokenTokenizer(path)
    assert load_tiktoken_ranks(path) == ranks
    for t in TEXTS + ["there then the 你好你好你 1234"]:
        ids = tok.encode(t)
        assert ids == _ref_encode(ranks, t)
        assert tok.decode(ids) == t
        assert b"".join(tok.token_bytes(i) for i in ids) == t.encode()
    assert len(tok.encode("the then there")) < len("the then there")  # merges were used
    n = len(ranks)
    assert tok.vocab_size == n + 256
    assert tok.special_tokens == kimi_special_table("k3", n)
    assert (tok.bos_id, tok.eos_id, tok.special("<|sep|>"), tok.pad_id) == (n, n + 2, n + 5,
                                                                            n + 255)
    ids = tok.encode(SPECIAL_TEXT)
    assert not any(tok.is_special(i) for i in ids) and tok.decode(ids) == SPECIAL_TEXT
    assert tok.encode_markup("x<|open|>y") == tok.encode("x") + [n + 3] + tok.encode("y")


def test_tiktoken_file_errors(tmp_path):
    bad = tmp_path / "bad.model"
    bad.write_text("not-base64!! 0\n")
    with pytest.raises(ValueError, match="bad entry"):
        load_tiktoken_ranks(bad)
    gap = tmp_path / "gap.model"
    gap.write_text(f"{base64.b64encode(b'a').decode()} 0\n{base64.b64encode(b'b').decode()} 2\n")
    with pytest.raises(ValueError, match="without gaps"):
        load_tiktoken_ranks(gap)


# ---- Hugging Face tokenizer.json ----

@pytest.fixture(scope="module")
def hf_file(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    specials = ["[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(TEXTS * 5, trainer)
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tk.save(str(path))
    return path


def test_hf_tokenizer_round_trip_and_special_safety(hf_file):
    tok = HFTokenizer(hf_file)
    assert set(tok.special_tokens) == {"[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>",
                                       "<|close|>", "<|sep|>"}
    for t in TEXTS:
        ids = tok.encode(t)
        assert tok.decode(ids) == t
        assert b"".join(tok.token_bytes(i) for i in ids) == t.encode()
    ids = tok.encode(SPECIAL_TEXT)
    assert not any(tok.is_special(i) for i in ids) and tok.decode(ids) == SPECIAL_TEXT
    assert tok.special("<|open|>") in tok.encode_markup("a<|open|>b")
    assert tok.eos_id == tok.special("<|end_of_msg|>")


def test_hf_added_tokens_not_marked_special_stay_text(hf_file, tmp_path):
    """An added token marked ``"special": false`` (DeepSeek's ``<think>``) is a special of ours:
    user text holding it is encoded as text (``tokenizers`` matched it there, so a user could
    open a reasoning span), and markup gets its id."""
    from tokenizers import AddedToken, Tokenizer

    tk = Tokenizer.from_file(str(hf_file))
    tk.add_tokens([AddedToken("<think>", special=False)])
    path = tmp_path / "tokenizer.json"
    tk.save(str(path))
    assert tk.encode("a <think> b").ids.count(tk.token_to_id("<think>")) == 1  # (the bug)
    tok = HFTokenizer(path)
    think = tok.special("<think>")
    ids = tok.encode("a <think> b")
    assert think not in ids and not any(map(tok.is_special, ids))
    assert tok.decode(ids) == "a <think> b"
    assert think in tok.encode_markup("a<think>b")
    # an added token that is no markup (GPT-NeoX's runs of spaces) stays a text token
    tk.add_tokens([AddedToken("    ", special=False)])
    tk.save(str(path))
    spaces = tk.token_to_id("    ")
    tok = HFTokenizer(path)
    assert tok.encode("    x")[0] == spaces and not tok.is_special(spaces)
    assert tok.decode(tok.encode("    x")) == "    x"


def test_hf_sentencepiece_pieces_keep_their_spaces_and_bytes(tmp_path):
    """A SentencePiece-style vocabulary (``▁`` for a space, ``<0xNN>`` byte pieces): each
    token's bytes come from its piece (one id decoded alone lost its leading space, so the
    stream read "Helloworld", and a byte piece became U+FFFD)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for c in "\u2581Helowrd":
        vocab[c] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    path = tmp_path / "tokenizer.json"
    tk.save(str(path))
    tok = HFTokenizer(path)
    ids = tok.encode("Hello world \u20ac")  # the euro sign is not in the vocabulary: 3 bytes
    assert [tok.token_bytes(i) for i in ids[-3:]] == [b"\xe2", b"\x82", b"\xac"]
    assert b"".join(map(tok.token_bytes, ids)) == " Hello world \u20ac".encode()  # (Metaspace's
    # own first space)


def test_load_tokenizer_dispatch(rank_file, hf_file):
    path, ranks = rank_file
    assert isinstance(load_tokenizer(None, vocab_size=384), ByteTokenizer)
    assert isinstance(load_tokenizer(path.parent, vocab_size=10**6), TiktokenTokenizer)
    assert isinstance(load_tokenizer(hf_file, vocab_size=10**6), HFTokenizer)
    with pytest.raises(ValueError, match="model vocabulary"):
        load_tokenizer(path, vocab_size=300)
    with pytest.raises(ValueError, match="no such file"):
        load_tokenizer(path.parent / "missing.model", vocab_size=10**6)
    # files that do not parse: one ValueError naming the file (tracebacks before: tokenizers'
    # bare Exception("Model missing"), an AttributeError, "max() iterable argument is empty")
    bad = hf_file.parent / "bad"
    bad.mkdir()
    for name, text in (("tokenizer.json", "{}"), ("tokenizer.json", "[]"),
                       ("tokenizer.json", '{"added_tokens": [1]}'), ("tokenizer.json", "{"),
                       ("tiktoken.model", "")):
        for old in bad.iterdir():
            old.unlink()
        (bad / name).write_text(text)
        with pytest.raises(ValueError, match=f"^tokenizer {bad / name}: "):
            load_tokenizer(bad, vocab_size=10**6)
