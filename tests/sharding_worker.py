"""Run by tests/sharding/test_sharding.py in a process with 8 simulated CPU devices: every layout against the one-device
float32 model (logits, greedy tokens), also with every token routed to the same experts; at the expert level
against the single-device expert FFN with uneven token counts and all tokens routed to one expert; AsyncEP's
gathers in the compiled HLO; DEP's groups and dispatch order. Prints one JSON line of results."""
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from flax import nnx  # noqa: E402

import moejax  # noqa: E402
from moejax.kernels import expert_ffn  # noqa: E402
from moejax.offload import layered_steps  # noqa: E402
from moejax.sharding import Layout, make_mesh  # noqa: E402
from moejax.sharding.experts import sharded_routed, tp_columns  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
LAYOUTS = ["attn=dp,experts=replicated", "attn=dp,experts=ep", "attn=dp,experts=ep,exchange=gather",
           "attn=dp,experts=ep,devices=4", "attn=dp,experts=tp", "attn=dp,experts=async_ep",
           "attn=tp,experts=tp,devices=4", "attn=tp,experts=ep,devices=4",  # the fixtures have 4 heads
           "attn=dp,experts=dep", "attn=dp,experts=dep,attn_devices=2,expert_devices=4,r1=2,r2=3,order=aass",
           "attn=dp,experts=dep,attn_devices=6,expert_devices=2,r1=3,r2=2,exchange=gather"]
EXPERT_LAYOUTS = LAYOUTS[:6]
# Where skewed routing changes what moves: the exchanges that route tokens to expert owners (replicated, TP and
# AsyncEP experts see every token whatever the routing).
SKEW_LAYOUTS = [s for s in LAYOUTS if "experts=ep" in s or "experts=dep" in s]
PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]


def rel(out, ref) -> float:
    return float(np.max(np.abs(np.asarray(out) - np.asarray(ref))) / np.max(np.abs(np.asarray(ref))))


# Every layout on qwen3_moe; on the other families the layouts whose programs their blocks change: attention
# split by heads (MLA; sinks and windows), experts exchanged (shared experts; expert biases), AsyncEP and DEP.
FAMILY_LAYOUTS = {"qwen3_moe": LAYOUTS,
                  "deepseek_v2_lite": [LAYOUTS[1], LAYOUTS[5], LAYOUTS[6], LAYOUTS[8]],
                  "gpt_oss": [LAYOUTS[1], LAYOUTS[4], LAYOUTS[7], LAYOUTS[9]]}


def models(names):
    out = {}
    for name in names:
        path = os.path.join(FIXTURES, name)
        ids = np.random.default_rng(0).integers(0, 100, (3, 11))
        ref = moejax.load(path, dtype="float32")
        ref_logits, ref_tokens = ref.logits(ids), ref.generate(PROMPTS, 5)
        for spec in FAMILY_LAYOUTS[name]:
            engine = moejax.load(path, dtype="float32", layout=spec)
            out[f"{name} {spec}"] = dict(rel=rel(engine.logits(ids), ref_logits),
                                         same_tokens=engine.generate(PROMPTS, 5) == ref_tokens)
    return out


def zero_routers(engine):
    """Every router's logits 0: top-k breaks the ties by index, so every token goes to experts 0..k-1 (one EP
    device's)."""
    for path, var in nnx.to_flat_state(engine.params):
        if path[-1] == "router":
            var.set_value(var.get_value() * 0)
    return engine


def skewed(name):
    path = os.path.join(FIXTURES, name)
    ids = np.random.default_rng(2).integers(0, 100, (3, 11))
    ref = zero_routers(moejax.load(path, dtype="float32")).logits(ids)
    return {spec: rel(zero_routers(moejax.load(path, dtype="float32", layout=spec)).logits(ids), ref)
            for spec in SKEW_LAYOUTS}


def dep_groups(name):
    """Where DEP's parts live, the order its attention group's work was dispatched in, and its logits against one
    device, for each order (PPPipe sends micro-batches whole: r2=1)."""
    out = {}
    ids_in = np.random.default_rng(0).integers(0, 100, (4, 16))  # 16: a length bucket, no padding
    ref = moejax.load(os.path.join(FIXTURES, name), dtype="float32").logits(ids_in)
    for order in ("asas", "aass", "pppipe"):
        r2 = 1 if order == "pppipe" else 2
        spec = f"attn=dp,experts=dep,attn_devices=3,expert_devices=4,r1=2,r2={r2},order={order}"
        engine = moejax.load(os.path.join(FIXTURES, name), dtype="float32", layout=spec)
        logits = engine.logits(ids_in)
        ids = lambda arrays: sorted({d.id for a in jax.tree.leaves(arrays) for d in a.devices()})  # noqa: E731
        store = engine.store
        out[order] = dict(params=ids(engine.params), experts=ids([store.fetch(l) for l in store.layers]),
                          experts_per_device=sorted({s.data.shape[0] for l in store.layers
                                                     for s in store.fetch(l)["we_down"].addressable_shards}),
                          schedule=[list(e) for e in engine.layered_steps.schedule],
                          stats=engine.stats()["total"], rel=rel(logits, ref))
    return out


