"""What a token is as text, for log-probabilities: its own bytes, its name in OpenAI's shapes, and where it starts in
the decoded text.

A byte-level BPE token (GPT-2, Qwen, DeepSeek, gpt-oss, the embedded model) is a run of bytes, often only part of a
UTF-8 character: decoded alone it is "\\ufffd", so its bytes are read from its vocabulary entry instead (the entry
spells each byte as one character, GPT-2's table below, which is what the `tokenizers` ByteLevel decoder inverts).
Text is decoded as the `tokenizers` library decodes it: with special tokens (prompts, candidates) or without the added
tokens marked special (generated text by default, as vLLM and SGLang return it: skip_special_tokens=True).
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable

from tokenizers import Tokenizer


def byte_level_table() -> dict[str, int]:
    """GPT-2's character for each byte (as the `tokenizers` ByteLevel pre-tokenizer writes and its decoder reads
    them): printable Latin-1 bytes stand for themselves, the other 68 for U+0100 onwards, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    others = sorted(set(range(256)) - set(printable))
    table.update({chr(0x100 + i): b for i, b in enumerate(others)})
    return table


_BYTE_LEVEL = byte_level_table()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece-style byte tokens (Llama, Mixtral)
_METASPACE = "\u2581"  # "▁": SentencePiece's space


def _decoder_kinds(tokenizer: Tokenizer) -> set[str]:
    """The types of the tokenizer's decoder and of the decoders in its Sequence (tokenizer.json's `decoder`)."""
    decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
    parts = decoder.get("decoders") or [decoder]
    kinds = {d["type"] for d in parts if isinstance(d, dict) and isinstance(d.get("type"), str)}
    return kinds | {"Metaspace"} if _METASPACE in str(decoder) else kinds  # a Replace("▁", " ") counts too


def escaped(data: bytes) -> str:
    """Bytes written as OpenAI writes them: "\\xe2\\x80" (a backslash, x and two lower-case hex digits each)."""
    return "".join(f"\\x{b:02x}" for b in data)


class TokenText:
    """Token texts of a `tokenizers.Tokenizer` (cached per id); a tokenizer-less model's tokens are `token_id:N`."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._kinds = set() if tokenizer is None else _decoder_kinds(tokenizer)
        self._bytes: dict[int, bytes | None] = {}
        # the added tokens marked special: true, those decode(skip_special_tokens=True) drops (an added token not
        # so marked, such as <think>, stays)
        self.special: frozenset[int] = frozenset() if tokenizer is None else frozenset(
            i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str | None:
        """The text of `ids`, special tokens included (transformers' default) unless skip_special; None without a
        tokenizer."""
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def bytes_of(self, token: int) -> bytes | None:
        """The token's own bytes; None for an id the tokenizer does not know (a model's padded vocabulary)."""
        if token not in self._bytes:
            self._bytes[token] = self._read_bytes(token)
        return self._bytes[token]

    def _read_bytes(self, token: int) -> bytes | None:
        entry = None if self.tokenizer is None else self.tokenizer.id_to_token(token)
        if entry is None:
            return None
        if "ByteLevel" in self._kinds:
            # As the ByteLevel decoder: an entry with a character outside the table (an added token such as
            # "<｜begin▁of▁sentence｜>") is taken as its UTF-8 text.
            if all(c in _BYTE_LEVEL for c in entry):
                return bytes(_BYTE_LEVEL[c] for c in entry)
            return entry.encode("utf-8")
        m = _BYTE_FALLBACK.fullmatch(entry)
        if m and "ByteFallback" in self._kinds:
            return bytes([int(m.group(1), 16)])
        if "Metaspace" in self._kinds:
            return entry.replace(_METASPACE, " ").encode("utf-8")
        text = self.decode([token])
        assert text is not None  # the tokenizer knew the token
        return text.encode("utf-8")

    def text(self, token: int) -> str | None:
        """The token's text when its bytes are whole UTF-8 characters, else None."""
        data = self.bytes_of(token)
        try:
            return None if data is None else data.decode("utf-8")
        except UnicodeDecodeError:
            return None

    def completion_name(self, token: int) -> str:
        """The token in legacy completions' `tokens` and `top_logprobs` keys: its text, or `bytes:\\xNN...` when it
        is part of a character (OpenAI's naming), or `token_id:N` when it has no bytes (vLLM's)."""
        text = self.text(token)
        if text is not None:
            return text
        data = self.bytes_of(token)
        return f"token_id:{token}" if data is None else "bytes:" + escaped(data)

    def chat_item(self, token: int, logprob: float) -> dict:
        """A chat logprobs entry without its top list: token (OpenAI chat writes part of a character as "\\xNN..."),
        logprob and the token's real bytes (null when it has none)."""
        data, text = self.bytes_of(token), self.text(token)
        name = text if text is not None else f"token_id:{token}" if data is None else escaped(data)
        return {"token": name, "logprob": logprob, "bytes": None if data is None else list(data)}

    def offsets(self, ids: Iterable[int], skip_special: bool = False) -> list[int]:
        """Where each token starts in decode(ids, skip_special), as a str index (characters, as OpenAI's
        text_offset): a token whose first byte continues a character started by an earlier token starts where that
        character does; a skipped special token where the next character does."""
        data, starts = bytearray(), []
        for t in ids:
            starts.append(len(data))
            if not (skip_special and t in self.special):
                data += self.bytes_of(t) or b""
        offsets, at, chars = [], 0, 0
        for p in starts:
            q = p
            while 0 < q < len(data) and data[q] & 0xC0 == 0x80:  # a continuation byte: back to its character's lead
                q -= 1
            # Cut before a lead (or ASCII) byte, the pieces decode as the whole does: every character (and every
            # replaced invalid run) starts at such a byte.
            chars += len(data[at:q].decode("utf-8", "replace"))
            offsets.append(chars)
            at = q
        return offsets
