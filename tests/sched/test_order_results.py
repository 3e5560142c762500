"""--order spf changes when each request runs, not its result: one scoring file served in the default order and
shortest prefill first, on one device, DP+EP and PP+PP (8 simulated CPU devices, tests/order_worker.py), gives the
one-device default file: lines in input order, scores to float32 round-off."""
import pytest
from workers import run_workers

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs():
    return run_workers("order_worker.py", [[]], devices=8, timeout=900)[0]


def test_spf_runs_other_batches_first_and_writes_the_default_results_on_every_layout(runs):
    reference = runs["one/longest"]
    assert reference["ids"] == [f"s{k}" for k in range(14)]  # input order
    assert len(reference["batches"]) > 2
    for name in ("one", "dp_ep", "pp_pp"):
        assert runs[f"{name}/spf"]["batches"] != runs[f"{name}/longest"]["batches"], name
        for order in ("longest", "spf"):
            got = runs[f"{name}/{order}"]
            assert got["ids"] == reference["ids"], (name, order)
            for a, b in zip(got["logprobs"], reference["logprobs"], strict=True):
                assert a == pytest.approx(b, rel=1e-5, abs=1e-5), (name, order)
