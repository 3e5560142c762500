"""moejax.load: a checkpoint directory or a preset name -> Engine."""
from __future__ import annotations

import dataclasses
import os
import zlib

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.chat import ChatTemplate
from moejax.config import ModelConfig
from moejax.engine import Engine
from moejax.kernels.backends import Kernels
from moejax.models.checkpoint import load_tokenizer, plan_params, read_config, read_generation_eos
from moejax.models.decoder import MoEModel
from moejax.offload.host_store import HostStore, is_routed_expert
from moejax.offload.memory_plan import MemoryPlanError, device_budget_bytes
from moejax.models.moe import MoEBlock
from moejax.offload.setup import offload_plan, placement_factory, streams_in_jit
from moejax.plan.engine_plan import PLAN_OPTIONS, EnginePlan
from moejax.plan.auto import PLACEMENT_WHAT_IF, plan_layout, what_would_change
from moejax.plan.placement import choose_placement
from moejax.plan.resolve import profile_for
from moejax.presets import EMBEDDED, PRESETS, preset_config, resolve_embedded
from moejax.sharding.setup import layout_of

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
OPTIONS = ("num_layers", "seed", "kernels", "compilation_cache") + PLAN_OPTIONS


def presets() -> list[str]:
    """Names `load` accepts besides directories: the embedded trained models, then the random-weight presets."""
    return list(EMBEDDED) + list(PRESETS)


def enable_compilation_cache(path: str | None = None) -> str:
    """Turn on JAX's persistent compilation cache (default: the user cache dir) unless already set."""
    current = jax.config.jax_compilation_cache_dir
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


