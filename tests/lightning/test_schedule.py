"""CGOPipe's launch order (moejax.lightning.schedule) against Alg. 1 of MoE-Lightning worked out by hand, and its
data dependencies for many shapes; FlexGen's order (the §6.1 ablation's baseline) likewise."""
import itertools

import pytest

from moejax.lightning.schedule import (
    ATTN,
    LOAD,
    OFFLOAD,
    ORDERS,
    PAGE,
    POST,
    PRE,
    Task,
    cgopipe_order,
    flexgen_order,
)
from moejax.offload.settings import PIPELINE_SCHEDULES


def attention(i, j):
    return [Task(PRE, i, j), Task(OFFLOAD, i, j), Task(ATTN, i, j)]


def finish(i, j):
    return [Task(LOAD, i, j), Task(PAGE, i + 1, j), Task(POST, i, j)]


def test_two_layers_three_micro_batches_by_hand():
    # Alg. 1 with 0-based indices: the prologue launches micro-batches 0 and 1 of layer 0; then each micro-batch k
    # finishes (LOADH, W_PINTOG of the next layer's page k mod 3, POSTATTN) and launches k + 2, which past micro-batch
    # 2 is the next layer's: after (0,1) comes (1,0), after (0,2) comes (1,1), after (1,0) comes (1,2).
    want = (attention(0, 0) + attention(0, 1)
            + finish(0, 0) + attention(0, 2)
            + finish(0, 1) + attention(1, 0)
            + finish(0, 2) + attention(1, 1)
            + finish(1, 0) + attention(1, 2)
            + finish(1, 1)
            + finish(1, 2))
    assert cgopipe_order(2, 3) == want


def test_one_micro_batch_looks_one_ahead():
    # with one micro-batch, the next pre-attention is the next layer's, which needs this layer's POSTATTN first
    assert cgopipe_order(2, 1) == attention(0, 0) + finish(0, 0) + attention(1, 0) + finish(1, 0)


def test_flexgen_two_layers_two_micro_batches_by_hand():
    # FlexGen: per layer its pages, then each micro-batch's five tasks in a row; nothing launched ahead
    def serial(i, j):
        return attention(i, j) + [Task(LOAD, i, j), Task(POST, i, j)]
    want = ([Task(PAGE, 0, 0), Task(PAGE, 0, 1)] + serial(0, 0) + serial(0, 1)
            + [Task(PAGE, 1, 0), Task(PAGE, 1, 1)] + serial(1, 0) + serial(1, 1))
    assert flexgen_order(2, 2) == want
    assert flexgen_order(2, 2) != cgopipe_order(2, 2)


def test_the_option_names_every_order():
    assert tuple(ORDERS) == PIPELINE_SCHEDULES


@pytest.mark.parametrize("name", list(ORDERS))
@pytest.mark.parametrize("layers, micro_batches", list(itertools.product([1, 2, 5], [1, 2, 3, 7])))
def test_every_task_once_after_what_it_needs(name, layers, micro_batches):
    order = ORDERS[name](layers, micro_batches)
    at = {t: n for n, t in enumerate(order)}
    assert len(at) == len(order) == 6 * layers * micro_batches
    for i, j in itertools.product(range(layers), range(micro_batches)):
        assert at[Task(PRE, i, j)] < at[Task(OFFLOAD, i, j)] < at[Task(ATTN, i, j)] < at[Task(LOAD, i, j)] \
            < at[Task(POST, i, j)]
        if i:  # the layer's input is the previous layer's output for the same rows
            assert at[Task(POST, i - 1, j)] < at[Task(PRE, i, j)]
            assert at[Task(PAGE, i, j)] < at[Task(POST, i, 0)]  # every page of a layer before its FFN runs
    # the device runs micro-batches in order: post-attention of k before k + 1
    posts = [t for t in order if t.op == POST]
    assert posts == [Task(POST, i, j) for i in range(layers) for j in range(micro_batches)]
    if name == "flexgen":  # nothing ahead: each micro-batch's five tasks in a row, in micro-batch order
        work = [t for t in order if t.op != PAGE]
        assert [(t.layer, t.micro_batch) for t in work[::5]] == [(t.layer, t.micro_batch) for t in posts]
        assert all(len({(t.layer, t.micro_batch) for t in work[k:k + 5]}) == 1 for k in range(0, len(work), 5))


@pytest.mark.parametrize("name", list(ORDERS))
def test_bad_shape_is_refused(name):
    with pytest.raises(ValueError, match="layers and micro_batches must be >= 1, got 2, 0"):
        ORDERS[name](2, 0)
