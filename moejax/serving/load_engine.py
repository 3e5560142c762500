"""How launch.serve makes its engine from the flags, and what of it decides results: the load with the flags'
plan, Θ for placements that copy experts, the run's settings (the journal's fingerprint). Shared by the one-engine
run and each engine replica (moejax.serving.replicated), so every replica is the engine a one-engine run would load."""
from __future__ import annotations

import argparse
import hashlib
import os
import sys

import jax

import moejax
from moejax import options
from moejax.engine import Engine
from moejax.measure.saturation import profile_saturation
from moejax.offload.settings import PlacementSettings
from moejax.plan.engine_plan import EnginePlan, Workload
from moejax.plan.resolve import profile_for
from moejax.presets import resolve_embedded
from moejax.replicas.run import ReplicaPlan
from moejax.sched.batch import engine_settings, line_list, unservable_lines
from moejax.sched.batch_size import DEFAULT_TOKENS
from moejax.sched.serving_options import ServingOptions
from moejax.serving.model_options import ModelOptions


def load(args: argparse.Namespace, serving: ServingOptions) -> Engine:
    """The model with the flags' plan: placement, layout and profile, its auto choices made for batches of
    --max-batch-tokens."""
    model = options.from_args(ModelOptions, args)
    plan = options.from_args(EnginePlan, args, placement=options.from_args(PlacementSettings, args),
                             workload=Workload(tokens=serving.max_batch_tokens or DEFAULT_TOKENS, seq_len=args.seq_len,
                                               gen_len=args.gen_len))
    return moejax.load(model.model, dtype=model.dtype, num_layers=model.num_layers, kernels=model.kernels,
                       batch_invariant=model.batch_invariant, plan=plan)


def refusal(engine: Engine, args: argparse.Namespace, lines: list[str]) -> str | None:
    """What the engine's placement cannot serve, as a one-line error, found before any weight loads: --kv-cache on
    without a prefix pool; completions that generate without generation (unless --allow-invalid-lines: they are
    answered 400 with the reason)."""
    what = f"--layout {args.layout}" if engine.layout is not None else f"--placement {args.placement}"
    why = engine.placement.no_prefix_pool
    if args.kv_cache == "on" and why is not None:
        return f"--kv-cache on: {why}; use --kv-cache auto (which runs off here) or off"
    refused = unservable_lines(engine, lines)
    if refused and not args.allow_invalid_lines:
        return (f"{what}: lines {line_list(refused)} ask for generation; {engine.placement.no_generation}; serve them "
                "with another layout, or pass --allow-invalid-lines to answer them 400")
    return None


def replica_notes(replicas: ReplicaPlan) -> list[str]:
    """Replica options a one-engine run does not use (kept, said as ignored)."""
    if replicas.replicas == 1 and not replicas.ray and replicas.devices_per_replica != 1:
        return [f"--devices-per-replica {replicas.devices_per_replica} is ignored: it sizes each engine replica, and "
                "--replicas 1 runs one engine in this process, on the devices its --layout takes"]
    return []


def set_saturation(engine: Engine, args: argparse.Namespace) -> None:
    """Θ of a placement that copies experts during a forward (its theta_mode): under --theta profile measured on the
    engine (Eq. 3) where its layer loop can be timed (profiles_theta: streamed, AsyncEP from the host); otherwise the
    one load made by Eq. 1 from the hardware profile (resident experts=async_ep: its all-gather), which needs a
    profile: without one --theta eq1 raises ValueError, and the default (profile) notes on stderr that no Θ
    applies."""
    if engine.placement.theta_mode is None:  # nothing copied during a forward: no Θ
        return
    if args.theta == "profile" and engine.placement.profiles_theta:
        profile_saturation(engine, tokens=min(512, args.max_batch_tokens or 512))
    elif engine.saturation is None:  # load found no profile: say why
        try:
            profile_for(jax.devices()[0].device_kind, len(jax.devices()), args.profile)
        except ValueError as e:
            if args.theta == "eq1":
                raise
            print(f"note: placement {engine.placement.name} under layout {engine.layout} takes Θ from Eq. 1, which "
                  f"needs a hardware profile: {e}; prefill batches follow the token budget alone", file=sys.stderr)


def run_settings(args: argparse.Namespace, engine: Engine) -> dict:
    """What decides this run's results (the journal records it; a resume must match): see settings_for."""
    return settings_for(args, engine_settings(engine),
                        engine.memory_budget.placement if engine.memory_budget is not None else None)


def settings_for(args: argparse.Namespace, base: dict, placement: str | None) -> dict:
    """The run's settings from an engine's (base: engine_settings; placement: its memory budget's): the model's
    identity (its files' names, sizes and config, not just the path), dtype, kernels, layers, layout, the
    placement, and under --speculative the options that decide which experts run (moejax.options' fingerprint
    marks; a directory by its identity). Replica settings are not in: none changes a result."""
    settings = {**base, "model": model_identity(args.model)}
    if placement is not None:
        settings["placement"] = placement
    if args.speculative:  # runs predicted experts: the predictor decides the results
        paths = options.paths(PlacementSettings)
        settings.update({name: model_identity(value) if name in paths and value else value
                         for name, value in options.settings(options.from_args(PlacementSettings, args),
                                                             fingerprint=True).items()})
    return settings


def model_identity(model: str) -> str:
    """A preset's name; for a directory, its real path (an embedded model: its name) and a hash of its JSON files
    and weight file sizes."""
    path = resolve_embedded(model)
    if not os.path.isdir(path):
        return model
    digest = hashlib.blake2b(digest_size=8)
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if name.endswith(".json"):
            with open(full, "rb") as f:
                digest.update(name.encode() + b"\0" + f.read())
        elif name.endswith((".safetensors", ".npz")):
            digest.update(f"{name}\0{os.path.getsize(full)}".encode())
    return f"{model if path != model else os.path.realpath(path)}@{digest.hexdigest()}"


def replica_engine(args: argparse.Namespace, serving: ServingOptions) -> Engine:
    """One engine replica's engine (a Ray actor calls it on its own devices): loaded as a one-engine run loads it,
    with its Θ."""
    engine = load(args, serving)
    set_saturation(engine, args)
    return engine
