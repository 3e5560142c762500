"""MoE-Lightning's request batching (moejax.lightning.balance; MoE-Lightning App. A.2, Alg. 2) on cases
worked out by hand: each comment walks the greedy request by request (P0, P1, ...: the partitions; a sum in
parentheses: the partition's input tokens before the request is placed). Pure Python, no jax."""
import pytest

from moejax.lightning.balance import Balanced, BatchLimit, balance, split_rows


def lengths(*input_lens: int, gen: int = 0) -> list[tuple[int, int]]:
    return [(n, gen) for n in input_lens]


def test_longest_first_into_the_fewest_tokens():
    # input lengths 3, 9, 1, 7, 5 (indices 0-4): by length 9(1) 7(3) 5(4) 3(0) 1(2); 2 partitions of up to 3.
    # 9 -> P0 (0 = 0, lowest) ; 7 -> P1 (0 < 9) ; 5 -> P1 (7 < 9) = 12 ; 3 -> P0 (9 < 12) = 12 ;
    # 1 -> P0 (12 = 12, lowest) = 13, full: closes. P1 [3, 4] stays open and comes after it.
    # (Round-robin by length would give [1, 4, 2] = 15 and [3, 0] = 10; by count, 5 would go to P0.)
    got = balance(lengths(3, 9, 1, 7, 5), micro_batches=2, per_micro_batch=3, cache_tokens=None)
    assert got == Balanced(micro_batches=[[1, 0, 2], [3, 4]], tokens=[13, 12], aborted=[])


def test_no_open_partition_aborts_and_the_loop_goes_on():
    # 9 7 5 3 1 1 (indices 0-5), 2 partitions of up to 2: 9 -> P0 ; 7 -> P1 ; 5 -> P1 (7 < 9) = 12, full: closes
    # first ; 3 -> P0 (the only one open) = 12, full: closes ; 1, 1: no partition open, both aborted (Alg. 2 lines
    # 6-7, with the `continue` the listing lacks: every request is either placed or aborted).
    got = balance(lengths(9, 7, 5, 3, 1, 1), micro_batches=2, per_micro_batch=2, cache_tokens=None)
    assert got == Balanced(micro_batches=[[1, 2], [0, 3]], tokens=[12, 12], aborted=[4, 5])


def test_open_partitions_come_after_the_full_ones():
    # 9 7 5, 2 partitions of up to 2: 9 -> P0 ; 7 -> P1 ; 5 -> P1 (7 < 9), full: closes. P0 [0] is still open at the
    # end: returned (its request must run), after the full P1.
    got = balance(lengths(9, 7, 5), micro_batches=2, per_micro_batch=2, cache_tokens=None)
    assert got == Balanced(micro_batches=[[1, 2], [0]], tokens=[12, 9], aborted=[])


def test_a_cache_limit_aborts_one_and_a_shorter_one_still_fits():
    # 9 7 5 3 1, every gen_len 2, 2 partitions of up to 3, cache 15; the check is (sum + input) + (1 + count) * 2:
    # 9 -> P0: 9 + 2 = 11 ok ; 7 -> P1: 7 + 2 = 9 ok ; 5 -> P1 (7 < 9): 12 + 4 = 16 > 15, aborted ;
    # 3 -> P1 (7 < 9): 10 + 4 = 14 ok ; 1 -> P0 (9 < 10): 10 + 4 = 14 ok. Neither is full: both returned.
    got = balance(lengths(9, 7, 5, 3, 1, gen=2), micro_batches=2, per_micro_batch=3, cache_tokens=15)
    assert got == Balanced(micro_batches=[[0, 4], [1, 3]], tokens=[10, 10], aborted=[2])


def test_a_cache_limit_is_inclusive():
    # as above with cache 16: 5 -> P1: 16 <= 16 ok, P1 = 12 ; 3 -> P0 (9 < 12): 12 + 4 = 16 ok, P0 = 12 ;
    # 1 -> P0 (12 = 12, lowest): 13 + 3 * 2 = 19 > 16, aborted.
    got = balance(lengths(9, 7, 5, 3, 1, gen=2), micro_batches=2, per_micro_batch=3, cache_tokens=16)
    assert got == Balanced(micro_batches=[[0, 3], [1, 2]], tokens=[12, 12], aborted=[4])


def test_the_cache_counts_each_requests_own_gen_len():
    # (input, gen) = (4, 10) (3, 1) (2, 1), one partition of up to 3, cache 20; the check is
    # (inputs + input) + (gens + gen): (4, 10): 4 + 10 = 14 ok ; (3, 1): 7 + 11 = 18 ok ; (2, 1): 9 + 12 = 21 > 20,
    # aborted. Line 9 with the new request's gen_len for all, 9 + 3 * 1 = 12, would admit it; with the largest,
    # (3, 1) would already be 7 + 2 * 10 = 27, aborted.
    got = balance([(4, 10), (3, 1), (2, 1)], micro_batches=1, per_micro_batch=3, cache_tokens=20)
    assert got == Balanced(micro_batches=[[0, 1]], tokens=[7], aborted=[2])


