"""fMoE Fig. 12a's "Hit count" (moejax.offload.predict.hit_counts): request-level expert hit counts, matched by
cosine and predicting the matched request's most used experts, against a plain per-token reference."""
import numpy as np

from moejax.offload.predict.hit_counts import replay_hit_counts, request_counts, top_k_hits
from moejax.offload.predict.traces import Traces

M, E, K = 4, 8, 2


def traces_of(logits: np.ndarray, lengths: list[int]) -> Traces:
    N = len(logits)
    return Traces(np.zeros((N, M, 1), np.float32), logits.astype(np.float32), np.zeros(N, np.int32),
                  np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64), [1, 2, 4, 5])


def reference(stored: np.ndarray, traces: Traces, distance: int) -> dict:
    """Token by token, layer by layer: the request's counts so far, cosine against each stored matrix, the best one's
    k most used experts at the target layer -> {(token, target layer index): sorted ids}."""
    hits = top_k_hits(traces.router_logits, K)
    out = {}
    for r in range(traces.num_prompts):
        a, b = int(traces.starts[r]), int(traces.starts[r + 1])
        for n in range(a, b):
            earlier = hits[a:n].sum(axis=0)
            for j in range(-1, M - distance):
                observed = earlier.copy()
                observed[:j + 1] += hits[n, :j + 1]
                if not observed.any():
                    continue
                cos = [(observed * s).sum() / np.sqrt((observed ** 2).sum() * (s ** 2).sum()) for s in stored]
                target = j + distance if j >= 0 else None
                targets = [target] if target is not None else list(range(distance))
                for t in targets:
                    out[(n, t)] = sorted(np.argsort(-stored[int(np.argmax(cos)), t], kind="stable")[:K].tolist())
    return out


def test_counts_are_each_requests_top_k_selections():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((7, M, E))
    counts = request_counts(traces_of(logits, [3, 4]), K)
    top = np.argsort(-logits, axis=-1)[..., :K]
    want = np.zeros((2, M, E))
    for n, r in zip(range(7), [0, 0, 0, 1, 1, 1, 1], strict=True):
        for j in range(M):
            want[r, j, top[n, j]] += 1
    np.testing.assert_array_equal(counts, want)


def test_replay_matches_the_plain_reference():
    rng = np.random.default_rng(1)
    stored = request_counts(traces_of(rng.standard_normal((30, M, E)), [6, 9, 5, 10]), K)
    held = traces_of(rng.standard_normal((11, M, E)), [4, 7])
    for distance in (1, 2):
        predicted, size = replay_hit_counts(stored, held, K, distance)
        assert size == K
        want = reference(stored, held, distance)
        got = {(n, t): sorted(ids[n][ids[n] >= 0].tolist()) for t, layer in enumerate(held.moe_layers)
               if layer in predicted for ids in [predicted[layer][0]] for n in range(11) if (ids[n] >= 0).any()}
        assert got == want


def test_a_request_is_matched_to_the_one_it_resembles():
    """Two stored requests, one using experts {0, 1} everywhere but {6, 7} at the last layer, the other {4, 5}; a
    new request on {0, 1} is predicted {6, 7} at the last layer, from its second token on (before any layer runs)
    and from its own first layers on."""
    def request(first: tuple, last: tuple, tokens: int) -> np.ndarray:
        logits = np.zeros((tokens, M, E))
        logits[:, :, list(first)] = 5.0
        logits[:, M - 1] = 0.0
        logits[:, M - 1, list(last)] = 5.0
        return logits
    stored = request_counts(traces_of(np.concatenate([request((0, 1), (6, 7), 3), request((4, 5), (2, 3), 3)]),
                                      [3, 3]), K)
    new = traces_of(request((0, 1), (0, 1), 2), [2])  # its own last layer differs: the match decides
    predicted, _ = replay_hit_counts(stored, new, K, distance=1)
    ids = predicted[new.moe_layers[M - 1]][0]
    assert [sorted(ids[n][:K].tolist()) for n in range(2)] == [[6, 7], [6, 7]]
    first = predicted[new.moe_layers[0]][0]
    assert (first[0] == -1).all() and sorted(first[1][:K].tolist()) == [0, 1]  # the second token: earlier counts
