"""The Engine's steps: the Steps protocol every way of running a forward implements (protocol), the phases each step
is made of (phases: static batching and scoring; paged_phases: continuous batching), the rows a step takes (rows),
the decode loops' token loop (token_loop) and the whole-model implementation (whole_model). The layer-by-layer,
pipeline-layout and MoE-Lightning implementations sit with the placements that use them (moejax.offload.layered_steps,
moejax.sharding.pipeline_steps, moejax.lightning.cgopipe_steps)."""
from moejax.steps.protocol import Pool, Span, Steps

__all__ = ["Pool", "Span", "Steps"]
