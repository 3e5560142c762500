"""The tokenizer as lm-eval's `hf` model uses it (transformers' fast tokenizer over the same tokenizer.json):
encode with the post-processor's special tokens unless told otherwise, decode skipping special tokens, and the
eos / bos tokens named by tokenizer_config.json (or special_tokens_map.json)."""
from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer

from moejax.chat import named_tokens


class EvalTokenizer:
    def __init__(self, tokenizer: Tokenizer, directory: str | None, config_eos: tuple[int, ...] = ()) -> None:
        """tokenizer: a `tokenizers.Tokenizer`; directory: where its tokenizer_config.json is (None: none);
        config_eos: the model's end-of-sequence ids, used when the tokenizer names no eos token."""
        self.tokenizer = tokenizer
        named = named_tokens(directory) if directory else {}
        self.eos_token = named.get("eos_token")
        self.bos_token = named.get("bos_token")
        self.eos_token_id = self._id(self.eos_token, "eos_token", directory)
        if self.eos_token_id is None and config_eos:
            self.eos_token_id = int(config_eos[0])
            self.eos_token = tokenizer.id_to_token(self.eos_token_id)
        self.bos_token_id = self._id(self.bos_token, "bos_token", directory)

    def _id(self, token: str | None, what: str, directory: str | None) -> int | None:
        if token is None:
            return None
        found = self.tokenizer.token_to_id(token)
        if found is None:
            raise ValueError(f"{directory}: tokenizer_config.json names {what} {token!r}, which tokenizer.json does "
                             "not have")
        return found

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: int | Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = [ids] if isinstance(ids, int) else list(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
