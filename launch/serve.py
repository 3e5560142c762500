"""python -m launch.serve: generate from a model (minimal runner; the JSONL batch runner replaces it).

Examples:
  python -m launch.serve                                   # tiny-qwen3-moe preset, demo prompts
  python -m launch.serve --model /path/to/hf_dir --prompt "Once upon a time" --max-new-tokens 32
  python -m launch.serve --prompt-ids 1,2,3 --prompt-ids 7,8 --temperature 0.8 --seed 1
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import moejax

DEMO_PROMPTS = [[1, 2, 3, 4], [10, 20, 30], [7] * 12]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m launch.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-qwen3-moe",
                   help=f"checkpoint directory or preset ({', '.join(moejax.presets())}); default tiny-qwen3-moe")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--num-layers", type=int, default=None, help="run only the first N layers")
    p.add_argument("--prompt", action="append", default=[], help="text prompt (needs a tokenizer); repeatable")
    p.add_argument("--prompt-ids", action="append", default=[], help="comma-separated token ids; repeatable")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-stop", action="store_true", help="ignore the model's end-of-sequence tokens")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    options = {} if args.num_layers is None else {"num_layers": args.num_layers}
    engine = moejax.load(args.model, dtype=args.dtype, **options)
    prompts = []
    for i, text in enumerate(args.prompt_ids):
        try:
            prompts.append([int(t) for t in text.split(",") if t.strip()])
        except ValueError:
            sys.exit(f"--prompt-ids #{i + 1}: {text!r} is not a comma-separated list of ints")
    if args.prompt:
        if engine.tokenizer is None:
            sys.exit(f"--prompt: model {args.model!r} has no tokenizer.json; pass --prompt-ids instead")
        prompts += [engine.tokenizer.encode(t).ids for t in args.prompt]
    prompts = prompts or DEMO_PROMPTS
    stops = None if args.no_stop else list(engine.config.eos_token_ids)
    start = time.perf_counter()
    try:
        outs = engine.generate(prompts, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                               seed=args.seed, stop_token_ids=stops)
    except ValueError as e:
        sys.exit(f"error: {e}")
    seconds = time.perf_counter() - start
    for prompt, out in zip(prompts, outs):
        row = {"prompt_token_ids": prompt, "token_ids": out}
        if engine.tokenizer is not None:
            row["text"] = engine.tokenizer.decode(out)
        print(json.dumps(row))
    print(f"# {args.model}: {len(prompts)} prompts, {sum(map(len, outs))} new tokens in {seconds:.2f}s "
          f"(compile included)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