def planned(name):
    """layout="auto" and a DEP layout with auto fields, planned on the h100 datasheet profile for the 8 devices: the
    layouts chosen, the decisions, and their logits against one device."""
    path = os.path.join(FIXTURES, name)
    ids = np.random.default_rng(0).integers(0, 100, (8, 16))
    ref = moejax.load(path, dtype="float32").logits(ids)
    out = {}
    for spec in ("auto", "attn=dp,experts=dep,r1=auto,r2=auto,order=auto"):
        engine = moejax.load(path, dtype="float32", layout=spec, profile="h100", plan_tokens=128, plan_seq_len=16)
        out[spec] = dict(layout=str(engine.layout), decisions=engine.decisions, rel=rel(engine.logits(ids), ref))
    return out


def experts():
    rng = np.random.default_rng(1)
    N, D, I, E, k = 37, 16, 8, 16, 4  # 37 tokens: not a multiple of 8 devices
    x = jnp.asarray(rng.normal(size=(N, D)), jnp.float32)
    w = jnp.asarray(rng.random((N, k)), jnp.float32)
    ex = dict(we_gate_up=jnp.asarray(rng.normal(size=(E, D, 2 * I)) * 0.1, jnp.float32),
              we_down=jnp.asarray(rng.normal(size=(E, I, D)) * 0.1, jnp.float32),
              be_down=jnp.asarray(rng.normal(size=(E, D)), jnp.float32))

    def ffn(x, i, w, e):
        return expert_ffn(x, i, w, e["we_gate_up"], e["we_down"], None, e["be_down"], backend="xla")
    routings = {"random": np.argsort(rng.random((N, E)), axis=1)[:, :k],
                "skewed": np.tile(np.arange(k), (N, 1))}  # every token on experts 0..k-1: all on device 0
    out = {}
    for kind, idx in routings.items():
        idx = jnp.asarray(idx, jnp.int32)
        ref = ffn(x, idx, w, ex)
        for spec in EXPERT_LAYOUTS:
            layout = Layout.parse(spec).resolve(E, len(jax.devices()), expert_width=I)
            mesh = make_mesh(layout.devices)
            weights = ex if layout.experts != "tp" else \
                dict(ex, we_gate_up=tp_columns(ex["we_gate_up"], layout.devices))  # as moejax.load lays them out
            got = jax.jit(lambda x, i, w, e, layout=layout, mesh=mesh: sharded_routed(layout, mesh, ffn, x, i, w, e))(
                x, idx, w, weights)
            out[f"{kind} {spec}"] = rel(got, ref)
    return out


def async_ep_gathers(name):
    """AsyncEP: the operands of the all-gathers that bring each layer's experts together, in the compiled step.
    They must be parameters: then no gather waits on any layer's compute, and XLA may start it early."""
    engine = moejax.load(os.path.join(FIXTURES, name), dtype="float32", layout="attn=dp,experts=async_ep")
    text = engine.steps.logits.lower(engine.params, jnp.zeros((8, 16), jnp.int32)).compile().as_text()
    operands = []
    for line in text.splitlines():
        if " all-gather(" in line and "shard_map" in line:
            operands.append(line.split(" all-gather(", 1)[1].split(")", 1)[0])
    first = engine.config.moe_layers.index(True)
    whole = {i: engine.params["layers"][i]["mlp"]["we_down"].sharding.is_fully_replicated
             for i, moe in enumerate(engine.config.moe_layers) if moe}
    return dict(operands=operands, moe_layers=sum(engine.config.moe_layers), first=first, whole=whole)


def collective_kinds(name):
    """The collectives in each layout's compiled full-logits step, by kind."""
    import re
    out = {}
    for spec in ("attn=dp,experts=replicated", "attn=dp,experts=ep", "attn=dp,experts=ep,exchange=gather",
                 "attn=dp,experts=tp"):
        engine = moejax.load(os.path.join(FIXTURES, name), dtype="float32", layout=spec)
        text = engine.steps.logits.lower(engine.params, jnp.zeros((8, 16), jnp.int32)).compile().as_text()
        kinds = re.findall(r" (all-to-all|all-gather|reduce-scatter|all-reduce|collective-permute)\(", text)
        out[spec] = sorted(set(kinds))
    return out


