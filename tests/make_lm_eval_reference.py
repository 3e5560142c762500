#!/usr/bin/env python
"""Write the local lm-eval tasks' data and lm-eval's own `hf` model's answers on them, for
tests/eval/test_lm_eval_model.py (which compares `--model moejax` against these, without torch).

Dev-only: needs lm_eval, torch and transformers (`pip install torch==2.13.0 transformers`, CPU build):

    python tests/make_lm_eval_reference.py --data   # the tasks' JSONL files (greedy choices by transformers)
    python tests/make_lm_eval_reference.py          # hf_reference.json: every request's answer and the metrics

Run from the repository root (the task YAMLs name their data files relative to it). The data: lines of the
running interpreter's standard library sources, cut into multiple-choice questions (a 2-shot task whose prompts
share their few-shot prefix; a 0-shot task whose choices include each model's greedy continuation, so is_greedy
is true for some), completions ended at a newline, and texts for rolling log-likelihoods longer than a window."""
import argparse
import inspect
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "lm_eval"
REFERENCE = DATA / "hf_reference.json"
TASKS = ["moejax_mc", "moejax_mc_greedy", "moejax_gen", "moejax_rolling"]
# name -> (checkpoint directory, extra model_args as both models take them)
MODELS = {
    "qwen3_moe": ("tests/fixtures/qwen3_moe", {}),
    "pycode-moe": ("moejax/assets/pycode-moe", {"max_length": 128}),  # short windows: several per rolling text
}
GREEDY_TOKENS = 3


def source_lines(seed: int) -> list[str]:
    import json.encoder
    import string
    import textwrap
    lines = [ln.rstrip() for mod in (textwrap, json.encoder, string) for ln in inspect.getsource(mod).splitlines()]
    lines = [ln for ln in lines if 24 <= len(ln.strip()) <= 90 and not ln.strip().startswith("#")]
    random.Random(seed).shuffle(lines)
    return lines


def cut(line: str, rng: random.Random) -> tuple[str, str] | None:
    """(context, next word-ish chunk): cut after a space or bracket; half the contexts keep the trailing space."""
    start = len(line) - len(line.lstrip())
    points = [i for i, ch in enumerate(line) if ch in " (.[" and start + 6 <= i < len(line) - 4]
    if not points:
        return None
    i = rng.choice(points) + 1
    rest = line[i:]
    end = next((j for j, ch in enumerate(rest) if j >= 2 and ch in " (),.:[]"), len(rest))
    if rng.random() < 0.5 and line[i - 1] == " ":  # the space goes with the continuation instead
        return line[: i - 1], " " + rest[:end]
    return line[:i], rest[:end]


def multiple_choice(lines: list[str], n: int, rng: random.Random) -> list[dict]:
    cuts = [c for c in (cut(ln, rng) for ln in lines) if c]
    docs = []
    for ctx, gold in cuts[:n]:
        others = [c for _, c in cuts[n:] if c.strip() != gold.strip()]
        choices = [gold] + rng.sample(others, 3)
        rng.shuffle(choices)
        docs.append({"context": ctx, "choices": choices, "gold": choices.index(gold)})
    return docs


def greedy_choice(tok, model, context: str) -> str | None:
    """The model's greedy continuation of `context` (up to GREEDY_TOKENS tokens) as text whose tokens, encoded
    after the context as lm-eval's _encode_pair does, are those tokens; None when no prefix of it round-trips."""
    import torch
    ids = tok(context)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=GREEDY_TOKENS, do_sample=False,
                             pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
    for n in range(len(out), 0, -1):
        text = tok.decode(out[:n])
        if text and not text.isspace() and tok(context + text)["input_ids"][len(ids):] == out[:n] \
                and tok(context)["input_ids"] == ids and "\ufffd" not in text:
            return text
    return None


