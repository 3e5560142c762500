"""`launch.bench paper NAME`: every figure's command line is one the benchmarks accept (so a renamed flag fails
here, not in a reader's run), what the user types is checked before any work, and one figure end to end writes its
JSON, its plot and the summary without touching the results already there."""
import json

import pytest

from launch.bench import cli as bench
from launch.bench.paper_figures import PAPERS
from launch.bench.results import read_runs

PAPER_NAMES = {"moe-prefill", "speculating-experts", "findep", "moe-lightning", "fmoe"}


def test_each_paper_has_figures_and_each_figure_a_command_the_benchmarks_accept():
    assert set(PAPERS) == PAPER_NAMES
    parser = bench.build_parser()
    for paper, figures in PAPERS.items():
        assert figures, paper
        assert len({f.name for f in figures}) == len(figures), paper
        for fig in figures:
            assert fig.corresponds and fig.differs, fig.name
            for argv in {fig.argv, fig.gpu_argv or fig.argv}:
                args = parser.parse_args([*argv, "--out", "unused.json"])
                assert args.command == argv[0] and args.command != "paper", fig.name
                if getattr(args, "check", None):
                    args.check(args, parser)


@pytest.mark.parametrize("argv,flag", [(["paper", "findep", "--figures", "fig99"], "--figures"),
                                       (["paper", "findep", "--figures", ""], "--figures"),
                                       (["paper", "findep", "--budget-s", "0"], "--budget-s"),
                                       (["paper", "flexgen"], "name")])
def test_a_wrong_paper_figure_or_budget_is_one_line_before_any_work(argv, flag, capsys, tmp_path):
    with pytest.raises(SystemExit) as stop:
        bench.main([*argv, "--results", str(tmp_path)])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert flag in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())


@pytest.mark.slow  # a benchmark in its own process on 8 simulated devices, then the plot
def test_one_figure_end_to_end_writes_its_json_and_plot_and_keeps_earlier_results(tmp_path):
    fig = next(f for f in PAPERS["findep"] if f.name == "a2e-route")
    folder = tmp_path / "paper" / "findep"
    folder.mkdir(parents=True)
    earlier = {"runs": [{"earlier": True}]}
    (folder / "a2e-route-cpu.json").write_text(json.dumps(earlier))
    summary = tmp_path / "summary.json"
    bench.main(["paper", "findep", "--figures", "a2e-route", "--results", str(tmp_path), "--out", str(summary)])
    [run] = read_runs(str(summary))
    [row] = run["figures"]
    assert row["status"] == "ok" and run["within_budget"] and run["paper"] == "findep"
    first, entry = read_runs(str(folder / "a2e-route-cpu.json"))
    assert first == {"earlier": True}
    assert entry["corresponds_to"] == fig.corresponds and entry["differs"] == fig.differs
    assert entry["command"].startswith("python -m launch.bench dep-a2e")
    record = entry["record"]
    assert record["device"]["count"] == 8 and record["benchmark"] == "dep-a2e"
    series = fig.series(record)
    assert set(series) == {"straight", "regroup"} and all(min(ys) > 0 for _, ys in series.values())
    assert row["plot"].endswith(".png") and (folder / "a2e-route-cpu.png").stat().st_size > 1000
