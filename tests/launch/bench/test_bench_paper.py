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


def test_gpu_sizes_on_a_cpu_are_refused_in_one_line_before_any_figure(tmp_path):
    with pytest.raises(SystemExit) as stop:
        bench.main(["paper", "findep", "--gpu", "--results", str(tmp_path)])
    assert "--gpu" in str(stop.value) and "cpu" in str(stop.value)
    assert not (tmp_path / "paper").exists() and not list(tmp_path.glob("paper-*.json"))


@pytest.mark.slow  # a benchmark in its own process (the frontend's simulation: no model compiled), then the plot
def test_one_figure_end_to_end_writes_its_json_and_plot_and_keeps_earlier_results(tmp_path):
    fig = PAPERS["moe-prefill"][0]
    folder = tmp_path / "paper" / "moe-prefill"
    folder.mkdir(parents=True)
    (folder / f"{fig.name}-cpu.json").write_text(json.dumps({"runs": [{"earlier": True}]}))
    summary = tmp_path / "summary.json"
    bench.main(["paper", "moe-prefill", "--figures", fig.name, "--results", str(tmp_path), "--out", str(summary)])
    [run] = read_runs(str(summary))
    [row] = run["figures"]
    assert row["status"] == "ok" and run["within_budget"] and run["paper"] == "moe-prefill"
    first, entry = read_runs(str(folder / f"{fig.name}-cpu.json"))
    assert first == {"earlier": True}
    assert entry["corresponds_to"] == fig.corresponds and entry["differs"] == fig.differs
    assert entry["command"] == "python -m launch.bench " + " ".join(fig.argv)
    record = entry["record"]
    assert record["benchmark"] == "frontend-sim" and record["device"]["platform"] == "cpu"
    series = fig.series(record)
    routings = {"prefix", "round_robin", "random", "least_requests"}
    assert set(series) == {f"short {r}" for r in routings}
    assert all(xs == [2, 4, 8, 16] and min(ys) > 0 for xs, ys in series.values())
    assert row["json"] == f"paper/moe-prefill/{fig.name}-cpu.json" and row["plot"] == row["json"][:-5] + ".png"
    assert (folder / f"{fig.name}-cpu.png").stat().st_size > 1000


def test_the_papers_page_lists_every_figure_under_its_paper():
    with open("docs/papers.md") as f:
        page = f.read()
    section = page[page.index("## Each paper's evaluation"):]
    for paper, figures in PAPERS.items():
        block = section[section.index(f"`{paper}`"):]
        block = block[:block.index("\n\n")] if "\n\n" in block else block
        for fig in figures:
            assert f"`{fig.name}`" in block, (paper, fig.name)
