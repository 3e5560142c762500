"""Log-probabilities of tokens that are not whole characters, on the embedded model's
byte-level BPE: legacy completions name such a token `bytes:\\xNN...` (OpenAI's naming) so that no top entry is
lost, chat logprobs give the token's real bytes, text_offset indexes the returned text in characters; echoed prompts
keep special tokens as transformers' `decode` does by default, generated text skips them as vLLM does."""
import json
import os

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

import moejax
from moejax.presets import embedded_dir
from moejax.requests.bodies import Bodies, Choice
from moejax.requests.parse import CompletionRequest
from moejax.requests.token_text import TokenText, byte_level_table
from moejax.sampling import SamplingParams
from moejax.sched.batch import serve_lines

EMBEDDED = embedded_dir("pycode-moe")
ACCENTS = "Café à la crème 😀 ok"  # accents and an emoji: several tokens are parts of one character
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}" \
           "{% if add_generation_prompt %}assistant:{% endif %}"
REPLACEMENT = list("\ufffd".encode())  # [239, 191, 189]: what a part of a character decodes to on its own


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(os.path.join(EMBEDDED, "tokenizer.json"))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The embedded model with a chat template of its own (it ships none): its weights linked, not copied."""
    d = tmp_path_factory.mktemp("pycode-chat")
    for name in os.listdir(EMBEDDED):
        if name != "tokenizer_config.json":
            os.symlink(os.path.join(EMBEDDED, name), d / name)
    config = json.load(open(os.path.join(EMBEDDED, "tokenizer_config.json")))
    (d / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return moejax.load(str(d), dtype="float32")


@pytest.fixture(scope="module")
def served(engine, tmp_path_factory):
    """One run: an echoed non-ASCII prompt with its top 5, a token-id prompt holding the end-of-text token, and a
    chat completion with its top 20."""
    eot = engine.tokenizer.token_to_id("<|endoftext|>")
    with_eot = engine.tokenizer.encode("x = 1").ids + [eot] + engine.tokenizer.encode("é = 2").ids
    requests = [("/v1/completions", {"prompt": ACCENTS, "max_tokens": 3, "echo": True, "logprobs": 5}),
                ("/v1/completions", {"prompt": with_eot, "max_tokens": 2, "echo": True, "logprobs": 1}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Ça va? 😀"}],
                                          "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 20})]
    out = tmp_path_factory.mktemp("served") / "out.jsonl"
    lines = [json.dumps({"custom_id": f"r{i}", "url": url, "body": body}) for i, (url, body) in enumerate(requests)]
    serve_lines(engine, lines, str(out))
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert all(r["response"]["status_code"] == 200 for r in rows), rows
    return [r["response"]["body"] for r in rows], with_eot


def name_bytes(name: str) -> bytes:
    """The bytes a legacy completions token name stands for (`bytes:\\xNN...` or text)."""
    if name.startswith("bytes:"):
        hexes = name[len("bytes:"):].split("\\x")[1:]
        assert name == "bytes:" + "".join(f"\\x{h}" for h in hexes) and all(len(h) == 2 for h in hexes), name
        return bytes(int(h, 16) for h in hexes)
    return name.encode("utf-8")


def log_softmax(engine, ids) -> np.ndarray:
    logits = engine.logits(np.array([ids]))[0].astype(np.float64)
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


# -- every top entry survives ---------------------------------------------------------------------------------
def test_top_logprobs_keep_every_entry_of_tokens_inside_a_character(engine, served, tokenizer):
    (body, _, _), _ = served
    choice = body["choices"][0]
    ids = engine.tokenizer.encode(ACCENTS).ids + choice["token_ids"]
    ref = log_softmax(engine, ids)
    lp = choice["logprobs"]
    names = TokenText(tokenizer).completion_name
    crowded = 0  # positions whose top 5 hold two or more parts of characters (they all decode to U+FFFD)
    for pos in range(1, len(ids)):
        row, top = ref[pos - 1], lp["top_logprobs"][pos]
        best = [int(t) for t in np.argsort(-row)[:5]]
        assert set(top) == {names(t) for t in best} | {names(ids[pos])}, pos
        for t in best:
            assert top[names(t)] == pytest.approx(row[t], abs=1e-4)
        assert lp["token_logprobs"][pos] == pytest.approx(row[ids[pos]], abs=1e-4)
        crowded += sum(k.startswith("bytes:") for k in top) >= 2
    assert crowded  # the case where entries were lost when two shared a key


def test_tokens_name_parts_of_characters_by_their_bytes(served):
    (body, _, _), _ = served
    choice = body["choices"][0]
    tokens = choice["logprobs"]["tokens"]
    assert any(t.startswith("bytes:") for t in tokens)
    assert all(t.startswith("bytes:") or "\ufffd" not in t for t in tokens)
    # The names rebuild the text: each is the token's text, or the bytes of a token that is part of a character.
    assert b"".join(map(name_bytes, tokens)) == choice["text"].encode("utf-8")
    for t in tokens:
        if t.startswith("bytes:"):
            with pytest.raises(UnicodeDecodeError):
                name_bytes(t).decode("utf-8")


# -- chat bytes are the token's own ----------------------------------------------------------------------------
def test_chat_logprobs_bytes_rebuild_the_content(served, tokenizer):
    """A served chat completion's bytes give its content back. (This model ranks no part of a character in a chat
    answer's top 20, so the case of a token that is the byte 0xFE is the test below.)"""
    (_, _, chat), _ = served
    choice = chat["choices"][0]
    content = choice["logprobs"]["content"]
    ended = choice["finish_reason"] == "stop"
    spoken = content[:-1] if ended else content
    assert b"".join(bytes(c["bytes"]) for c in spoken) == choice["message"]["content"].encode("utf-8")
    # No token of this vocabulary is U+FFFD itself, so its bytes may not appear: parts of characters have their own.
    assert not any("ï¿½" in entry for entry in tokenizer.get_vocab())
    entries = [e for c in content for e in [c, *c["top_logprobs"]]]
    assert len(content[0]["top_logprobs"]) == 20
    assert all(e["bytes"] != REPLACEMENT for e in entries)
    for e in entries:  # OpenAI's chat names a part of a character by its escaped bytes
        data = bytes(e["bytes"])
        assert e["token"] == (data.decode() if _is_utf8(data) else "".join(f"\\x{b:02x}" for b in data))


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def sentencepiece_tokenizer():
    """A Llama-style tokenizer (byte fallback, ▁ for spaces), built here: no test checkpoint ships one."""
    vocab = {"<unk>": 0, "<0xFE>": 1, "<0xC3>": 2, "▁the": 3, "t": 4, "h": 5, "e": 6, "▁": 7}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok, 1, 3


