"""python -m launch.train: train the embedded model (moejax.train) with optax on the Python standard library's own
sources, then export it as a Hugging Face checkpoint directory.

  python -m launch.train --out runs/pycode-moe                  # ~95 minutes on 2 CPU cores
  python -m launch.train --out runs/pycode-moe --resume         # after a kill, SIGTERM or Ctrl-C
  python -m launch.train --out runs/pycode-moe --resume --export moejax/assets/pycode-moe   # re-export

Progress on a terminal (loss, tokens/s, ETA); metrics in OUT/metrics.jsonl; orbax checkpoints in OUT/checkpoints
every --checkpoint-minutes and on SIGTERM/SIGINT. A completed run is exported to --export (default OUT/export).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from moejax.train.configs import TRAIN_CONFIGS
from moejax.train.export import export
from moejax.train.loop import Run, Settings, train

_FLAGS = {f.name: f for f in dataclasses.fields(Settings)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="run directory (created; with --resume, an existing run)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its newest checkpoint")
    p.add_argument("--export", default=None, help="HF checkpoint directory to write when the run completes "
                   "(default: OUT/export)")
    p.add_argument("--export-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--no-export", action="store_true", help="do not export when the run completes")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (metrics.jsonl is always written)")
    defaults = Settings()
    p.add_argument("--config", default=None, choices=list(TRAIN_CONFIGS), help=f"model shape ({defaults.config})")
    for name in _FLAGS:
        if name != "config":
            kind = int if name in ("max_files", "checkpoint_every") else type(getattr(defaults, name))
            p.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                           help=f"default {getattr(defaults, name)}")
    args = p.parse_args(argv)
    given = {n: getattr(args, n) for n in _FLAGS if getattr(args, n) is not None}
    try:
        if args.resume:
            run = Run(args.out, resume=True)
            if given:
                unchanged = {n: getattr(run.settings, n) for n in given}
                if unchanged != given:
                    sys.exit(f"--resume continues with the run's saved settings; these flags differ: "
                             f"{ {n: (unchanged[n], v) for n, v in given.items() if unchanged[n] != v} }")
        else:
            settings = Settings(**given)
            run = Run(args.out, settings)
    except (ValueError, FileExistsError, FileNotFoundError) as e:
        sys.exit(str(e))
    result = train(run, progress=False if args.no_progress else None)
    if result["stopped_by"] is not None or args.no_export:
        return 0
    target = args.export or os.path.join(args.out, "export")
    export(run, result, target, dtype=args.export_dtype)
    print(f"exported step {result['step']} to {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