def two_channel(name):
    """AsyncEP streamed from pinned host memory: the one-device results, the host -> device bytes, and the
    compiled MoE-layer program whose all-gathers (the next layer's experts) read only its inputs."""
    from moejax.measure.saturation import profile_saturation
    path = os.path.join(FIXTURES, name)
    ids = np.random.default_rng(0).integers(0, 100, (8, 11))  # a row per device: no activation moves between them
    ref = moejax.load(path, dtype="float32")
    engine = moejax.load(path, dtype="float32", layout="attn=dp,experts=async_ep", placement="streamed", window=1)
    placement = engine.layered_steps.placement
    captured = {}
    call = layered_steps.Layer.__call__

    def capture(self, fn, *args, **static):  # the arguments of one MoE layer's program, to compile it below
        if fn is placement._step:
            captured.setdefault("call", (self, args, static))
        return call(self, fn, *args, **static)
    layered_steps.Layer.__call__ = capture
    try:
        logits = engine.logits(ids)
    finally:
        layered_steps.Layer.__call__ = call
    stats = engine.stats()["total"]
    layer, args, static = captured["call"]
    text = layer._mine[placement._step].lower(layer.state, *args, **static).compile().as_text()
    operands = [line.split(" all-gather(", 1)[1].split(")", 1)[0]
                for line in text.splitlines() if " all-gather(" in line]
    # launch.serve profiles Θ for this placement too (it once reached for a Streamed-only attribute)
    theta = profile_saturation(engine, tokens=16)
    return dict(rel=rel(logits, ref.logits(ids)), theta_flops=theta.theta_flops, theta_layers=sorted(theta.streamed_s),
                rel_after_profile=rel(engine.logits(ids), ref.logits(ids)),
                same_tokens=engine.generate(PROMPTS, 5) == ref.generate(PROMPTS, 5),
                bytes_h2d=stats["bytes_h2d"], misses=stats["misses"],
                layer_bytes=engine.store.layer_bytes(engine.store.layers[0]), moe_layers=len(engine.store.layers),
                operands=operands,
                arrays=len(engine.store.arrays(engine.store.layers[0])))


def padded_rows():
    """Batches are padded to a multiple of the devices that split rows: the padded shape each step ran with, and
    for DP+EP the collectives outside the expert program at that shape (an uneven split had XLA reshard and
    all-reduce around every norm)."""
    from moejax.sharding import hlo_comm
    out = {}
    for spec in ("attn=dp,experts=ep", "attn=dp,experts=replicated,devices=6", "attn=tp,experts=tp,devices=4",
                 "attn=dp,experts=dep,attn_devices=2,expert_devices=4,r1=2"):
        engine = moejax.load(os.path.join(FIXTURES, "qwen3_moe"), dtype="float32", layout=spec)
        shapes, step = [], engine.steps.logits
        engine.steps.logits = lambda params, ids, shapes=shapes, step=step: (shapes.append(ids.shape)
                                                                           or step(params, ids))
        engine.logits(np.ones((3, 5), np.int32))
        out[spec] = dict(rows=shapes[0][0], multiple=engine.row_multiple)
        if not engine.layer_by_layer:
            text = step.lower(engine.params, jnp.zeros(shapes[0], jnp.int32)).compile().as_text()
            out[spec]["outside"] = hlo_comm.bytes_by_kind(hlo_comm.collectives(text), in_shard_map=False)
    return out


PARTS = {"models": lambda name: models([name]), "experts": lambda: experts(),
         "async_ep": lambda: async_ep_gathers("qwen3_moe"), "collectives": lambda: collective_kinds("qwen3_moe"),
         "skewed": lambda: skewed("qwen3_moe"), "dep": lambda: dep_groups("deepseek_v2_lite"),
         "planned": lambda: planned("deepseek_v2_lite"),
         "two_channel": lambda name: {name: two_channel(name)}, "padded_rows": padded_rows}

if __name__ == "__main__":  # arguments: parts to run, "models:NAME" for one family's layouts
    assert len(jax.devices()) == 8, jax.devices()
    out: dict = {}
    for part in sys.argv[1:]:
        name, _, arg = part.partition(":")
        result = PARTS[name](*([arg] if arg else []))
        out[name] = {**out.get(name, {}), **result} if name in ("models", "two_channel") else result
    print(json.dumps(out))
