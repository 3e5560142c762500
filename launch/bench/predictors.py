"""`python -m launch.bench predictors`: every expert predictor measured on held-out routing traces.

- recall: the share of true (token, layer, expert) choices each predictor named, per target MoE layer and
  overall, at each prefetch distance (oracle, previous_hidden, router, estimator, hybrid, expert_map, and
  moe_infinity: MoE-Infinity's request-level activation matrices, fMoE's baseline, from the training traces' requests
  and each held-out request's once it is done; expert maps predict a set per decode iteration whose size follows
  the search score, reported as "set_size");
- cache: the expert cache replayed as batch-1 decode over the same traces, for lru / lfu / priority at several
  slot counts, without prefetch and with each distance-1 predictor prefetching: hit rate and bytes moved;
- speculative: held-out perplexity and top-1 when each distance-1 predictor's experts are executed instead of
  the router's, against exact execution, and how many multiple-choice answers (--input score requests) change
  (expert maps prefetch only: one set per pass cannot be executed per token);
- analyses (Speculating Experts Fig. 3 and 5, moejax.offload.predict.analyses): the cosine drift of the
  previous-hidden and quasi-hidden states to the true router input per layer distance, and the rank alignment
  of their predicted expert scores with the true router's (Spearman, hit rate by rank);
- expert_map_ablation (fMoE §6.5-6.6, launch/bench/map_ablation.py): Map (T) / (T+S) / (T+S+δ) and the store capacity.

Without --estimator / --maps, default vectors, one estimator and one expert-map store per distance are built
from --train-text / --train-stdlib (and the output says so).

  python -m launch.bench predictors --model pycode-moe --stdlib held_out --train-stdlib train --plot recall.png

--plot draws recall, drift and rank alignment side by side (launch/bench/predictor_plots.py).
"""
from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
from flax import nnx

import moejax
from launch.bench import expert_map_plots
from launch.bench.map_ablation import map_ablation
from launch.bench.predictor_plots import plot
from launch.bench.quality import read_texts, stdlib_texts, token_stream
from launch.distill import text_prompts
from launch.serve import read_lines
from moejax.engine import Engine
from moejax.eval.speculation_cost import best_answers, window_quality
from moejax.offload.predict import (
    EstimatorPredictor,
    HybridPredictor,
    OraclePredictor,
    PreviousHiddenPredictor,
    RouterPredictor,
    replay,
)
from moejax.offload.predict.activation_matrices import ActivationMatrices, replay_online
from moejax.offload.predict.analyses import drift_and_alignment
from moejax.offload.predict.cache_replay import replay_cache
from moejax.offload.predict.estimator import EstimatorNet
from moejax.offload.predict.expert_maps import ExpertMapStore, build_store, replay_predictions
from moejax.offload.predict.hit_counts import request_counts
from moejax.offload.predict.protocol import Predictor
from moejax.offload.predict.router import DefaultVectors
from moejax.offload.predict.traces import record
from moejax.requests.parse import ScoreRequest, parse_lines
from moejax.train.distill import distill


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = sub.add_parser("predictors", help="recall, cache hit rates and speculative accuracy of every predictor")
    p.add_argument("--model", default="pycode-moe", help="preset or HF checkpoint directory with a tokenizer")
    test = p.add_mutually_exclusive_group(required=True)
    test.add_argument("--text", help="held-out text: a file or a directory of them")
    test.add_argument("--stdlib", choices=["held_out", "train"], help="a split of the stdlib corpus")
    p.add_argument("--input", default=None, help="requests JSONL whose score requests are the multiple-choice set")
    p.add_argument("--estimator", default=None, help="an estimator directory (launch.distill); else built")
    p.add_argument("--maps", default=None, help="an expert-map directory (launch.calibrate --maps); else built")
    p.add_argument("--capacity", type=int, default=1024, help="maps kept when building the store")
    train = p.add_mutually_exclusive_group()
    train.add_argument("--train-text", default=None, help="text to build default vectors and estimators from")
    train.add_argument("--train-stdlib", choices=["train", "held_out"], default=None)
    p.add_argument("--distances", default="1,2,3", help="prefetch distances (MoE layers)")
    p.add_argument("--tokens", type=int, default=16384, help="held-out tokens traced")
    p.add_argument("--train-tokens", type=int, default=65536, help="training tokens traced (when building)")
    p.add_argument("--distill-steps", type=int, default=2000)
    p.add_argument("--window", type=int, default=256, help="tokens per traced prompt")
    p.add_argument("--slots", default=None, help="cache slot counts (default: 1x, 2x and 4x top-k x MoE layers)")
    p.add_argument("--cache-tokens", type=int, default=2048, help="tokens of the cache replay")
    p.add_argument("--speculative-windows", type=int, default=8, help="held-out windows of 512 for perplexity")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--capacities", default="1,4,16,64,256,1024",
                   help="expert-map store capacities of the ablation (capped at the maps built)")
    p.add_argument("--plot", default=None, help="PNG of recall per layer per predictor, cosine drift and rank "
                                                "alignment (needs matplotlib)")
    p.add_argument("--maps-plot", default=None, help="PNG of the expert-map ablation and store capacity (needs "
                                                     "matplotlib)")
    p.add_argument("--out", default=None, help="JSON file (default bench/results/predictors-<device>.json)")
    return p


