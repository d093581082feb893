"""Tokenizers: built-in byte-level, tiktoken rank files (Kimi), Hugging Face ``tokenizer.json``.

All three share one small interface (:class:`Tokenizer`): ``encode`` turns *text* into ids and
never produces a special token, whatever the text contains (``"<|open|>"`` typed by a user is
eight ordinary tokens); markup is built with :meth:`Tokenizer.special` (one id per special name)
or :meth:`Tokenizer.encode_markup`, which splits on special names first and encodes the pieces
between them separately (BPE is not associative, ``kimi_k3.md`` 6).

Special-token tables (``kimi_k3.md`` 6): Kimi reserves 256 ids after the base vocabulary
(163,584 base tokens, specials 163584..163839). Names are given as offsets from the first
special id; K3 re-used K2's ``<|im_end|> <|im_user|> <|im_assistant|>`` slots (offsets 2-4) for
``<|end_of_msg|> <|open|> <|close|>`` and added ``<|sep|>`` at 5, so a tokenizer carries one
flavour's names (``"k3"`` or ``"k2"``). Unnamed offsets are ``<|reserved_token_{id}|>``.

* :class:`ByteTokenizer`: ids 0-255 are bytes, the flavour's specials follow at 256 + offset,
  ``[UNK]`` / ``[PAD]`` take the last two ids, all within the model vocabulary (``tiny``: bos
  256, eos 258 = ``<|end_of_msg|>``, pad 383).
* :class:`TiktokenTokenizer`: ``tiktoken.model`` lines ``base64(token) rank``, Kimi's
  pre-tokenization regex :data:`KIMI_PAT_STR` (Han runs split off first, then cl100k-style
  words, numbers of at most 3 digits, punctuation, whitespace), encoded by the ``tiktoken``
  package (Rust BPE; the pattern's ``&&`` class intersections need its fancy-regex engine).
* :class:`HFTokenizer`: any ``tokenizer.json`` through the ``tokenizers`` package, with
  ``encode_special_tokens`` on so added tokens in text are not matched.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
NUM_RESERVED_SPECIALS = 256

# offsets from the first special id (kimi_k3.md 6)
_COMMON = {"[BOS]": 0, "[EOS]": 1, "<|media_begin|>": 18, "<|media_content|>": 19,
           "<|media_end|>": 20, "<|media_pad|>": 21, "[UNK]": 254, "[PAD]": 255}
SPECIAL_OFFSETS = {
    "k3": {**_COMMON, "<|end_of_msg|>": 2, "<|open|>": 3, "<|close|>": 4, "<|sep|>": 5},
    "k2": {**_COMMON, "<|im_end|>": 2, "<|im_user|>": 3, "<|im_assistant|>": 4,
           "<|im_system|>": 10, "<|tool_calls_section_begin|>": 11,
           "<|tool_calls_section_end|>": 12, "<|tool_call_begin|>": 13,
           "<|tool_call_argument_begin|>": 14, "<|tool_call_end|>": 15, "<|im_middle|>": 17,
           "<think>": 22, "</think>": 23},
}
_TAIL = ("[UNK]", "[PAD]")  # the byte tokenizer puts these on the last two ids


def kimi_special_table(flavor: str, first_id: int,
                       count: int = NUM_RESERVED_SPECIALS) -> dict[str, int]:
    """Name -> id for ``count`` specials starting at ``first_id`` (unnamed: reserved names)."""
    offsets = _offsets(flavor)
    by_offset = {o: n for n, o in offsets.items()}
    return {by_offset.get(o, f"<|reserved_token_{first_id + o}|>"): first_id + o
            for o in range(count)}


def _offsets(flavor: str) -> dict[str, int]:
    try:
        return SPECIAL_OFFSETS[flavor]
    except KeyError:
        raise ValueError(f"unknown special-token flavour {flavor!r}; choose from "
                         f"{sorted(SPECIAL_OFFSETS)}") from None


class Tokenizer:
    """The interface shared by every tokenizer. Subclasses set ``special_tokens`` (name -> id)
    and ``vocab_size`` and implement ``_encode_text`` and ``token_bytes``."""

    special_tokens: dict[str, int]
    vocab_size: int

    def _init_specials(self) -> None:
        self._special_ids = {i: n for n, i in self.special_tokens.items()}
        names = sorted(self.special_tokens, key=len, reverse=True)
        self._special_re = re.compile("(" + "|".join(map(re.escape, names)) + ")") if names \
            else None

    # ---- encoding ----
    def encode(self, text: str) -> list[int]:
        """Ordinary text -> ids. Special-token text is encoded as ordinary text, never as a
        special token (user content can not inject markup)."""
        if not isinstance(text, str):
            raise ValueError(f"encode expects str, got {type(text).__name__}")
        return self._encode_text(text) if text else []

    def encode_markup(self, text: str) -> list[int]:
        """Trusted template text: special names become their ids; the text between them is
        encoded piece by piece."""
        if self._special_re is None:
            return self.encode(text)
        out: list[int] = []
        for piece in self._special_re.split(text):
            if piece in self.special_tokens:
                out.append(self.special_tokens[piece])
            elif piece:
                out.extend(self._encode_text(piece))
        return out

    def special(self, name: str) -> int:
        try:
            return self.special_tokens[name]
        except KeyError:
            raise ValueError(f"tokenizer has no special token {name!r}") from None

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def special_name(self, token_id: int) -> str | None:
        return self._special_ids.get(token_id)

    # ---- decoding ----
    def token_bytes(self, token_id: int) -> bytes:
        raise NotImplementedError

    def decode(self, ids, *, skip_special: bool = False) -> str:
        """Ids -> text (invalid UTF-8 becomes U+FFFD; specials as their names unless skipped)."""
        buf = bytearray()
        for i in ids:
            i = int(i)
            if skip_special and i in self._special_ids:
                continue
            buf += self.token_bytes(i)
        return buf.decode("utf-8", errors="replace")

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} outside the vocabulary [0, {self.vocab_size})")

    # ---- convenience ----
    @property
    def bos_id(self) -> int:
        return self.special("[BOS]")

    @property
    def pad_id(self) -> int:
        return self.special("[PAD]")

    @property
    def eos_id(self) -> int:
        for name in ("<|end_of_msg|>", "<|im_end|>", "[EOS]"):
            if name in self.special_tokens:
                return self.special_tokens[name]
        raise ValueError("tokenizer has no end-of-message token")


class ByteTokenizer(Tokenizer):
    """Bytes 0-255, then the flavour's specials at 256 + offset, [UNK]/[PAD] on the last ids;
    every other id above 255 is a reserved special."""

    def __init__(self, vocab_size: int, flavor: str = "k3"):
        offsets = _offsets(flavor)
        need = 256 + max(o for n, o in offsets.items() if n not in _TAIL) + 1 + len(_TAIL)
        if vocab_size < need:
            raise ValueError(f"byte tokenizer ({flavor}) needs vocab_size >= {need}, got "
                             f"{vocab_size}")
        self.vocab_size, self.flavor = vocab_size, flavor
        table = {n: 256 + o for n, o in offsets.items() if n not in _TAIL}
        table.update({"[UNK]": vocab_size - 2, "[PAD]": vocab_size - 1})
        named = set(table.values())
        table.update({f"<|reserved_token_{i}|>": i for i in range(256, vocab_size)
                      if i not in named})
        self.special_tokens = table
        self._init_specials()

    def _encode_text(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def token_bytes(self, token_id: int) -> bytes:
        self._check_id(token_id)
        return bytes([token_id]) if token_id < 256 else self._special_ids[token_id].encode()


def load_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """``tiktoken.model``: one ``base64(token) rank`` per line -> {token bytes: rank}."""
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{path}:{n}: expected 'base64 rank', got {line[:60]!r}")
        try:
            ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
        except ValueError as e:
            raise ValueError(f"{path}:{n}: bad entry {line[:60]!r} ({e})") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks are not 0..{len(ranks) - 1} without gaps")
    return ranks


class TiktokenTokenizer(Tokenizer):
    """Kimi's ``tiktoken.model`` + :data:`KIMI_PAT_STR` + 256 specials after the base tokens."""

    _MAX_CHARS = 400_000  # tiktoken's per-call limit (Kimi's wrapper splits likewise)

    def __init__(self, path: str | Path, flavor: str = "k3", *,
                 num_specials: int = NUM_RESERVED_SPECIALS):
        import tiktoken

        ranks = load_tiktoken_ranks(path)
        self.flavor = flavor
        self.special_tokens = kimi_special_table(flavor, len(ranks), num_specials)
        self.vocab_size = len(ranks) + num_specials
        self._enc = tiktoken.Encoding(name=f"kimi-{flavor}", pat_str=KIMI_PAT_STR,
                                      mergeable_ranks=ranks, special_tokens=self.special_tokens)
        self._init_specials()

    def _encode_text(self, text: str) -> list[int]:
        out: list[int] = []
        for i in range(0, len(text), self._MAX_CHARS):
            out.extend(self._enc.encode(text[i:i + self._MAX_CHARS], allowed_special=set(),
                                        disallowed_special=()))
        return out

    def token_bytes(self, token_id: int) -> bytes:
        self._check_id(token_id)
        return self._enc.decode_single_token_bytes(token_id)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json`` (any model type) via the ``tokenizers`` package.

    Specials are the added tokens marked ``special`` and those that look like markup
    (``<...>`` without spaces): DeepSeek's ``<think>`` is added with ``"special": false``, which
    ``tokenizers`` would still match in user text (a user could open a reasoning span). They
    are loaded marked special, so text is encoded with none of them (``encode_special_tokens``).
    Other added tokens (a run of spaces in GPT-NeoX's vocabulary) stay text tokens, matched in
    text as the model was trained. ``token_bytes`` maps a byte-level vocabulary entry back
    through GPT-2's byte table, and a SentencePiece one (``▁`` for a space, ``<0xNN>`` byte
    pieces) by its piece, so a text segment starts with the space its first piece carries
    (Hugging Face's decoder strips it); other decoders decode the single id.
    """

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as _Tok

        path = Path(path)
        spec = json.loads(path.read_text())
        for added in spec.get("added_tokens") or ():
            if re.fullmatch(r"<[^\s<>]+>", added.get("content", "")):
                added["special"] = True
        self._tok = _Tok.from_str(json.dumps(spec))
        self._tok.encode_special_tokens = True  # added tokens in text stay text
        self.special_tokens = {t.content: i for i, t in
                               self._tok.get_added_tokens_decoder().items() if t.special}
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        decoder = spec.get("decoder") or {}
        self._byte_level = decoder.get("type") == "ByteLevel"
        self._sentencepiece = not self._byte_level and "\u2581" in json.dumps(
            decoder, ensure_ascii=False)  # a Metaspace or Replace("\u2581", " ") decoder
        self._unbyte = {c: b for b, c in _bytes_to_unicode().items()}
        self._init_specials()

    def _encode_text(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def token_bytes(self, token_id: int) -> bytes:
        self._check_id(token_id)
        if token_id in self._special_ids:
            return self._special_ids[token_id].encode()
        piece = self._tok.id_to_token(token_id)
        if self._byte_level and piece is not None and all(c in self._unbyte for c in piece):
            return bytes(self._unbyte[c] for c in piece)
        if self._sentencepiece and piece is not None:  # decoded alone, an id loses its
            # leading space and a byte piece becomes U+FFFD: read the piece itself
            byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
            return bytes([int(byte[1], 16)]) if byte else piece.replace("\u2581", " ").encode()
        return self._tok.decode([token_id], skip_special_tokens=False).encode()


def load_tokenizer(path: str | Path | None, *, vocab_size: int,
                   flavor: str = "k3") -> Tokenizer:
    """``None`` -> :class:`ByteTokenizer`; a ``tiktoken.model`` file or a folder holding one ->
    :class:`TiktokenTokenizer`; a ``tokenizer.json`` (or folder) -> :class:`HFTokenizer`.
    Every id must fit the model's ``vocab_size``."""
    if path is None:
        return ByteTokenizer(vocab_size, flavor)
    p = Path(path)
    if p.is_dir():
        for name in ("tiktoken.model", "tokenizer.json"):
            if (p / name).is_file():
                p = p / name
                break
        else:
            raise ValueError(f"{path}: no tiktoken.model or tokenizer.json in this folder")
    if not p.is_file():
        raise ValueError(f"tokenizer {path}: no such file")
    try:
        tok: Tokenizer = HFTokenizer(p) if p.suffix == ".json" else TiktokenTokenizer(p, flavor)
    except ValueError as e:
        raise ValueError(f"tokenizer {p}: {e}") from None
    except OSError:  # (cannot be read: its own error says why)
        raise
    except Exception as e:  # noqa: BLE001 -- the parsers' own errors (tokenizers raises a bare
        # Exception("Model missing"), a malformed file AttributeError or TypeError)
        raise ValueError(f"tokenizer {p}: not a tokenizer file this kdsa reads "
                         f"({type(e).__name__}: {str(e)[:200]})") from None
    if tok.vocab_size > vocab_size:
        raise ValueError(f"tokenizer {p} has {tok.vocab_size} ids but the model vocabulary is "
                         f"{vocab_size}")
    return tok
