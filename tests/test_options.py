"""Options defined once (moejax.options): a bad value names the option and what it takes; launch.serve's
flags, their checks, --help, docs/options.md's table and the journal's fingerprint come from the fields."""
import argparse
import dataclasses
import json
import os
import types

import pytest

from launch import serve as serve_cli
from moejax import options
from moejax.offload.settings import PlacementSettings
from moejax.options import option
from moejax.plan.engine_plan import EnginePlan
from moejax.requests.results import fingerprint
from moejax.sched.serving_options import SCHEDULER, ServingOptions
from moejax.serving.model_options import ModelOptions, Processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Example:
    count: int = option(2, minimum=1, help="how many")
    share: float | None = option(None, type=float, above=0, help="a fraction")
    mode: str = option("a", choices=("a", "b"), help="which")
    on: bool = option(False, help="a switch")
    hidden: int = option(3, minimum=0, flag=False, help="no flag")

    def __post_init__(self):
        options.check(self, prefix="example: ")


@pytest.mark.parametrize("values, message", [
    (dict(count=0), "example: count must be an int >= 1, got 0"),
    (dict(count=2.0), "example: count must be an int >= 1, got 2.0"),
    (dict(count=True), "example: count must be an int >= 1, got True"),
    (dict(share=0.0), "example: share must be a number > 0, got 0.0"),
    (dict(share=float("inf")), "example: share must be a number > 0, got inf"),
    (dict(mode="c"), "example: mode must be one of a, b, got 'c'"),
    (dict(on=1), "example: on must be True or False, got 1"),
    (dict(hidden=-1), "example: hidden must be an int >= 0, got -1"),
])
def test_a_bad_value_names_the_option_and_what_it_takes(values, message):
    with pytest.raises(ValueError) as e:
        Example(**values)
    assert str(e.value) == message


def test_flags_come_from_the_fields():
    p = argparse.ArgumentParser()
    options.add_arguments(p, Example)
    assert "--hidden" not in p.format_help()
    args = p.parse_args(["--count", "5", "--mode", "b", "--on"])
    assert options.from_args(Example, args) == Example(count=5, mode="b", on=True)
    assert options.from_args(Example, p.parse_args([])) == Example()
    with pytest.raises(SystemExit):
        p.parse_args(["--mode", "c"])  # argparse knows the choices
    assert options.check_flags(p.parse_args(["--count", "0"]), Example) == "--count must be >= 1; got 0"
    assert options.check_flags(p.parse_args(["--share", "nan"]), Example) == "--share must be a finite number; got nan"
    assert options.check_flags(p.parse_args(["--share", "0.5"]), Example) is None


def test_every_serving_option_has_a_flag_and_the_options_page_names_each_flag():
    """The scheduler's knobs are the only library-only serving options (--help: the next test)."""
    flagged = {f.name for f in options.fields(ServingOptions) if options.meta(f)["flag"]}
    assert flagged | set(SCHEDULER) == {f.name for f in dataclasses.fields(ServingOptions)}
    with open(os.path.join(ROOT, "docs", "options.md"), encoding="utf-8") as f:
        page = f.read()
    for cls in serve_cli.OPTION_CLASSES:
        for f in options.fields(cls):
            if options.meta(f)["flag"]:
                assert f"`{options.flag_of(f)}`" in page, options.flag_of(f)


def test_help_lists_every_flag_of_the_option_classes(capsys):
    with pytest.raises(SystemExit):
        serve_cli.parse_args(["--help"])
    text = capsys.readouterr().out
    for cls in serve_cli.OPTION_CLASSES:
        for f in options.fields(cls):
            if options.meta(f)["flag"]:
                assert options.flag_of(f) in text, f.name
    assert "5%" in text and "5%%" not in text  # argparse's % escaping