def _predictors(nets: dict[int, EstimatorNet], vectors: DefaultVectors, distance: int) -> dict[str, Predictor]:
    out: dict[str, Predictor] = {"previous_hidden": PreviousHiddenPredictor(distance),
                                 "router": RouterPredictor(vectors, distance)}
    if distance in nets:
        out.update(estimator=EstimatorPredictor(nets[distance]), hybrid=HybridPredictor(nets[distance]))
    return out


def _build(args: argparse.Namespace, engine: Engine, distances: list[int], log: Callable[[str], None]
           ) -> tuple[dict[int, EstimatorNet], DefaultVectors, dict[int, ExpertMapStore], str, np.ndarray | None]:
    """-> ({distance: EstimatorNet}, DefaultVectors, {distance: ExpertMapStore}, how they were made, the calibration
    requests' hit-count matrices or None)."""
    nets: dict[int, EstimatorNet] = {}
    vectors: DefaultVectors | None = None
    stores: dict[int, ExpertMapStore] = {}
    made: list[str] = []
    if args.estimator:
        net = EstimatorNet.load(args.estimator)
        nets, vectors = {net.shape.distance: net}, net.vectors
        made.append(f"estimator loaded from {args.estimator}")
    if args.maps:
        store = ExpertMapStore.load(args.maps)
        stores = {store.distance: store}
        made.append(f"expert maps loaded from {args.maps}")
    if args.estimator and args.maps:
        assert vectors is not None  # the estimator's
        return nets, vectors, stores, "; ".join(made), None
    if not (args.train_text or args.train_stdlib):
        raise SystemExit("predictors: give --estimator DIR and --maps DIR, or --train-text / --train-stdlib to "
                         "build what is not given")
    texts = read_texts(args.train_text) if args.train_text else stdlib_texts(args.train_stdlib)
    prompts = text_prompts(engine, texts, args.window)
    order = np.random.default_rng(0).permutation(len(prompts))
    traces, train_vectors = record(engine, [prompts[i] for i in order], max_tokens=args.train_tokens)
    source = f"{len(traces.tokens)} tokens of {args.train_text or 'stdlib:' + args.train_stdlib}"
    log(f"predictors: building what was not given from {source}")
    if not args.estimator:
        steps = replay.steps_of(engine)
        vectors = train_vectors
        nets = {d: distill(steps, traces, vectors, distance=d, train_steps=args.distill_steps, log=log,
                           progress=False) for d in distances}
        made.append(f"default vectors and estimators built from {source}")
    if not args.maps:
        embed = np.asarray(nnx.merge(engine.graphdef, engine.params).embed[...], np.float32)
        stores = {d: build_store(traces, embed, capacity=args.capacity, distance=d) for d in distances}
        made.append(f"expert maps built from {source} ({traces.num_prompts} prompts)")
    counts = request_counts(traces, engine.config.num_experts_per_tok)
    assert vectors is not None  # the estimator's, or built from the traces
    return nets, vectors, stores, "; ".join(made), counts