@pytest.mark.parametrize("kind", ["byte-level", "byte-fallback"])
def test_chat_bytes_of_the_raw_byte_0xfe(tokenizer, kind):
    """The issue's case: a token that is the byte 0xFE alone has bytes [254], not U+FFFD's."""
    if kind == "byte-level":
        tok, fe, word = tokenizer, tokenizer.token_to_id("þ"), tokenizer.token_to_id("Ġthe")  # GPT-2: 0xFE is "þ"
    else:
        tok, fe, word = sentencepiece_tokenizer()
    req = CompletionRequest(1, "c", (5, 6), 2, SamplingParams(seed=0), (), (), logprobs=2, chat=True)
    body = Bodies(tok, "m", "fp").completion(req, "1", [(Choice([fe, word], "length", [-0.5, -1.0],
                                                                [[(fe, -0.5), (word, -2.0)], [(word, -1.0)]]), "x")],
                                             0, None)
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["bytes"] for c in content] == [[254], list(b" the")]
    assert content[0]["token"] == "\\xfe" and content[0]["top_logprobs"][0]["bytes"] == [254]


# -- text_offset indexes the text; special tokens are kept ----------------------------------------------------
def assert_offsets_index_the_text(text: str, tokens: list[str], offsets: list[int]):
    assert offsets == sorted(offsets) and all(0 <= at <= len(text) for at in offsets)
    for name, at in zip(tokens, offsets, strict=True):
        data = name_bytes(name)
        if name.startswith("bytes:"):  # part of a character: the character at the offset holds those bytes
            rest = text[at:].encode("utf-8")
            assert any(rest.startswith(data, k) for k in range(len(text[at].encode("utf-8")))), (name, at)
        else:
            assert text[at:].startswith(name), (name, at, text[at:])


