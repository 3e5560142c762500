"""The rows a jitted step works on, as small frozen dataclass pytrees: a step takes its rows as one argument (after
the weights and the buffers it donates), so adding an input touches the step that reads it and the code that builds
it, not every signature between them. What shapes a program (cache_len, steps, fresh) stays a static keyword of the
step. Arrays may be numpy: the jitted call copies them to the device with the rest of the pytree."""
from __future__ import annotations

import dataclasses

import jax

from moejax.sampling import Sampling, StepArray

pytree = jax.tree_util.register_dataclass


@pytree
@dataclasses.dataclass(frozen=True)
class PrefillRows:
    """moejax.steps.phases.prefill: right-padded prompt rows. tokens, positions [B, T]: each row's prompt from its first
    uncached position; last [B]: the index of its last prompt token. Optional (None: absent): prior_ids [B, NP], pool
    blocks holding positions [0, NP*BLOCK) of each row (a row whose prompt starts later has them all); store_ids
    [B, NS] and store_src [B, NS, BLOCK], prompt blocks to copy into the pool (src = slots); expand [B2], the prefill
    row each decode row continues (several choices of one prompt share its prefill): `sampling` is then per decode
    row. requests [B] bool: which rows are requests, not the batch's padding (None: all; only the layer loop's
    predictors read it)."""
    tokens: StepArray
    positions: StepArray
    last: StepArray
    sampling: Sampling
    prior_ids: StepArray | None = None
    store_ids: StepArray | None = None
    store_src: StepArray | None = None
    expand: StepArray | None = None
    requests: StepArray | None = None


@pytree
@dataclasses.dataclass(frozen=True)
class DecodeRows:
    """moejax.steps.phases.decode: first [B], each row's first new token (the prefill's); lengths [B], its prompt's
    length; stops [B, S], its stop tokens (-1 pads); max_new [B], the most new tokens it makes, the first included."""
    first: StepArray
    lengths: StepArray
    stops: StepArray
    max_new: StepArray
    sampling: Sampling


@pytree
@dataclasses.dataclass(frozen=True)
class ChunkRows:
    """moejax.steps.paged_phases.chunk: a prompt chunk per row. tokens [B, T]: row b's tokens at positions start[b]..
    (its first n[b] are real; n = 0: an idle row); table [B, W]: its block table; slot [B]: the carry slot that takes
    the token sampled after its last real token (out of the carry's range: none is kept)."""
    tokens: StepArray
    start: StepArray
    n: StepArray
    table: StepArray
    slot: StepArray
    sampling: Sampling


@pytree
@dataclasses.dataclass(frozen=True)
class PagedDecodeRows:
    """moejax.steps.paged_phases.decode: new tokens per row from position start[b]. last [B]: the row's input token, or,
    where chain[b], carry[slot[b]] (made by a step the host has not read); budget [B]: the most tokens it makes;
    table [B, W]: its block table; stops [B, S]: its stop tokens (-1 pads); slot [B]: its carry slot."""
    last: StepArray
    chain: StepArray
    start: StepArray
    budget: StepArray
    table: StepArray
    slot: StepArray
    stops: StepArray
    sampling: Sampling
