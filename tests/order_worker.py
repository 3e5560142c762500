"""Run by tests/sched/test_order_results.py in a process with 8 simulated CPU devices: a scoring file served with the
default order and with --order spf on one device, DP+EP and PP+PP, against the one-device float32 file in the default
order. Prints one JSON line of results."""
import json
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import moejax  # noqa: E402
from moejax.requests.parse import parse_lines  # noqa: E402
from moejax.sched.batch import plan_requests, serve_lines  # noqa: E402
from moejax.sched.serving_options import ServingOptions  # noqa: E402

MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "qwen3_moe")
LAYOUTS = {"one": None, "dp_ep": "attn=dp,experts=ep", "pp_pp": "attn=pp,experts=pp,devices=2"}


def workload() -> list[str]:
    """Scoring lines of 5 to 90 tokens, a third sharing a 2-block prefix, 1-3 candidates of 1-2 tokens."""
    rng = np.random.default_rng(3)
    shared = rng.integers(1, 100, 32).tolist()
    lines = []
    for k in range(14):
        own = rng.integers(1, 100, int(rng.integers(5, 60))).tolist()
        cands = [rng.integers(1, 100, int(rng.integers(1, 3))).tolist() for _ in range(int(rng.integers(1, 4)))]
        lines.append(json.dumps({"custom_id": f"s{k}", "url": "/v1/score",
                                 "body": {"prompt_token_ids": (shared if k % 3 == 0 else []) + own,
                                          "candidate_token_ids": cands}}))
    return lines


def batch_order(engine, lines, order: str) -> list[list[int]]:
    """The requests of each planned batch (indices), in run order."""
    todo = [e for e in parse_lines(lines, tokenizer=None, vocab_size=engine.config.vocab_size, max_context=4096)]
    schedule = plan_requests(engine, todo, ServingOptions(max_batch_tokens=128, order=order))[0]
    return [sorted({s.reads[0][2][0] for row in b.rows for s in row}) for b in schedule.batches]


def main() -> None:
    lines = workload()
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, layout in LAYOUTS.items():
            engine = moejax.load(MODEL, dtype="float32", layout=layout)
            for order in ("longest", "spf"):
                path = os.path.join(tmp, f"{name}-{order}.jsonl")
                serve_lines(engine, lines, path, ServingOptions(max_batch_tokens=128, order=order), seed_nonce=1)
                with open(path) as f:
                    results = [json.loads(t) for t in f]
                out[f"{name}/{order}"] = dict(
                    ids=[r["custom_id"] for r in results],
                    logprobs=[[c["logprob"] for res in r["response"]["body"]["results"] for c in res["candidates"]]
                              for r in results],
                    batches=batch_order(engine, lines, order))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