def test_equal_lengths_keep_request_order_and_ties_go_to_the_lowest_partition():
    # six of length 4, 3 partitions of up to 2: the stable sort keeps 0-5 ; 0 -> P0, 1 -> P1, 2 -> P2 (all ties) ;
    # 3 -> P0 (4 = 4 = 4, lowest), full: closes ; 4 -> P1 (lowest of the open P1, P2), closes ; 5 -> P2, closes.
    # (Sorting ascending and reversing puts 5 first: [[5, 2], [4, 1], [3, 0]].)
    got = balance(lengths(4, 4, 4, 4, 4, 4), micro_batches=3, per_micro_batch=2, cache_tokens=None)
    assert got == Balanced(micro_batches=[[0, 3], [1, 4], [2, 5]], tokens=[8, 8, 8], aborted=[])


def test_more_micro_batches_than_requests():
    # 5 8 into 4 partitions of up to 2: 8(1) -> P0 ; 5(0) -> P1 ; P2 and P3 got nothing: dropped.
    got = balance(lengths(5, 8), micro_batches=4, per_micro_batch=2, cache_tokens=None)
    assert got == Balanced(micro_batches=[[1], [0]], tokens=[8, 5], aborted=[])
    assert balance([], micro_batches=2, per_micro_batch=2, cache_tokens=None) == Balanced([], [], [])


@pytest.mark.parametrize("kwargs, message", [
    ({"micro_batches": 0}, r"balance: micro_batches must be >= 1, got 0"),
    ({"per_micro_batch": 0}, r"balance: per_micro_batch must be >= 1, got 0"),
    ({"cache_tokens": 0}, r"balance: cache_tokens must be >= 1 or None \(no limit\), got 0"),
    ({"requests": [(3, 1), (2, 1), (-1, 1)]}, r"balance: requests\[2\] has a negative length: input_len=-1, gen_len=1"),
    ({"requests": [(3, -2)]}, r"balance: requests\[0\] has a negative length: input_len=3, gen_len=-2"),
])
def test_balance_errors_name_the_bad_argument(kwargs, message):
    args = {"requests": [(3, 1)], "micro_batches": 2, "per_micro_batch": 2, "cache_tokens": 100, **kwargs}
    with pytest.raises(ValueError, match=message):
        balance(**args)


def test_split_rows_balances_one_step():
    # 3 10 4 6 1 into 2 groups: by length 10(1) 6(3) 4(2) 3(0) 1(4) ; 10 -> G0 ; 6 -> G1 ; 4 -> G1 (6 < 10) = 10 ;
    # 3 -> G0 (10 = 10, lowest) = 13 ; 1 -> G1 (10 < 13) = 11. G0 {1, 0}, G1 {3, 2, 4}, each sorted.
    # (Round-robin by index: [0, 2, 4] = 8 and [1, 3] = 16.)
    assert split_rows([3, 10, 4, 6, 1], micro_batches=2) == [[0, 1], [2, 3, 4]]
    # no size cap: 10 1 1 1 into 2: 10 -> G0, then every 1 -> G1 (1 < 10, 2 < 10)
    assert split_rows([10, 1, 1, 1], micro_batches=2) == [[0], [1, 2, 3]]


def test_split_rows_edges():
    assert split_rows([5, 2], micro_batches=4) == [[0], [1]]  # G2, G3 empty: dropped
    assert split_rows([5, 2, 7], micro_batches=1) == [[0, 1, 2]]
    assert split_rows([], micro_batches=3) == []
    with pytest.raises(ValueError, match=r"split_rows: micro_batches must be >= 1, got 0"):
        split_rows([1], micro_batches=0)
    with pytest.raises(ValueError, match=r"split_rows: lengths\[1\] is negative: -3"):
        split_rows([1, -3], micro_batches=2)


def test_batch_limit_admits_what_alg2_places_and_refuses_the_rest():
    limit = BatchLimit(micro_batches=2, per_micro_batch=2, cache_tokens=16)
    assert limit.admits([], (11, 5))  # 16: exactly a micro-batch
    assert not limit.admits([], (12, 5))  # alone over the limit (the scheduler runs such a request alone)
    assert limit.admits([(11, 5)], (5, 5))  # one per micro-batch
    assert not limit.admits([(11, 5), (5, 5)], (3, 5))  # it would join the 10's: 18 > 16
    assert limit.admits([(11, 5), (5, 5)], (1, 5))  # a shorter one still fits there: 16
    assert not BatchLimit(1, 2, 100).admits([(1, 1), (1, 1)], (1, 1))  # no micro-batch open: the size cap
    with pytest.raises(ValueError, match="BatchLimit: cache_tokens must be >= 1, got 0"):
        BatchLimit(2, 2, 0)