def in_text(choice) -> int:
    """How many of a choice's logprobs tokens are in its text: all but a stop token that ended it."""
    return len(choice["logprobs"]["tokens"]) - (choice["finish_reason"] == "stop")


def test_text_offset_counts_characters_of_the_text(served):
    (body, _, _), _ = served
    choice = body["choices"][0]
    lp, n = choice["logprobs"], in_text(choice)
    assert choice["text"].startswith(ACCENTS)
    assert_offsets_index_the_text(choice["text"], lp["tokens"][:n], lp["text_offset"][:n])


def test_echo_keeps_special_tokens_and_generated_text_skips_them(served, tokenizer):
    """An echoed prompt (here given as token ids) keeps its special tokens, as lm-eval reads prompts back
    (transformers' decode, skip_special_tokens=False); the generated text is decoded as vLLM returns it
    (skip_special_tokens=True); the tokens, their offsets and the text agree."""
    (_, body, _), with_eot = served
    choice = body["choices"][0]
    generated = choice["token_ids"][:len(choice["token_ids"]) - (choice["finish_reason"] == "stop")]
    assert choice["text"] == tokenizer.decode(with_eot, skip_special_tokens=False) + tokenizer.decode(
        generated, skip_special_tokens=True)
    assert "<|endoftext|>" in choice["text"] and "<|endoftext|>" in choice["logprobs"]["tokens"]
    lp, n = choice["logprobs"], in_text(choice)
    assert_offsets_index_the_text(choice["text"], lp["tokens"][:n], lp["text_offset"][:n])
    try:  # transformers is reference data only, not a test dependency: where it is installed, its decode too
        import transformers
    except ImportError:
        return
    auto = transformers.AutoTokenizer.from_pretrained(EMBEDDED)
    assert choice["text"] == auto.decode(with_eot) + auto.decode(generated, skip_special_tokens=True)


# -- generated special tokens: skipped as vLLM skips them -------------------------------------------------------
CODE = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n"


def serve_bodies(engine, bodies: list[tuple[str, dict]], out) -> list[dict]:
    lines = [json.dumps({"custom_id": f"r{i}", "url": url, "body": body}) for i, (url, body) in enumerate(bodies)]
    serve_lines(engine, lines, str(out))
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert all(r["response"]["status_code"] == 200 for r in rows), rows
    return [r["response"]["body"] for r in rows]


@pytest.fixture(scope="module")
def marked(engine, tmp_path_factory):
    """The greedy tokens of a code prompt, and the model's tokenizer with two of them made added tokens: one marked
    special (as <|im_start|>), one not (as <think>)."""
    from tokenizers import AddedToken
    prompt = engine.tokenizer.encode(CODE).ids
    (body,) = serve_bodies(engine, [("/v1/completions", {"prompt": prompt, "max_tokens": 12, "logprobs": 1})],
                           tmp_path_factory.mktemp("plain") / "out.jsonl")
    tokens = body["choices"][0]["token_ids"]
    eos = set(engine.config.eos_token_ids)
    ordinary = [t for t in dict.fromkeys(tokens) if t not in eos]
    assert len(ordinary) >= 3, tokens
    special, plain = ordinary[1], ordinary[2]
    tok = Tokenizer.from_str(engine.tokenizer.to_str())
    tok.add_special_tokens([AddedToken(tok.id_to_token(special), special=True)])
    tok.add_tokens([AddedToken(tok.id_to_token(plain), special=False)])
    added = tok.get_added_tokens_decoder()
    assert added[special].special and not added[plain].special
    return prompt, body, tok, special, plain


