"""launch.bench peers: each workload's answers are compared with an engine that ran that workload."""
import pytest

from launch.bench.peers import agreement, reference_engine


def test_a_generation_workload_is_compared_with_an_engine_that_ran_it():
    # moejax-serve runs no generation workload: with it first and no transformers, C compared with moejax-serve
    # raised KeyError('moejax-serve')
    ran_c = ["moejax", "vllm"]
    assert reference_engine(ran_c) == "moejax"
    agree = agreement({"moejax": [[1, 2, 3], [5]], "vllm": [[1, 2, 4], [5]]}, "generate", reference_engine(ran_c))
    assert agree == {"moejax": 1.0, "vllm": pytest.approx(3 / 4)}
    assert reference_engine(["moejax-serve", "moejax", "transformers"]) == "transformers"
    scores = agreement({"transformers": [-1.0, -2.0], "moejax": [-1.0, -2.5]}, "score", "transformers")
    assert scores == {"transformers": 0.0, "moejax": 0.5}
