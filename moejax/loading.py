"""moejax.load: a checkpoint directory or a preset name -> Engine."""
from __future__ import annotations

import dataclasses
import os
import sys
import warnings

import jax
import jax.numpy as jnp
from flax import nnx
from tokenizers import Tokenizer

from moejax import options
from moejax.chat import ChatTemplate
from moejax.config import ModelConfig
from moejax.engine import Engine
from moejax.kernels import invariant
from moejax.kernels.backends import Kernels
from moejax.measure.quick_profile import measure_quick_profile
from moejax.models.checkpoint import load_tokenizer, read_config, read_generation_eos
from moejax.models.decoder import MoEModel
from moejax.offload.memory_budget import MemoryBudgetError, device_budget_bytes
from moejax.offload.settings import PlacementSettings
from moejax.placements import placement_for
from moejax.placements.budget import budget_at_load
from moejax.plan.auto import plan_layout
from moejax.plan.engine_plan import PLAN_OPTIONS, EnginePlan
from moejax.plan.hardware import Profile
from moejax.plan.resolve import NoProfile, profile_for
from moejax.presets import EMBEDDED, PRESETS, preset_config, resolve_embedded
from moejax.sharding.setup import layout_of
from moejax.weights import materializer

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
OPTIONS = ("num_layers", "seed", "kernels", "batch_invariant", "compilation_cache") + PLAN_OPTIONS


def presets() -> list[str]:
    """Names `load` accepts besides directories: the embedded trained models, then the random-weight presets."""
    return list(EMBEDDED) + list(PRESETS)


def enable_compilation_cache(path: str | None = None) -> str:
    """Turn on JAX's persistent compilation cache (default: the user cache dir) unless already set."""
    current = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]  # jax's Config types no options
    if current:
        return current
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = path or os.path.join(base, "moejax", "jax-compile")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return path


def checkpoint_dtype(config: dict, where: str) -> str:
    """What dtype="auto" means: the checkpoint's own `dtype` (`torch_dtype` in older configs), as vLLM and
    transformers read it; bfloat16 when the config names none (the presets)."""
    named = config.get("dtype", config.get("torch_dtype"))
    if named is None:
        return "bfloat16"
    if named not in DTYPES:
        raise ValueError(f"moejax.load: {where} config.json has dtype {named!r}, not one of {', '.join(DTYPES)}; "
                         "pass dtype= explicitly")
    return named


def ignored_options(settings: PlacementSettings, chosen: str) -> str | None:
    """Options given for a placement `auto` did not choose, said as ignored (kept: on another machine auto may
    choose that placement; under an explicit placement they are refused), or None."""
    unused = options.not_applying(settings, "placement", chosen)
    if not unused:
        return None
    names = ", ".join(f"{f.name} ({options.flag_of(f)})" for f, _ in unused)
    wanted = sorted({str(v) for _, v in unused})
    return (f"ignored: {names} apply to placement {' or '.join(wanted)}, and placement auto chose {chosen} (for this "
            "model on this device; give the placement to have them used, or refused)")


