"""A byte-level BPE for the embedded model, trained with `tokenizers` and saved so that moejax
(`tokenizer.json`) and `transformers.AutoTokenizer` (`tokenizer_config.json`: a PreTrainedTokenizerFast with its
end-of-text token) both load it. Byte-level: any text, any bytes, round-trips exactly."""
from __future__ import annotations

import json
import os
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

END_OF_TEXT = "<|endoftext|>"  # separates documents in training and ends generation


def train_tokenizer(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2) -> Tokenizer:
    if vocab_size < 257 + 1:
        raise ValueError(f"vocab_size must hold the 256 bytes and {END_OF_TEXT}: at least 258, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[END_OF_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def save_tokenizer(tok: Tokenizer, directory: str, *, max_length: int) -> None:
    """tokenizer.json and tokenizer_config.json into `directory`."""
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = dict(tokenizer_class="PreTrainedTokenizerFast", eos_token=END_OF_TEXT, pad_token=END_OF_TEXT,
                  bos_token=None, unk_token=None, model_max_length=max_length, add_prefix_space=False,
                  clean_up_tokenization_spaces=False)
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