def test_the_options_page_table_is_the_generated_one():
    with open(os.path.join(ROOT, "docs", "options.md"), encoding="utf-8") as f:
        page = f.read()
    start = page.index("<!-- options table:")
    block = page[page.index("\n", start) + 1: page.index("<!-- end of options table -->")]
    assert block.strip() == serve_cli.options_table(), \
        "rewrite docs/options.md's table with launch.serve.options_table()"


def test_serve_flags_build_the_option_dataclasses():
    args = serve_cli.parse_args(["--input", "x", "--max-batch-tokens", "64", "--kv-cache", "off", "--batching",
                                 "static", "--placement", "cached", "--cache-slots", "4", "--layout", "attn=dp"])
    assert options.from_args(ServingOptions, args) == ServingOptions(max_batch_tokens=64, kv_cache="off",
                                                                       batching="static")
    assert options.from_args(PlacementSettings, args) == PlacementSettings(placement="cached", cache_slots=4)
    plan = options.from_args(EnginePlan, args, placement=PlacementSettings())
    assert plan.layout is not None and plan.profile is None
    assert options.from_args(ModelOptions, args) == ModelOptions()
    assert options.from_args(Processes, args) == Processes()
    assert ServingOptions(max_rows=2, mixed=True).scheduler_keywords() == {"max_rows": 2, "mixed": True}
    batch = serve_cli.parse_args(["--input", "x", "--max-rows", "256"])  # the continuous scheduler's batch
    assert options.from_args(ServingOptions, batch).scheduler_keywords() == {"max_rows": 256}
    assert serve_cli.check_numbers(serve_cli.parse_args(["--input", "x", "--max-rows", "0"])) == \
        "--max-rows must be >= 1; got 0"


def _stub_engine(placement: str):
    return types.SimpleNamespace(name="tiny", dtype=types.SimpleNamespace(name="float32"),
                                 kernels=types.SimpleNamespace(describe=lambda: "experts auto: xla"),
                                 config=types.SimpleNamespace(num_layers=2), layout=None,
                                 memory_budget=types.SimpleNamespace(placement=placement))


# Fingerprints of these settings before the options were defined once: journals written then must still resume.
@pytest.mark.parametrize("argv, placement, expected", [
    ([], "resident", "fp_691b8677f5a2"),
    (["--placement", "cached", "--cache-slots", "4", "--eviction", "lfu"], "cached", "fp_88fa84c5ec7e"),
    (["--placement", "cached", "--predictor", "oracle", "--speculative"], "cached", "fp_32cbd3acb34d"),
    (["--predictor", "router", "--default-vectors", "no/such/dir", "--speculative", "--router-free",
      "--prefetch-distance", "2"], "cached", "fp_a56b32f64046"),
    (["--predictor", "hybrid", "--estimator", "no/est", "--speculative", "--max-batch-tokens", "64", "--kv-cache",
      "off", "--batching", "static"], "cached", "fp_6de317d75db1"),
])
def test_the_journal_fingerprint_of_unchanged_settings_is_unchanged(argv, placement, expected):
    args = serve_cli.parse_args(["--model", "tiny-qwen3-moe", "--input", "x", *argv])
    settings = serve_cli.run_settings(args, _stub_engine(placement))
    assert fingerprint(settings) == expected, json.dumps(settings)


def test_an_option_fingerprinted_when_given_changes_the_fingerprint_only_when_given():
    base = ["--model", "tiny-qwen3-moe", "--input", "x", "--placement", "cached", "--predictor", "oracle",
            "--speculative"]
    prints = {extra: fingerprint(serve_cli.run_settings(serve_cli.parse_args(base + list(extra)),
                                                        _stub_engine("cached")))
              for extra in ((), ("--prefill-experts", "cache"), ("--prefill-experts", "stream"))}
    assert prints[()] == prints[("--prefill-experts", "cache")] == "fp_32cbd3acb34d"  # the default: as before
    assert prints[("--prefill-experts", "stream")] != prints[()]
