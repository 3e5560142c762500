"""The embedded model's data: the standard-library corpus and its held-out split by file, and the
byte-level BPE trained on it, saved so that moejax reads it back."""
import json
import os

import pytest

from moejax.models.checkpoint import load_tokenizer
from moejax.train import corpus
from moejax.train.tokenizer import END_OF_TEXT, save_tokenizer, train_tokenizer


@pytest.fixture(scope="module")
def files():
    return corpus.source_files()


def test_corpus_is_the_stdlib_sources_split_by_a_fixed_rule(files):
    assert len(files) > 500 and all(f.endswith(".py") for f in files) and files == sorted(files)
    assert not any("site-packages" in f or "__pycache__" in f for f in files)
    assert "os.py" in files and "json/decoder.py".replace("/", os.sep) in files
    train, held_out = corpus.split(files)
    assert not set(train) & set(held_out) and len(train) + len(held_out) == len(files)
    assert 0.02 < len(held_out) / len(files) < 0.08  # one in 20 by CRC-32
    assert corpus.split(list(reversed(files)))[1] == list(reversed(held_out))  # the rule looks at names only
    d = corpus.describe()
    assert d["sha256"] == corpus.list_hash(files) != corpus.list_hash(files[1:])
    assert (d["train_files"], d["held_out_files"]) == (len(train), len(held_out)) and d["python"]


def test_bpe_round_trips_held_out_code_and_loads_back(files, tmp_path):
    train, held_out = corpus.split(files)
    root = corpus.stdlib_dir()
    texts = [corpus.read_source(os.path.join(root, f)) for f in train[:40]]
    tok = train_tokenizer(texts, vocab_size=600)
    assert tok.get_vocab_size() == 600 and tok.token_to_id(END_OF_TEXT) == 0
    save_tokenizer(tok, str(tmp_path), max_length=1024)
    loaded = load_tokenizer(str(tmp_path))
    samples = [corpus.read_source(os.path.join(root, f)) for f in held_out[:5]] + ["naïve café ☃\n\tx = '\\x00'"]
    for text in samples:
        ids = loaded.encode(text).ids
        assert loaded.decode(ids) == text  # byte-level: nothing is lost, whatever the text
    assert len(loaded.encode(samples[0]).ids) < len(samples[0].encode()) / 2  # merges learnt from code
    assert loaded.encode(f"x{END_OF_TEXT}y").ids[1] == 0  # the end-of-text token is one token
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["eos_token"] == END_OF_TEXT and config["tokenizer_class"] == "PreTrainedTokenizerFast"
    with pytest.raises(ValueError, match="at least 258"):
        train_tokenizer(texts, vocab_size=100)