def predictors(args: argparse.Namespace, env: dict) -> dict:
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    engine = moejax.load(args.model, dtype=args.dtype)
    cfg = engine.config
    moe_count = sum(cfg.is_moe(i) for i in range(cfg.num_layers))
    distances = [d for d in (int(x) for x in args.distances.split(",")) if 1 <= d < moe_count]
    texts = read_texts(args.text) if args.text else stdlib_texts(args.stdlib)
    prompts = text_prompts(engine, texts, args.window)
    traces, _ = record(engine, prompts, max_tokens=args.tokens)
    log(f"predictors: {args.model}, {len(traces.tokens)} held-out tokens of {args.text or 'stdlib:' + args.stdlib}")
    nets, vectors, stores, built, hit_counts = _build(args, engine, distances, log)
    steps = replay.steps_of(engine)
    truth = replay.true_routing(steps, traces)
    embed = np.asarray(nnx.merge(engine.graphdef, engine.params).embed[...], np.float32)
    k = cfg.num_experts_per_tok

    recall, predicted_d1 = [], {}
    oracle = replay.recall_by_layer(steps, OraclePredictor(), traces, truth)
    recall.append(dict(predictor="oracle", distance=0, **_keyed(oracle)))
    for d in distances:
        for name, predictor in _predictors(nets, vectors, d).items():
            predicted = replay.predictions(steps, predictor, traces, truth)
            r = replay.recall_by_layer(steps, predictor, traces, truth, predicted)
            recall.append(dict(predictor=name, distance=d, **_keyed(r)))
            log(f"  recall {name:16s} d={d}: {r['overall']:.3f}  " +
                " ".join(f"{t}:{v:.2f}" for t, v in r["per_layer"].items()))
            if d == 1:
                predicted_d1[name] = predicted
        if d in stores:
            predicted, set_size = replay_predictions(stores[d], traces, embed, k)
            r = replay.recall_by_layer(steps, None, traces, truth, predicted)
            recall.append(dict(predictor="expert_map", distance=d, set_size=set_size, **_keyed(r)))
            log(f"  recall {'expert_map':16s} d={d}: {r['overall']:.3f}  " +
                " ".join(f"{t}:{v:.2f}" for t, v in r["per_layer"].items()) + f"  ({set_size:.1f} experts a set)")
            if d == 1:
                predicted_d1["expert_map"] = predicted
        # MoE-Infinity (fMoE's baseline): the training traces' request matrices (none when --estimator and --maps
        # were given: then online from empty), and each held-out request's once it is done
        collection = ActivationMatrices(traces.num_prompts + (0 if hit_counts is None else len(hit_counts)), hit_counts)
        predicted = replay_online(traces, k, d, collection=collection)
        r = replay.recall_by_layer(steps, None, traces, truth, predicted)
        recall.append(dict(predictor="moe_infinity", distance=d, set_size=float(k), **_keyed(r)))
        log(f"  recall {'moe_infinity':16s} d={d}: {r['overall']:.3f}  " +
            " ".join(f"{t}:{v:.2f}" for t, v in r["per_layer"].items()))
        if d == 1:
            predicted_d1["moe_infinity"] = predicted

    slot_counts = [int(s) for s in args.slots.split(",")] if args.slots else [k * moe_count * f for f in (1, 2, 4)]
    expert_bytes = _expert_bytes(engine)
    n = min(args.cache_tokens, len(traces.tokens))
    head = [idx[:n] for idx, _ in truth]
    cut = lambda pred: {t: (i[:n], w[:n]) for t, (i, w) in pred.items()}  # noqa: E731
    moe = traces.moe_layers
    map_sources = {moe[t]: moe[max(t - 1, 0)] for t in range(len(moe))}  # the first layer: semantic, before it runs
    oracle_pred = {layer: (idx[:n], w[:n]) for layer, (idx, w) in zip(traces.moe_layers, truth, strict=True)}
    cache = []
    for policy in ("lru", "lfu", "priority"):
        for slots in slot_counts:
            runs = {"none": (None, 1), "oracle": (oracle_pred, 0)}
            runs.update({name: (cut(p), 1) for name, p in predicted_d1.items()})
            for name, (pred, distance) in runs.items():
                sources = map_sources if name in ("expert_map", "moe_infinity") else None
                r = replay_cache(head, traces.moe_layers, slots, policy, predicted=pred, distance=distance,
                                 sources=sources, expert_bytes=expert_bytes)
                cache.append(dict(policy=policy, slots=slots, prefetch=name, tokens=n, **r))
            log(f"  cache {policy:8s} {slots:4d} slots: " + " ".join(
                f"{c['prefetch']}={c['hit_rate']:.3f}" for c in cache[-len(runs):]))

    analyses = drift_and_alignment(steps, traces, vectors, truth, max(distances, default=0))
    for row in analyses["cosine_drift"]:
        log(f"  drift {row['representation']:16s} d={row['distance']}: cosine {row['mean']:.3f}")
    for row in analyses["rank_alignment"]:
        log(f"  alignment {row['representation']:12s} d={row['distance']}: Spearman {row['spearman']:.3f}, hit rate "
            f"by rank " + " ".join(f"{h:.3f}" for h in row["hit_rate_by_rank"]))
    ablation = None
    if 1 in stores:
        ablation = map_ablation(stores[1], traces, embed, steps, truth, slot_counts=slot_counts, cache_tokens=n,
                                expert_bytes=expert_bytes,
                                capacities=[int(c) for c in args.capacities.split(",")], log=log,
                                hit_counts=hit_counts)
    speculative = _speculative(args, engine, texts, nets, vectors, best_answers, window_quality, log)
    result = dict(env, bench="predictors", model=args.model, dtype=str(engine.dtype),
                  text=args.text or f"stdlib:{args.stdlib}", held_out_tokens=int(len(traces.tokens)),
                  estimators=built, distances=distances, recall=recall, cache=cache, speculative=speculative,
                  analyses=analyses, expert_map_ablation=ablation,
                  targets=dict(estimator_recall_above_router_at_its_worst_layer=True,
                               hybrid_at_least_the_better_of_router_and_estimator=True,
                               speculative_relative_perplexity_cost_at_most=0.05))
    if args.plot:
        plot(recall, analyses, args.plot)
        result["plot"] = args.plot
    if args.maps_plot and ablation is not None:
        expert_map_plots.ablation(ablation, args.maps_plot)
        result["maps_plot"] = args.maps_plot
    return result