def test_generated_text_skips_the_added_tokens_marked_special(engine, marked, monkeypatch, tmp_path):
    prompt, plain_body, tok, special, plain = marked
    monkeypatch.setattr(engine, "tokenizer", tok)  # the served text is decoded with it
    request = {"prompt": prompt, "max_tokens": 12, "logprobs": 1}
    skipped, kept = serve_bodies(engine, [("/v1/completions", request),
                                          ("/v1/completions", {**request, "skip_special_tokens": False,
                                                               "spaces_between_special_tokens": False})],
                                  tmp_path / "o")
    for body, skip in ((skipped, True), (kept, False)):
        choice = body["choices"][0]
        ids = choice["token_ids"]
        assert special in ids and plain in ids, ids
        assert choice["text"] == tok.decode(ids[:len(ids) - (choice["finish_reason"] == "stop")],
                                            skip_special_tokens=skip)
        # the log-probabilities name every token as before, the skipped one too
        before = plain_body["choices"][0]["logprobs"]
        assert choice["logprobs"]["tokens"] == before["tokens"]
        keys = lambda lp: [list(top) for top in lp["top_logprobs"]]  # noqa: E731
        assert keys(choice["logprobs"]) == keys(before)
        assert (choice["logprobs"]["text_offset"] == before["text_offset"]) is not skip
    text, lp = skipped["choices"][0]["text"], skipped["choices"][0]["logprobs"]
    assert text != kept["choices"][0]["text"] and kept["choices"][0]["text"] == plain_body["choices"][0]["text"]
    ids = skipped["choices"][0]["token_ids"]
    n = in_text(skipped["choices"][0])
    shown = [k for k in range(n) if ids[k] != special]
    assert_offsets_index_the_text(text, [lp["tokens"][k] for k in shown], [lp["text_offset"][k] for k in shown])
    for k in range(n):  # a skipped token is where the next character is
        if ids[k] == special:
            assert lp["text_offset"][k] == (lp["text_offset"][k + 1] if k + 1 < len(ids) else len(text))


def test_the_stop_that_ended_generation_is_in_the_text_only_when_asked(engine, marked, tmp_path):
    prompt, plain_body, _, _, _ = marked  # served with the model's own tokenizer (nothing special generated)
    tokens = plain_body["choices"][0]["token_ids"]
    decode = lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    piece = lambda k: decode(tokens[: k + 1])[len(decode(tokens[:k])):]  # noqa: E731  (token k's text)
    # a token that first appears at k, whose text is not in the text before it: a stop token and a stop string
    stop_at = next(k for k in range(1, len(tokens)) if tokens[k] not in tokens[:k] and piece(k).strip()
                   and piece(k) not in decode(tokens[:k]))
    stop_id, stop_text = tokens[stop_at], piece(stop_at)
    base = {"prompt": prompt, "max_tokens": 12}
    bodies = serve_bodies(engine, [("/v1/completions", {**base, "stop_token_ids": [stop_id]}),
                                   ("/v1/completions", {**base, "stop_token_ids": [stop_id],
                                                        "include_stop_str_in_output": True}),
                                   ("/v1/completions", {**base, "stop": [stop_text]}),
                                   ("/v1/completions", {**base, "stop": [stop_text],
                                                        "include_stop_str_in_output": True})], tmp_path / "o")
    before = decode(tokens[:stop_at])
    texts = [b["choices"][0]["text"] for b in bodies]
    assert texts == [before, before + stop_text, before, before + stop_text]
    assert all(b["choices"][0]["finish_reason"] == "stop" for b in bodies)
    assert all(b["choices"][0]["token_ids"] == tokens[: stop_at + 1] for b in bodies)


# -- the token texts against the tokenizers library --------------------------------------------------------------
def test_byte_table_is_the_byte_level_pre_tokenizers(tokenizer):
    """GPT-2's table as the library writes bytes: every byte that occurs in UTF-8 text, through its pre-tokenizer."""
    table = byte_level_table()
    assert set(table) == set(pre_tokenizers.ByteLevel.alphabet()) and sorted(table.values()) == list(range(256))
    split = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    text = "".join(chr(c) for c in [*range(1, 0x800), 0xFFFD, 0x1F600, 0x10FFFF])
    (written, _), = split.pre_tokenize_str(text)
    assert bytes(table[c] for c in written) == text.encode("utf-8")


def test_token_bytes_decode_as_the_tokenizer_does(tokenizer):
    """Any token sequence: the tokens' bytes decode (invalid runs replaced) to the tokenizer's own text, and each
    offset indexes that text."""
    tt = TokenText(tokenizer)
    rng = np.random.default_rng(0)
    for _ in range(300):
        ids = [int(t) for t in rng.integers(0, tokenizer.get_vocab_size(), rng.integers(1, 9))]
        text = tt.decode(ids)
        assert b"".join(tt.bytes_of(t) for t in ids).decode("utf-8", "replace") == text
        assert text == tokenizer.decode(ids, skip_special_tokens=False)
        offsets = tt.offsets(ids)
        assert offsets == sorted(offsets) and all(0 <= at <= len(text) for at in offsets)
