"""moejax as an lm-evaluation-harness model: `--model moejax` (registered on import; `python -m moejax.eval` is
lm-eval's CLI with it registered).

Requests are tokenized as lm-eval's `hf` model does for the same checkpoint (TemplateLM._encode_pair: the context's
trailing spaces move to the continuation, context + continuation encoded whole and split; an empty context is the
prefix token), and answered on the Engine in-process:
- loglikelihood: grouped by context and scored through prefix-shared scoring (moejax.eval.scoring): each context is
  computed once for all its continuations, shared few-shot prefixes once per tree or from the prefix KV cache;
- loglikelihood_rolling: lm-eval's rolling windows of the model's max length, packed and scored the same way;
- generate_until: the continuous-batching scheduler, greedy unless the task samples, ended at `until` (the text is
  cut at the first stop string, as `hf` cuts it), the model's end-of-sequence tokens or max_gen_toks.
Each answers in request order with a progress bar as lm-eval's own models show it."""
from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import lm_eval.models  # noqa: F401  (lm-eval's own models first: it fills an empty registry only)
from lm_eval import utils as lm_utils
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

import moejax
from moejax.engine import Engine
from moejax.eval.generation import Completion, generate
from moejax.eval.scoring import Scorer
from moejax.eval.tokens import EvalTokenizer
from moejax.loading import OPTIONS
from moejax.models.checkpoint import load_tokenizer
from moejax.presets import resolve_embedded
from moejax.sampling import SamplingParams
from moejax.sched.serving_options import ServingOptions

# What lm-eval passes every model besides --model_args; batches here are sized in tokens, not requests.
_HARNESS_ARGS = ("batch_size", "max_batch_size", "device")
# Generation keywords this model honours; others (top_k, repetition_penalty, ...) are refused by name.
_GEN_KEYS = ("until", "max_gen_toks", "do_sample", "temperature", "top_p")
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's hf model's


class ModelArgsError(TypeError, ValueError):
    """A --model_args key or value the model cannot take: unknown (a TypeError, as Python's own for an unexpected
    keyword) or out of its range (a ValueError). `python -m moejax.eval` prints it as one line, no traceback."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"moejax model_args: {detail}")
        self.detail = detail


def _int_arg(name: str, value: object, least: int | None) -> int:
    """A model_args integer (lm-eval passes a number, or the text when it is not one), at least `least`."""
    if isinstance(value, bool) or not isinstance(value, int) or (least is not None and value < least):
        raise ModelArgsError(f"{name}={value} must be an int" + ("" if least is None else f" >= {least}"))
    return value


def _serving_args(max_batch_tokens: object, prefix_cache_mb: object, kv_cache: object, kv_pool_mb: object) -> None:
    """The scoring and generation settings checked as launch.serve's flags of the same names are (ServingOptions)."""
    try:
        ServingOptions(max_batch_tokens=max_batch_tokens, prefix_cache_mb=prefix_cache_mb,  # type: ignore[arg-type]
                       kv_cache=kv_cache, kv_pool_mb=kv_pool_mb)  # type: ignore[arg-type]
    except ValueError as e:
        raise ModelArgsError(str(e)) from None