def load(model: str, *, dtype: str = "auto", plan: EnginePlan | None = None, **options) -> Engine:
    """Load `model` (a HF checkpoint directory or a preset name; see `presets()`). dtype: "auto" (the
    checkpoint's own, bfloat16 for presets), "float32", "bfloat16" or "float16".

    options: num_layers (run the first N layers only), seed (preset weights), kernels (backends of the expert FFN
    and attention: "auto", one name for both such as "xla" or "pallas", or per op, e.g.
    "experts=ragged_dot,attention=reference"; see moejax.kernels), compilation_cache (True, False or a directory).

    Expert offloading (moejax.offload; one device): placement ("auto": resident when the model fits the budget,
    else streamed, else cached; "resident", "streamed", "cached"), device_memory_gb (cap on what moejax uses on the
    device; default: the device's memory, no cap on CPU), window (streamed: MoE layers copied ahead), stream
    (streamed: "python", a loop over per-layer jits that copies `window` layers ahead, or "jit": the experts are
    host-memory inputs of the whole-model jit and XLA schedules their copies),
    cache_slots, eviction ("lru", "lfu", "priority"), predictor ("router", "estimator", "hybrid",
    "expert_map", "previous_hidden", "oracle" or a predictor object), maps (directory written by
    `launch.calibrate --maps`, for "expert_map"), default_vectors (directory written by DefaultVectors.save,
    for the router predictor), estimator (directory written by `launch.distill`, for "estimator" and "hybrid"),
    prefetch_distance (MoE layers ahead; an estimator's distance is the one it was distilled for),
    speculative (run predicted experts instead of loading true-router misses), router_free (speculative: the
    predictor builds on the predicted routing of the layers it ran, Speculating Experts §6.4).

    layout: how the model spreads over devices, e.g. "attn=dp,experts=ep" (see moejax.sharding.layout); "auto" (the
    fastest layout on the devices present, moejax.plan.layouts), or a DEP layout with fields left to FinDEP's solver,
    e.g. "attn=dp,experts=dep,r1=auto,r2=auto,order=auto". profile: the hardware profile `auto` choices consult (a
    datasheet name such as "h100", or a JSON file from `launch.profile_devices`; default: the one measured for these
    devices, else their datasheet); plan_tokens / plan_seq_len: the step those choices are made for (8192 tokens
    in sequences of 1024).

    plan: the same settings as one moejax.plan.engine_plan.EnginePlan (then none of the keywords above)."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"moejax.load: unknown option(s) {unknown}; known: {', '.join(OPTIONS)}")
    if plan is not None and set(options) & set(PLAN_OPTIONS):
        raise TypeError(f"moejax.load: give plan= or the options {sorted(set(options) & set(PLAN_OPTIONS))}, not both")
    engine_plan = plan or EnginePlan.from_options({k: options.get(k) for k in PLAN_OPTIONS})
    settings = engine_plan.placement
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"moejax.load: dtype {dtype!r} is not one of auto, {', '.join(DTYPES)}")
    try:
        kernels = Kernels.parse(options.get("kernels"))
    except ValueError as e:
        raise ValueError(f"moejax.load: {e}") from None
    unavailable = kernels.unavailable()
    if unavailable:
        raise ValueError(f"moejax.load: kernels {unavailable}")
    # auto stays per call: attention's and the experts' choices depend on shapes (and, for the experts on a GPU,
    # on the tuning table's measurements)
    cache_opt = options.get("compilation_cache", True)
    if cache_opt:
        enable_compilation_cache(cache_opt if isinstance(cache_opt, str) else None)

    name, model = model, resolve_embedded(model)
    is_dir = os.path.isdir(model)
    if not is_dir and model not in PRESETS:
        missing = f" (its files are missing from {os.path.dirname(__file__)}/assets)" if model in EMBEDDED else ""
        raise ValueError(f"moejax.load: {model!r} is neither a checkpoint directory nor a preset{missing} "
                         f"(presets: {', '.join(presets())})")
    hf_config = read_config(model) if is_dir else preset_config(model)
    if dtype == "auto":
        dtype = checkpoint_dtype(hf_config, model)
    cfg = ModelConfig.from_hf(hf_config)
    # Generation stops at generation_config.json's end-of-sequence ids when it names any, else at config.json's:
    # what transformers' generate does.
    generation_eos = read_generation_eos(model) if is_dir else ()
    if generation_eos:
        cfg = cfg.replace(eos_token_ids=generation_eos)
    full_layers = cfg.num_layers
    n = options.get("num_layers")
    if n is not None:
        if not 1 <= int(n) <= cfg.num_layers:
            raise ValueError(f"moejax.load: num_layers={n} outside 1..{cfg.num_layers}")
        cfg = cfg.replace(num_layers=int(n))
    dt = DTYPES[dtype]
    abstract = nnx.eval_shape(lambda: MoEModel(cfg, dt))
    flat = {path: var for path, var in nnx.to_flat_state(nnx.state(abstract))}
    shapes = {path: var.get_value() for path, var in flat.items()}
    engine_plan, decisions = plan_choices(cfg, engine_plan)
    plan = offload_plan(cfg, shapes, settings, with_layout=engine_plan.layout is not None)
    if settings.placement == "auto" and plan.placement != "resident" and engine_plan.layout is None:
        plan, text = choose_offload(cfg, shapes, settings, plan, engine_plan)
        decisions.append(text)
    in_jit = streams_in_jit(plan, settings)
    for layer in abstract.layers if in_jit else ():  # a static flag: part of the graphdef the jits see
        if isinstance(layer.mlp, MoEBlock):
            layer.mlp.host_experts = True
    layout = layout_of(engine_plan.layout, cfg, plan, in_jit)
    if layout and plan.placement == "resident":
        try:
            plan = layout.plan_memory(plan, shapes, device_budget_bytes(settings.device_memory_gb))
        except MemoryPlanError as e:
            raise ValueError(f"moejax.load: {e}") from None
    if layout:
        abstract.split_batch = layout.split_batch
    for layer in abstract.layers if layout and not layout.disaggregated else ():
        if isinstance(layer.mlp, MoEBlock):
            layer.mlp.run_experts = layout.run_experts
    graphdef, abstract_state = nnx.split(abstract)

    def fill(values):
        for path, var in flat.items():
            var.set_value(values[path])
        return nnx.from_flat_state(list(flat.items()))

    offloaded = plan.placement != "resident"
    disaggregated = layout is not None and layout.disaggregated

    def place(path, array):
        """Checkpoint or preset tensor -> device array; routed experts of an offloaded model go to the store, of a
        DEP model to its expert group."""
        if disaggregated and is_routed_expert(path):
            return store.add(path, array)  # (a stand-in on the attention group)
        if offloaded and is_routed_expert(path):
            placed = store.add(path, array)  # in_jit: the jits take the host arrays; else the placement moves them
            return placed if in_jit else jnp.zeros((), array.dtype)  # (a stand-in)
        return layout.place(path, array) if layout else jax.device_put(array)

    def with_store(build):
        def materialize():
            nonlocal store
            store = HostStore(per_expert=plan.placement == "cached",
                              sharding=layout.expert_shards if layout else None) if offloaded else \
                layout.expert_group() if disaggregated else None
            state = build()
            return (state, store) if store is not None else state
        return materialize

    store = None
    if is_dir:
        skips_layers = cfg.num_layers < full_layers or cfg.extra_layers > 0
        read = plan_params(model, cfg, shapes, ignore_layers_from=cfg.num_layers if skips_layers else None)
        materialize = with_store(lambda: fill(read(place)))
        tokenizer = load_tokenizer(model)
        chat = ChatTemplate.from_dir(model) if tokenizer is not None else None
    else:
        seed = int(options.get("seed", 0))
        materialize = with_store(lambda: fill({p: place(p, random_param(p, s, seed)) for p, s in shapes.items()}))
        tokenizer, chat = None, None
    engine = Engine(cfg, graphdef, abstract_state, materialize, tokenizer, dtype=dt, kernels=kernels, name=name,
                    chat_template=chat,
                    memory_plan=plan, layout=layout.layout if layout else None,
                    make_placement=layout.make_placement(cfg, kernels, plan) if layout and (disaggregated or offloaded)
                    else placement_factory(plan, settings, kernels) if offloaded and not in_jit else None)
    engine.plan, engine.decisions = engine_plan, decisions
    return engine


def _profile(plan: EnginePlan):
    devices = jax.devices()
    try:
        return profile_for(devices[0].device_kind, len(devices), plan.profile)
    except ValueError as e:
        raise ValueError(f"moejax.load: {e}") from None


def plan_choices(cfg: ModelConfig, plan: EnginePlan) -> tuple[EnginePlan, list[str]]:
    """Layout choices left to the planners (layout auto, DEP fields auto) made: -> (concrete plan, decisions)."""
    if not plan.needs_planner:
        return plan, []
    plan, text = plan_layout(cfg, plan, _profile(plan), len(jax.devices()))
    return plan, [text]


def choose_offload(cfg: ModelConfig, shapes: dict, settings, memory_plan, plan: EnginePlan):
    """placement auto, the experts not fitting: streamed or cached, whichever the profile predicts faster when both
    fit (bytes decide when only one does, or when no profile is known) -> (memory plan, decision)."""
    feasible = [memory_plan]
    other = "cached" if memory_plan.placement == "streamed" else "streamed"
    try:
        feasible.append(offload_plan(cfg, shapes, dataclasses.replace(settings, placement=other)))
    except ValueError as e:
        return memory_plan, f"placement auto: {memory_plan.placement} (bytes decide: {other} does not fit: {e})"
    try:
        profile = _profile(plan)
    except ValueError as e:
        return memory_plan, f"placement auto: {memory_plan.placement} by bytes alone ({e})"
    chosen, text = choose_placement(cfg, profile, feasible, plan.workload.tokens)
    changes = what_would_change(lambda p: choose_placement(cfg, p, feasible, plan.workload.tokens)[0].placement,
                                profile, chosen.placement, PLACEMENT_WHAT_IF)
    text += "\n  what would change it: " + "; ".join(changes)
    return dataclasses.replace(chosen, reason=chosen.reason + "; " + text.splitlines()[0]), text


def random_param(path: tuple, abstract, seed: int):
    """Deterministic per-tensor random init on the default device (norm weights 1, biases 0)."""
    name = str(path[-1]) if path[-1] != "weight" else str(path[-2])
    shape, dtype = tuple(abstract.shape), abstract.dtype
    if path[-1] == "weight":  # RMSNorm scales
        return jnp.ones(shape, dtype)
    if name.startswith("b") or name in ("sinks", "router_bias", "correction_bias"):
        return jnp.zeros(shape, dtype)
    key = jax.random.fold_in(jax.random.key(seed), zlib.crc32("/".join(map(str, path)).encode()))
    return _normal(key, shape, dtype)


@jax.jit
def _normal_impl(key, proto):
    return (0.02 * jax.random.normal(key, proto.shape, jnp.float32)).astype(proto.dtype)


def _normal(key, shape, dtype):
    return _normal_impl(key, jax.ShapeDtypeStruct(shape, dtype))