def load(model: str, plan: EnginePlan | None = None, *, dtype: str = "auto", num_layers: int | None = None,
         seed: int = 0, kernels: str | None = None, batch_invariant: bool = False,
         compilation_cache: bool | str = True, **plan_options: object) -> Engine:
    """Load `model` (a HF checkpoint directory or a preset name; see `presets()`) as an Engine that is complete:
    its placement, plan, planners' decisions and Θ are made here.

    plan: where the experts live (placement and its settings, moejax.offload.settings.PlacementSettings), how the
    model spreads over devices (layout, moejax.layout), the hardware profile `auto` choices consult and the
    workload they are made for: one moejax.plan.engine_plan.EnginePlan, whose fields document each setting. Its
    fields may instead be given as keywords (placement="cached", cache_slots=32, layout="attn=dp,experts=ep",
    profile="h100", plan_tokens=8192, ...): a convenience that builds the same EnginePlan.
    dtype: "auto" (the checkpoint's own, bfloat16 for presets), "float32", "bfloat16" or "float16"; num_layers: run
    the first N layers only; seed: the presets' weights; kernels: backends of the expert FFN and attention ("auto",
    one name for both such as "xla" or "pallas", or per op, e.g. "experts=ragged_dot,attention=reference"; see
    moejax.kernels); batch_invariant: each request's results bit-identical whatever it is batched with (fixed-shape
    kernels, moejax.kernels.invariant; one device's whole-model steps); compilation_cache: True, False or a
    directory."""
    engine_plan = _plan_of(plan, plan_options)
    if not isinstance(batch_invariant, bool):
        raise ValueError(f"moejax.load: batch_invariant must be True or False, got {batch_invariant!r}")
    kernel_choice = _kernels(kernels, batch_invariant)
    if compilation_cache:
        enable_compilation_cache(compilation_cache if isinstance(compilation_cache, str) else None)
    name, path = model, resolve_embedded(model)
    hf_config = _hf_config(path)
    is_dir = os.path.isdir(path)
    dtype = _dtype(dtype, hf_config, path)
    cfg, full_layers = _model_config(hf_config, path if is_dir else None, num_layers)
    dt = DTYPES[dtype]
    shapes = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(nnx.eval_shape(lambda: MoEModel(cfg, dt))))}
    _profile_notes.clear()
    engine_plan, decisions = plan_choices(cfg, engine_plan)
    settings = engine_plan.placement
    memory_budget, chosen = budget_at_load(cfg, shapes, engine_plan, dt, lambda measure=False: _profile(
        engine_plan, measure=measure))
    decisions += chosen
    layout = layout_of(engine_plan.layout, cfg)
    if layout and not memory_budget.offloads:
        try:
            memory_budget = layout.budget_memory(memory_budget, shapes, device_budget_bytes(settings.device_memory_gb))
        except MemoryBudgetError as e:
            raise ValueError(f"moejax.load: {e}") from None
    placement = placement_for(memory_budget, settings, layout)
    if batch_invariant:
        why = invariant.unsupported(cfg, layout)
        if why is None and not placement.runs_batch_invariant:
            why = f"covers placement resident (the whole model in one device's jits); got placement {placement.name}"
        if why:
            raise ValueError(f"moejax.load: batch_invariant {why}")
    if settings.auto:
        ignored = ignored_options(settings, memory_budget.placement)
        if ignored:
            decisions.append(ignored)
            print(f"note: {ignored}", file=sys.stderr)
    abstract = nnx.eval_shape(lambda: MoEModel(cfg, dt, placement.experts_runner(), placement.split_batch(),
                                               stacked=placement.stacks_layers and jax.process_count() == 1))
    skips_layers = cfg.num_layers < full_layers or cfg.extra_layers > 0
    materialize = materializer(abstract, shapes, placement, checkpoint=path if is_dir else None, seed=int(seed),
                               ignore_layers_from=cfg.num_layers if skips_layers else None)
    tokenizer, chat = _text_side(path)
    placement.at_load(cfg, lambda: _profile(engine_plan, measure=True))
    saturation = placement.theta(cfg, lambda: _profile(engine_plan))
    decisions[:0] = _profile_notes  # a profile measured for the choices above: before them
    graphdef, abstract_state = nnx.split(abstract)
    return Engine(cfg, graphdef, abstract_state, materialize, tokenizer, placement=placement, dtype=dt,
                  kernels=kernel_choice, name=name, chat_template=chat, plan=engine_plan, decisions=decisions,
                  saturation=saturation)


def read_model(model: str, num_layers: int | None = None) -> tuple[ModelConfig, Tokenizer | None, ChatTemplate | None]:
    """What parsing requests for `model` needs, without its weights or any device: its config (first `num_layers`
    layers), tokenizer and chat template (None for presets). A frontend routing to engine replicas uses it."""
    path = resolve_embedded(model)
    cfg, _ = _model_config(_hf_config(path), path if os.path.isdir(path) else None, num_layers)
    return (cfg, *_text_side(path))


def _hf_config(path: str) -> dict:
    if os.path.isdir(path):
        return read_config(path)
    if path not in PRESETS:
        missing = f" (its files are missing from {os.path.dirname(__file__)}/assets)" if path in EMBEDDED else ""
        raise ValueError(f"moejax.load: {path!r} is neither a checkpoint directory nor a preset{missing} "
                         f"(presets: {', '.join(presets())})")
    return preset_config(path)


def _text_side(path: str) -> tuple[Tokenizer | None, ChatTemplate | None]:
    tokenizer = load_tokenizer(path) if os.path.isdir(path) else None
    return tokenizer, ChatTemplate.from_dir(path) if tokenizer is not None else None