def _keyed(r: dict) -> dict:
    return dict(overall=r["overall"], per_layer={str(t): v for t, v in r["per_layer"].items()})


def _expert_bytes(engine: Engine) -> int:
    layer = next(i for i in range(engine.config.num_layers) if engine.config.is_moe(i))
    arrays = engine.layer_experts(layer)
    return int(sum(a.nbytes for a in arrays.values()) // engine.config.num_experts)


def _speculative(args: argparse.Namespace, engine: Engine, texts: list[str], nets: dict[int, EstimatorNet],
                 vectors: DefaultVectors, best_answers: Callable[[Engine, list[ScoreRequest]], list[int]],
                 window_quality: Callable[[Engine, np.ndarray], dict], log: Callable[[str], None]) -> list[dict]:
    cfg = engine.config
    if engine.tokenizer is None:
        raise SystemExit(f"predictors: --model {args.model} has no tokenizer.json; the speculative rows read text")
    stream = token_stream(engine.tokenizer, texts, cfg.eos_token_ids[0] if cfg.eos_token_ids else 0)
    T = min(512, cfg.max_position_embeddings - 1)
    rows = np.stack([stream[i * T:i * T + T + 1] for i in range(min(args.speculative_windows, (len(stream) - 1) // T))])
    exact = window_quality(engine, rows)
    mc = []
    if args.input:
        mc = [e for e in parse_lines(read_lines(args.input), tokenizer=engine.tokenizer, vocab_size=cfg.vocab_size,
                                     max_context=cfg.max_position_embeddings, chat=engine.chat_template)
              if isinstance(e, ScoreRequest)]
    exact_answers = best_answers(engine, mc)
    log(f"  speculative: exact perplexity {exact['perplexity']:.2f}, top-1 {exact['top1_accuracy']:.3f} on "
        f"{rows.size - len(rows)} tokens; {len(exact_answers)} multiple-choice answers")
    slots = cfg.num_experts * sum(cfg.is_moe(i) for i in range(cfg.num_layers))
    out = []
    for name, predictor in _predictors(nets, vectors, 1).items():
        spec = moejax.load(args.model, dtype=args.dtype, placement="cached", cache_slots=slots, predictor=predictor,
                           speculative=True)
        q = window_quality(spec, rows)
        answers = best_answers(spec, mc)
        stats = spec.stats()["total"]
        out.append(dict(predictor=name, distance=1, perplexity=q["perplexity"], perplexity_exact=exact["perplexity"],
                        relative_perplexity_cost=q["perplexity"] / exact["perplexity"] - 1,
                        top1_accuracy=q["top1_accuracy"], top1_accuracy_exact=exact["top1_accuracy"],
                        mispredicted_token_share=stats["mispredicted_tokens"] / max(stats["checked_tokens"], 1),
                        multiple_choice=len(answers),
                        multiple_choice_changed=int(sum(a != b for a, b in zip(answers, exact_answers, strict=True)))))
        log(f"  speculative {name:16s}: perplexity {q['perplexity']:.2f} ({out[-1]['relative_perplexity_cost']:+.1%}), "
            f"top-1 {q['top1_accuracy']:.3f}, {out[-1]['multiple_choice_changed']} answers changed")
    return out
