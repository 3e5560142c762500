"""`launch.serve --replicas N` (or --ray ADDRESS): the requests routed over engine replicas (Ray actors) by
MoE-Prefill's frontend (moejax.replicas.run); the output, its journal and resume are the one-engine run's."""
from __future__ import annotations

import argparse
import functools
import sys
from typing import Any

from moejax.replicas.run import ReplicaPlan, ReplicaRun, ReplicasFailed
from moejax.requests.results import SettingsMismatch, WriteFailed
from moejax.sched.serving_options import ServingOptions
from moejax.serving.load_engine import replica_engine, settings_for


def serve_replicas(args: argparse.Namespace, lines: list[str], serving: ServingOptions, plan: ReplicaPlan) -> dict:
    """Start the replicas, serve `lines` into --output, stop them -> the run summary (exits with a message when no
    replica starts or every one dies; the journal keeps what was written)."""
    run = ReplicaRun(functools.partial(replica_engine, args, serving), serving, plan, model=args.model,
                     num_layers=args.num_layers)
    where = f"--ray {plan.ray}" if plan.ray else f"--replicas {plan.replicas}"
    try:
        infos = run.start()
        base, placement = run.settings(infos)
        summary = run.serve(lines, args.output, settings_for(args, base, placement), infos,
                            error_file=args.error_file)
    except ReplicasFailed as e:
        sys.exit(f"{where}: {e}")
    except SettingsMismatch as e:
        sys.exit(f"--output {args.output}: {e}")
    except WriteFailed as e:
        sys.exit(f"--output: {e}")
    finally:
        run.stop()
    return {"model": args.model, "dtype": base["dtype"], "device": infos[0]["device"], **summary}


def format_summary(s: dict[str, Any]) -> str:
    """The run's line, then one line per replica: its share of the work and how its prefix cache served it."""
    rate = s["tokens_per_s"]
    balance = s["flops_balance"]
    lines = [f"# {s['model']} on {len(s['replicas'])} replicas ({s['routing']} routing): {s['requests_ok']} ok, "
             f"{s['requests_failed']} failed, {s['requests_resumed']} resumed, {s['requests_invalid']} invalid lines "
             f"in the input | {s['prompt_tokens']} prompt tokens ({s['cached_prompt_tokens']} from prefix caches, "
             f"{s['computed_tokens']} computed), {s['generated_tokens']} generated | {s['wall_s']:.2f}s, "
             f"{'-' if rate is None else f'{rate:.0f}'} tok/s | prefix-cache hit rate "
             f"{s['prefix_cache_hit_rate']:.1%} | busiest replica's FLOPs "
             f"{'-' if balance is None else f'{balance:.2f}x'} the mean | {s['rerouted']} requests routed again"]
    for r in s["replicas"]:
        theta = "none (one batch of the token budget)" if r["theta_flops"] is None else f"{r['theta_flops']:.3g}"
        rate = r["tokens_per_s"]
        lines.append(f"#   replica {r['index']} [{r['state']}] {r['device'] or '-'}: {r['requests']} requests in "
                     f"{r['shares']} shares, {'-' if rate is None else f'{rate:.0f}'} tok/s busy, prefix-cache hit "
                     f"rate {r['prefix_cache_hit_rate']:.1%}, load {r['routed_flops']:.3g} FLOPs, Θ {theta}"
                     + (f" | {r['error']}" if r["error"] else ""))
    return "\n".join(lines)