def _renamed(given: dict) -> dict:
    """load's keywords with the placement settings' old names (options.renamed) under their new ones, warning."""
    out = dict(given)
    for old, new in options.renamed(PlacementSettings).items():
        if old in out:
            if new in out:
                raise TypeError(f"moejax.load: give {new}, not both it and {old} (its old name)")
            warnings.warn(options.renamed_note(old, new), FutureWarning, stacklevel=4)
            out[new] = out.pop(old)
    return out


def _plan_of(plan: EnginePlan | None, options: dict) -> EnginePlan:
    """load's plan, given whole or as keywords (not both)."""
    options = _renamed(options)
    unknown = sorted(set(options) - set(PLAN_OPTIONS))
    if unknown:
        raise TypeError(f"moejax.load: unknown option(s) {unknown}; known: {', '.join(OPTIONS)}")
    if plan is not None and options:
        raise TypeError(f"moejax.load: give plan= or the options {sorted(options)}, not both")
    return plan or EnginePlan.from_options({k: options.get(k) for k in PLAN_OPTIONS})


def _kernels(spec: str | None, batch_invariant: bool = False) -> Kernels:
    """The kernels option checked; `auto` stays per call (attention's and the experts' choices depend on shapes and,
    for the experts on a GPU, on the tuning table's measurements)."""
    try:
        kernels = dataclasses.replace(Kernels.parse(spec), invariant=batch_invariant)
    except ValueError as e:
        raise ValueError(f"moejax.load: {e}") from None
    unavailable = kernels.unavailable()
    if unavailable:
        raise ValueError(f"moejax.load: kernels {unavailable}")
    return kernels


def _dtype(dtype: str, hf_config: dict, where: str) -> str:
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"moejax.load: dtype {dtype!r} is not one of auto, {', '.join(DTYPES)}")
    return checkpoint_dtype(hf_config, where) if dtype == "auto" else dtype


def _model_config(hf_config: dict, checkpoint: str | None, num_layers: int | None) -> tuple[ModelConfig, int]:
    """-> (the config to run, the checkpoint's full layer count). Generation stops at generation_config.json's
    end-of-sequence ids when it names any, else at config.json's: what transformers' generate does."""
    cfg = ModelConfig.from_hf(hf_config)
    generation_eos = read_generation_eos(checkpoint) if checkpoint is not None else ()
    if generation_eos:
        cfg = cfg.replace(eos_token_ids=generation_eos)
    full_layers = cfg.num_layers
    if num_layers is not None:
        if not 1 <= int(num_layers) <= cfg.num_layers:
            raise ValueError(f"moejax.load: num_layers={num_layers} outside 1..{cfg.num_layers}")
        cfg = cfg.replace(num_layers=int(num_layers))
    return cfg, full_layers


_profile_notes: list[str] = []  # what _profile measured during the current load (load puts it in the decisions)


def _profile(plan: EnginePlan, *, measure: bool = False) -> Profile:
    """The hardware profile `auto` choices consult. None for these devices (no measured file, no datasheet) and none
    asked for: with `measure` (a choice that cannot be made without one: the layout planner, DEP's auto fields and
    online solver, lightning's policy search) a quick one measured now and cached (moejax.measure.quick_profile), which
    says so; else ValueError (the choices with a fallback: bytes decide, no Θ)."""
    devices = jax.devices()
    try:
        return profile_for(devices[0].device_kind, len(devices), plan.profile)
    except NoProfile as e:
        if not measure or jax.process_count() > 1:  # several processes would each measure, and differently
            raise ValueError(f"moejax.load: {e}") from None
        profile, note = measure_quick_profile(devices[0].device_kind)
        print(f"note: {note}", file=sys.stderr)
        _profile_notes.append(note)
        return dataclasses.replace(profile, gpus=len(devices))
    except ValueError as e:
        raise ValueError(f"moejax.load: {e}") from None


def plan_choices(cfg: ModelConfig, plan: EnginePlan) -> tuple[EnginePlan, list[str]]:
    """Layout choices left to the planners (layout auto, DEP fields auto) made: -> (concrete plan, decisions)."""
    if not plan.needs_planner:
        return plan, []
    plan, text = plan_layout(cfg, plan, _profile(plan, measure=True), len(jax.devices()))
    return plan, [text]