def splits(toks, context: str, continuation: str) -> bool:
    """Whether every tokenizer gives the continuation a token of its own after the context, as lm-eval's
    _encode_pair splits them (hf asserts a non-empty continuation)."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    for tok in toks:
        ctx, whole = tok(context)["input_ids"], tok(context + continuation)["input_ids"]
        if len(whole) <= len(ctx) or whole[: len(ctx)] != ctx:
            return False
    return True


def keep_splitting(docs: list[dict], toks) -> list[dict]:
    """Docs with the choices that split from their context (a doc whose answer does not is dropped)."""
    out = []
    for d in docs:
        gold = d["choices"][d["gold"]]
        choices = [c for c in d["choices"] if splits(toks, d["context"], c)]
        if gold in choices:
            out.append({**d, "choices": choices, "gold": choices.index(gold)})
    return out


def write_data() -> None:
    import torch
    import transformers as tf
    rng = random.Random(30)
    lines = source_lines(30)
    DATA.mkdir(parents=True, exist_ok=True)
    toks = [tf.AutoTokenizer.from_pretrained(ROOT / path) for path, _ in MODELS.values()]
    mc = keep_splitting(multiple_choice(lines[:80], 14, rng), toks)
    fewshot, mc = mc[:2], mc[2:]
    zero = keep_splitting(multiple_choice(lines[80:160], 8, rng), toks)
    for doc in zero:  # no trailing space: _encode_pair would move it into every choice, the greedy one's too
        if doc["context"].endswith(" "):
            doc["context"], doc["choices"] = doc["context"][:-1], [" " + c for c in doc["choices"]]
    for path, _ in MODELS.values():
        tok = tf.AutoTokenizer.from_pretrained(ROOT / path)
        model = tf.AutoModelForCausalLM.from_pretrained(ROOT / path, dtype=torch.float32).eval()
        for doc in zero:
            text = greedy_choice(tok, model, doc["context"])
            if text is not None and text not in doc["choices"] and splits(toks, doc["context"], text):
                doc["choices"].append(text)
    gen = []
    for ln in lines[160:240]:
        if len(gen) == 6:
            break
        c = cut(ln, rng)
        if c:
            gen.append({"prompt": c[0], "target": ln[len(c[0]):]})
    gen[0]["prompt"] = "# café, naïve: " + gen[0]["prompt"]  # multi-byte characters through both tokenizers
    body = "\n".join(lines[240:300])
    rolling = [{"text": body[k * 700:(k + 1) * 700]} for k in range(3)] + [{"text": "x = 1  # short, one window"}]
    for name, docs in (("mc_fewshot", fewshot), ("mc", mc), ("mc_greedy", zero), ("gen", gen),
                       ("rolling", rolling)):
        with open(DATA / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps(d, ensure_ascii=False) + "\n")
        print(f"{DATA / name}.jsonl: {len(docs)} docs")


def run_lm_eval(model: str, model_args: dict, tasks=TASKS, limit=None) -> dict:
    """simple_evaluate on the local tasks -> {"requests": {task: [[args, answer], ...]}, "metrics": {...}}."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    # only the local tasks: indexing lm-eval's own thousands of task files takes seconds
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(tasks),
                                  task_manager=TaskManager(include_path=str(DATA), include_defaults=False),
                                  log_samples=True, limit=limit, batch_size=1, device="cpu", random_seed=0,
                                  numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    found = {"requests": {task: [s["arguments"] for s in out["samples"][task]] for task in tasks},
             "answers": {task: [s["resps"] for s in out["samples"][task]] for task in tasks},
             "metrics": {task: {k: v for k, v in out["results"][task].items() if k != "alias"} for task in tasks}}
    return json.loads(json.dumps(found))  # as the reference file holds it (tuples as lists)


def write_reference() -> None:
    import importlib.metadata as md

    import torch
    import transformers as tf
    reference = {"made_by": "tests/make_lm_eval_reference.py", "hf_model": "lm_eval --model hf",
                 "versions": {p: md.version(p) for p in ("lm_eval", "torch", "transformers", "tokenizers")},
                 "models": {}}
    torch.manual_seed(0)
    for name, (path, extra) in MODELS.items():
        args = {"pretrained": path, "dtype": "float32", **extra}
        reference["models"][name] = {"model_args": args, **run_lm_eval("hf", args)}
        print(f"{name}: {json.dumps(reference['models'][name]['metrics'])}")
    with open(REFERENCE, "w", encoding="utf-8") as f:
        json.dump(reference, f, indent=1, ensure_ascii=False)
    print(f"{REFERENCE}: {REFERENCE.stat().st_size / 1e3:.0f} kB (transformers {tf.__version__})")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", action="store_true", help="(re)write the tasks' JSONL data, not the reference")
    args = ap.parse_args()
    if Path.cwd() != ROOT:
        sys.exit(f"run from the repository root ({ROOT}): the task YAMLs name their data relative to it")
    write_data() if args.data else write_reference()


if __name__ == "__main__":
    main()