@register_model("moejax")
class MoejaxLM(TemplateLM):
    """model_args: pretrained (a checkpoint directory, an embedded model's or preset's name, or a loaded
    moejax.Engine), dtype ("auto": the checkpoint's own), tokenizer (a directory with tokenizer.json, default the
    checkpoint's), max_length (default: the model's context), max_gen_toks (default 256), max_batch_tokens (scoring
    batches' token budget; default as launch.serve), prefix_cache_mb (1024), kv_cache ("auto", "on", "off"),
    kv_pool_mb (generation's KV pool), add_bos_token and prefix_token_id (as hf's), seed (sampled generation), and
    every option of moejax.load (placement, layout, kernels, num_layers, device_memory_gb, ...)."""

    def __init__(self, pretrained: str | Engine, dtype: str = "auto", tokenizer: str | None = None,
                 max_length: int | None = None, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
                 max_batch_tokens: int | None = None, prefix_cache_mb: float = 1024.0, kv_cache: str = "auto",
                 kv_pool_mb: float | None = None, add_bos_token: bool | None = None, prefix_token_id: int | None = None,
                 seed: int = 0, **options: Any) -> None:
        super().__init__()
        unknown = sorted(set(options) - set(OPTIONS) - set(_HARNESS_ARGS))
        if unknown:
            load_keys = ", ".join(k for k in OPTIONS if k != "seed")
            raise ModelArgsError(f"unknown {', '.join(unknown)}; accepted: pretrained, dtype, tokenizer, max_length, "
                                 "max_gen_toks, max_batch_tokens, prefix_cache_mb, kv_cache, kv_pool_mb, "
                                 f"add_bos_token, prefix_token_id, seed and moejax.load's {load_keys}")
        # every value checked before the model loads
        max_gen_toks = _int_arg("max_gen_toks", max_gen_toks, 1)
        seed = _int_arg("seed", seed, None)
        if max_length is not None:
            max_length = _int_arg("max_length", max_length, 2)
        if prefix_token_id is not None:
            prefix_token_id = _int_arg("prefix_token_id", prefix_token_id, 0)
        if add_bos_token is not None and not isinstance(add_bos_token, bool):
            raise ModelArgsError(f"add_bos_token={add_bos_token} must be True or False")
        _serving_args(max_batch_tokens, prefix_cache_mb, kv_cache, kv_pool_mb)
        load_options = {k: v for k, v in options.items() if k not in _HARNESS_ARGS and v is not None}
        if isinstance(pretrained, moejax.Engine):
            if load_options or dtype != "auto":
                raise ModelArgsError("pretrained is a loaded Engine; dtype and load options were given to "
                                     "moejax.load already")
            self.engine, directory = pretrained, None
        else:
            directory = resolve_embedded(str(pretrained))
            try:
                self.engine = moejax.load(directory, dtype=dtype, **load_options)
            except (ValueError, TypeError) as e:  # moejax.load names the keyword, as model_args spells it
                raise ModelArgsError(str(e).removeprefix("moejax.load: ")) from None
        tok_dir = tokenizer or (directory if directory and os.path.isdir(directory) else None)
        raw = self.engine.tokenizer
        if tokenizer is not None:
            raw = load_tokenizer(tokenizer)
            if raw is None:
                raise ModelArgsError(f"tokenizer={tokenizer!r} has no tokenizer.json")
        if raw is None:
            raise ModelArgsError(f"pretrained={pretrained!r} has no tokenizer.json; lm-eval tasks are text: pass "
                                 "tokenizer=DIR")
        self.tok = EvalTokenizer(raw, tok_dir, tuple(self.engine.config.eos_token_ids))
        if self.tok.eos_token_id is None:
            raise ModelArgsError(f"no eos token for {pretrained!r} (tokenizer_config.json names none and the model's "
                                 "config has no eos_token_id)")
        context = self.engine.config.max_position_embeddings
        if max_length is not None and not 1 < int(max_length) <= context:
            raise ModelArgsError(f"max_length={max_length} must be in [2, {context}] (the model's context)")
        self._max_length = int(max_length) if max_length is not None else context
        self._max_gen_toks = int(max_gen_toks)
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self.seed = int(seed)
        self.kv_pool_mb = kv_pool_mb
        self.scorer = Scorer(self.engine, max_batch_tokens=max_batch_tokens, prefix_cache_mb=float(prefix_cache_mb),
                             kv_cache=kv_cache)
        self.pretrained = str(pretrained) if directory else self.engine.name

    # -- what TemplateLM and lm-eval ask of a model ------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int | None:  # None: neither the tokenizer nor the config names one
        return self.tok.eos_token_id

    @property
    def prefix_token_id(self) -> int | None:
        if self.custom_prefix_token_id is not None:
            return int(self.custom_prefix_token_id)
        return self.tok.bos_token_id if self.tok.bos_token_id is not None else self.tok.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.pretrained.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        """hf's tok_encode: the tokenizer's special tokens unless add_special_tokens (or add_bos_token) says; none
        when the text already starts with the prefix token."""
        special = add_special_tokens if add_special_tokens is not None else self.add_bos_token
        if add_special_tokens is None:
            prefix = self.prefix_token_id
            assert prefix is not None, "the tokenizer names neither a bos nor an eos token"
            if string.startswith(self.tok.decode([prefix], False)):
                special = False
        ids = self.tok.encode(string, add_special_tokens=True if special is None else bool(special))
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def _context_tokens(self, context: str, room: int) -> list[int]:
        """A generation context as hf's tok_batch_encode encodes it (no special tokens when the text starts with the
        bos token, else as add_bos_token says, else the tokenizer's), its last `room` tokens."""
        special = self.add_bos_token
        if self.tok.bos_token and context.startswith(self.tok.bos_token):
            special = False
        ids = self.tok.encode(context, add_special_tokens=True if special is None else bool(special))
        return ids[-room:]

    def tok_decode(self, tokens: int | Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(tokens, skip_special_tokens)

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
                              disable_tqdm: bool = False, desc: str | None = None) -> list[tuple[float, bool]]:
        """requests: ((context, continuation) or None, context tokens, continuation tokens) -> (logprob, is_greedy),
        in order. Too long for max_length: the context is cut from the left, as hf does."""
        pairs = []
        for _, ctx, cont in requests:
            if len(cont) > self.max_length:
                raise ValueError(f"a continuation of {len(cont)} tokens exceeds max_length {self.max_length}")
            whole = (list(ctx) + list(cont))[-(self.max_length + 1):]
            pairs.append((whole[: len(whole) - len(cont)], list(cont)))
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0,
                   desc=desc or "Running loglikelihood requests")
        results = self.scorer.score(pairs, progress=lambda done: bar.update(len(done)))
        bar.close()
        for (key, _, _), answer in zip(requests, results, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over lm-eval's disjoint rolling windows of max_length tokens (the first
        conditioned on the prefix token), every window of every text scored in one packed run."""
        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for ctx, cont in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((ctx, cont))
                owner.append(i)
        left = [0] * len(requests)
        for i in owner:
            left[i] += 1
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0,
                   desc="Running loglikelihood_rolling requests")

        def progress(done: list[int]) -> None:
            for w in done:
                left[owner[w]] -= 1
                bar.update(left[owner[w]] == 0)
        results = self.scorer.score(windows, progress=progress)
        bar.close()
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, results, strict=True):
            totals[i] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Greedy completions (sampled where the task asks: temperature / top_p), cut at `until` as hf cuts them."""
        refusal = self.engine.placement.no_generation
        if requests and refusal is not None:  # the pipeline layout: said once, before any request runs
            raise ModelArgsError(f"{refusal}; generate_until tasks need another layout or placement")
        eot = self.eot_token_id
        assert eot is not None, "the tokenizer names no eos token"
        eos = self.tok_decode([eot], skip_special_tokens=False)
        jobs, stops = [], []
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            if not isinstance(gen_kwargs, dict):
                raise ValueError(f"generate_until request {i}: gen_kwargs must be a dict; got {gen_kwargs!r}")
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            unknown = sorted(set(kwargs) - set(_GEN_KEYS))
            if unknown:
                raise ValueError(f"generate_until request {i}: moejax does not implement gen_kwargs {unknown} "
                                 f"(it takes {', '.join(_GEN_KEYS)})")
            until = handle_stop_sequences(kwargs.get("until"), eos=eos)
            max_gen = int(kwargs["max_gen_toks"])
            room = self.max_length - max_gen
            if room <= 0:
                raise ValueError(f"generate_until request {i}: max_gen_toks {max_gen} leaves no room for the context "
                                 f"in max_length {self.max_length}")
            temperature = float(kwargs.get("temperature") or 0.0) if kwargs.get("do_sample") else 0.0
            sampling = SamplingParams(temperature, float(kwargs.get("top_p", 1.0)), seed=self.seed + i)
            jobs.append(Completion(tuple(self._context_tokens(context, room)), max_gen, tuple(until), sampling))
            stops.append(until)
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="Running generate_until requests")
        outs = generate(self.engine, jobs, lambda ids: self.tok_decode(ids), kv_pool_mb=self.kv_pool_mb,
                        progress=bar.update)
        bar.close()
        texts = []
        for req, tokens, until in zip(requests, outs, stops, strict=True):
            text = postprocess_generated_text(self.tok_decode(tokens), until, None)
            self.cache_hook.add_partial("generate_until", req.args, text)
            texts.append(text)
        return texts

    # -- chat templates ----------------------------------------------------------------------------------------------
    def chat_template(self, chat_template: bool | str = False) -> str | None:
        template = self.engine.chat_template
        if not chat_template or template is None:
            return None
        return template.source

    def apply_chat_template(self, chat_history: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if self.engine.chat_template is None:
            raise ValueError(f"{self.pretrained}: the model has no chat template (tokenizer_config.json's "
                             "chat_template or chat_template.jinja)")
        if not add_generation_prompt:
            raise NotImplementedError("moejax renders chat templates with a generation prompt only (lm-eval asked to "
                                      "continue the final assistant message)")
        return self.engine.chat_template.render(chat_history, add_generation_prompt=True)

    def get_model_info(self) -> dict:
        return {"pretrained": self.pretrained, "model_dtype": self.engine.dtype.name, "engine": "moejax",
                "kernels": self.engine.kernels.describe(),
                "layout": None if self.engine.layout is None else str(self.engine.layout)}
