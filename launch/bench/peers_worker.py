"""One engine of `python -m launch.bench peers`, in a process of its own (run as a script, so that it also runs
under a Python that has vLLM but not moejax). Reads commands as JSON lines on stdin, answers each on stdout:

  {"workload": NAME}  ->  {"seconds": wall time, "result": per-request candidate logprobs or new tokens}

Workloads come from a JSON file: {NAME: {"kind": "score", "requests": [{"prompt": ids, "candidates": ids}]}}
or {"kind": "generate", "prompts": [ids], "max_new": N}. Engines:
  moejax-serve   the batch runner (moejax.sched.batch.serve_lines, launch.serve's defaults) on /v1/score lines
  moejax         Engine.logits in batches of --batch rows (scoring) and Engine.generate (greedy)
  transformers   the HF model's forward in batches of --batch rows, and model.generate (greedy)
  vllm           LLM.generate with max_tokens=1 and logprob_token_ids (scoring; prefix caching on, reset before
                 every run so that no run reads a previous run's cache) and greedy generation (ignore_eos)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

import numpy as np

import moejax
from moejax.sched.batch import serve_lines

Request = dict[str, list[int]]  # a scoring request: {"prompt": ids, "candidates": ids}
T = TypeVar("T")


class Peer(Protocol):
    def score(self, requests: list[Request]) -> list[list[float]]: ...

    def generate(self, prompts: list[list[int]], max_new: int) -> list[list[int]]: ...


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _batches(items: list[T], n: int) -> list[list[T]]:
    return [items[i:i + n] for i in range(0, len(items), n)]


class MoejaxServe:
    def __init__(self, model: str, dtype: str, batch: int) -> None:
        self.engine, self.serve_lines = moejax.load(model, dtype=dtype), serve_lines

    def score(self, requests: list[Request]) -> list[list[float]]:
        lines = [json.dumps({"custom_id": str(i), "url": "/v1/score",
                             "body": {"prompt_token_ids": r["prompt"],
                                      "candidate_token_ids": [[c] for c in r["candidates"]]}})
                 for i, r in enumerate(requests)]
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "out.jsonl")
            self.serve_lines(self.engine, lines, out)
            with open(out) as f:
                results = [json.loads(line) for line in f]
        return [[c["logprob"] for c in r["response"]["body"]["results"][0]["candidates"]] for r in results]

    def generate(self, prompts: list[list[int]], max_new: int) -> list[list[int]]:
        return self.engine.generate(prompts, max_new_tokens=max_new, temperature=0.0)


class Moejax(MoejaxServe):
    def __init__(self, model: str, dtype: str, batch: int) -> None:
        super().__init__(model, dtype, batch)
        self.batch = batch

    def score(self, requests: list[Request]) -> list[list[float]]:
        out = []
        for group in _batches(requests, self.batch):
            logits = self.engine.logits([r["prompt"] for r in group])  # right-padded rows; read each row's last
            for r, row in zip(group, logits, strict=True):
                lp = _log_softmax(row[len(r["prompt"]) - 1])
                out.append([float(lp[c]) for c in r["candidates"]])
        return out


class Transformers:
    def __init__(self, model: str, dtype: str, batch: int) -> None:
        import torch  # optional: transformers' reference only
        import transformers  # optional: transformers' reference only
        torch.set_num_threads(os.cpu_count() or 1)
        self.torch, self.batch = torch, batch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()

    def score(self, requests: list[Request]) -> list[list[float]]:
        out = []
        with self.torch.inference_mode():
            for group in _batches(requests, self.batch):
                width = max(len(r["prompt"]) for r in group)
                ids = self.torch.tensor([r["prompt"] + [0] * (width - len(r["prompt"])) for r in group])
                logits = self.model(ids).logits.float().numpy()
                for r, row in zip(group, logits, strict=True):
                    lp = _log_softmax(row[len(r["prompt"]) - 1])
                    out.append([float(lp[c]) for c in r["candidates"]])
        return out

    def generate(self, prompts: list[list[int]], max_new: int) -> list[list[int]]:
        assert len({len(p) for p in prompts}) == 1, "equal prompt lengths (no padding) keep the engines comparable"
        with self.torch.inference_mode():
            ids = self.torch.tensor(prompts)
            out = self.model.generate(ids, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                                      pad_token_id=0, attention_mask=self.torch.ones_like(ids))
        return out[:, ids.shape[1]:].tolist()


class Vllm:
    def __init__(self, model: str, dtype: str, batch: int) -> None:
        from vllm import LLM, SamplingParams  # optional: the peer measured against
        self.SamplingParams = SamplingParams
        self.llm = LLM(model=model, dtype=dtype, skip_tokenizer_init=True, enable_prefix_caching=True,
                       max_model_len=2048, seed=0)

    def _prompts(self, ids: list[list[int]]) -> list[dict[str, list[int]]]:
        return [{"prompt_token_ids": p} for p in ids]

    def score(self, requests: list[Request]) -> list[list[float]]:
        self.llm.reset_prefix_cache()
        params = [self.SamplingParams(max_tokens=1, temperature=0.0, logprob_token_ids=r["candidates"])
                  for r in requests]
        outs = self.llm.generate(self._prompts([r["prompt"] for r in requests]), params, use_tqdm=False)
        return [[float(o.outputs[0].logprobs[0][c].logprob) for c in r["candidates"]]
                for r, o in zip(requests, outs, strict=True)]

    def generate(self, prompts: list[list[int]], max_new: int) -> list[list[int]]:
        self.llm.reset_prefix_cache()
        params = self.SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
        outs = self.llm.generate(self._prompts(prompts), params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


ENGINES: dict[str, Callable[[str, str, int], Peer]] = {
    "moejax-serve": MoejaxServe, "moejax": Moejax, "transformers": Transformers, "vllm": Vllm}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--engine", choices=list(ENGINES), required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--workloads", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=8, help="rows per forward (moejax, transformers scoring)")
    args = p.parse_args()
    with open(args.workloads) as f:
        workloads = json.load(f)
    engine = ENGINES[args.engine](args.model, args.dtype, args.batch)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        name = json.loads(line)["workload"]
        w = workloads[name]
        t0 = time.perf_counter()
        if w["kind"] == "score":
            result = engine.score(w["requests"])
        else:
            result = [list(map(int, r)) for r in engine.generate(w["prompts"], w["max_new"])]
        seconds = time.perf_counter() - t0
        print(json.dumps({"seconds": seconds, "result": result}), flush=True)


if __name__ == "__main__":
    main()
