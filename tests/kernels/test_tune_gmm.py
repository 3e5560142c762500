"""launch.tune_gmm: its dry run measures and checks every candidate, and the committed tuning table is what the
committed H200 sweep says."""
import json
import os

import pytest

from launch import tune_gmm
from launch.bench.results import read_runs, write_runs
from moejax.kernels.grouped_matmul import tuning

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
H200_SWEEP = os.path.join(ROOT, "bench", "results", "tune_gmm-NVIDIA_H200.json")


@pytest.mark.slow
def test_dry_run_checks_candidates_and_records_the_best(tmp_path):
    out = tmp_path / "tune.json"
    assert tune_gmm.main(["--dry-run", "--out", str(out)]) == 0
    (run,) = read_runs(str(out))
    assert "partial" not in run and run["device"]["platform"] == "cpu"
    measured = [r for r in run["rows"] if r["what"] in ("pallas", "ffn_pallas_interpret")]
    assert len(measured) == 4 and all(r["relative_error"] < tune_gmm.WRONG and not r["wrong"] for r in measured)
    assert [r["skipped"] for r in run["rows"] if r["what"] == "mosaic"] == ["needs an NVIDIA Hopper GPU"]
    best = run["best"]
    assert set(best["pallas"]) == {"glu/32", "gemm/32"} and best["fastest"] == {"gemm/32": "pallas", "glu/32": "pallas"}
    with pytest.raises(SystemExit, match="holds no run measured on a GPU"):
        tune_gmm.write_table(str(out), str(tmp_path / "table.json"))


def test_the_committed_table_is_the_committed_sweeps_best(tmp_path):
    """The table is the committed GPU sweeps merged in order (a later sweep's classes replace the earlier's)."""
    table, results = tmp_path / "table.json", tmp_path / "runs.json"
    runs = [r for r in read_runs(H200_SWEEP) if r["device"]["platform"] == "gpu"]
    for i in range(len(runs)):
        write_runs(str(results), runs[:i + 1])
        entry = tune_gmm.write_table(str(results), str(table))
    committed = json.load(open(tuning.TABLE_PATH))["devices"]["NVIDIA H200"]
    for section in ("pallas", "mosaic", "fastest"):
        assert entry[section] == committed[section], section
    for key, cfg in entry["pallas"].items():  # each best is the fastest correct candidate of its class
        run = next(r for r in reversed(runs) if key in r["best"]["pallas"])  # the last sweep that measured it
        rows = [r for r in run["rows"] if r["class"] == key and r["what"] == "pallas" and not r.get("wrong")
                and "seconds" in r]
        assert min(rows, key=lambda r: r["seconds"])["config"] == cfg, key


def test_the_sampled_references_catch_a_wrong_product():
    import jax.numpy as jnp
    import numpy as np

    from moejax.kernels import grouped_matmul
    d = tune_gmm.make_sets(np.random.default_rng(0), 64, tune_gmm.TINY, jnp.bfloat16)[0]
    refs = tune_gmm.references(d)
    right = grouped_matmul(d["xs"], d["wgu"], d["sizes"], backend="xla")
    assert tune_gmm.relative_error(right, refs["gemm"]) < 1e-2
    rows = refs["gemm"][0]
    wrong = right.at[rows[len(rows) // 2]].multiply(-1)  # one sampled row's sign flipped
    assert tune_gmm.relative_error(wrong, refs["gemm"]) > tune_gmm.WRONG
