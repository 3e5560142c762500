"""Every option of launch.serve, walked from its own metadata (moejax.options): each bad value (not among the
choices, not a number, out of range, given where the placement it applies to is not the one set) and each pair of
options that do not combine is refused before the model loads: exit status 2, one line on stderr naming the flag, no
traceback, no output file.

The tables extend: BAD_TEXT holds bad values of text options (their metadata says only "text"), PAIRS the options
that do not go together beyond what `applies` says."""
import dataclasses
import os
import subprocess
import sys

import pytest
from conftest import serve_stopped

from launch import serve as serve_cli
from moejax import options

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples", "requests.jsonl")
NO_MODEL = "/nonexistent/model-dir"  # a message about a flag, not this, shows the flag was checked before the load

# text options whose values are checked before the load: name -> bad values
BAD_TEXT: dict[str, list[str]] = {
    "kernels": ["bogus", "experts=bogus"],
    "layout": ["not-a-layout", "attn=bogus"],
}

# options that do not go together, besides an option's `applies`: (flags, the flag the message must name)
PAIRS: list[tuple[list[str], str]] = [
    (["--plot", "{tmp}"], "--plot"),  # without --explain it would draw nothing
    (["--placement", "streamed", "--stream", "jit", "--window", "2"], "--window"),
    (["--placement", "cached", "--predictor", "router"], "--default-vectors"),
    (["--placement", "cached", "--predictor", "estimator"], "--estimator"),
    # expert maps without --maps start from an empty store (fMoE's online setting); --default-vectors is its fallback
    (["--placement", "cached", "--predictor", "expert_map", "--maps", "{tmp}", "--default-vectors", "{tmp}"],
     "--default-vectors"),
    (["--placement", "cached", "--predictor", "router", "--default-vectors", "{tmp}", "--maps", "{tmp}"], "--maps"),
    (["--placement", "cached", "--predictor", "previous_hidden", "--default-vectors", "{tmp}"], "--default-vectors"),
    (["--placement", "cached", "--predictor", "expert_map", "--maps", "{tmp}", "--speculative"], "--speculative"),
    (["--placement", "cached", "--speculative"], "--speculative"),
    (["--placement", "cached", "--predictor", "previous_hidden", "--router-free"], "--router-free"),
    (["--placement", "cached", "--predictor", "previous_hidden", "--speculative", "--count-mispredictions"],
     "--count-mispredictions"),
    (["--coordinator", "127.0.0.1:1"], "--coordinator"),
    (["--transfer-address", "127.0.0.1:1"], "--transfer-address"),
    (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2", "--output", "{tmp}/o.jsonl"],
     "--process-id"),
    (["--replicas", "2", "--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "0",
      "--output", "{tmp}/o.jsonl"], "--replicas"),
]


def flagged_fields():
    for cls in serve_cli.OPTION_CLASSES:
        for f in options.fields(cls):
            if options.meta(f)["flag"]:
                yield f


def good_value(f: dataclasses.Field, tmp: str) -> list[str]:
    """The flag with a value it takes (a switch alone)."""
    m, flag = options.meta(f), options.flag_of(f)
    if m["type"] is bool:
        return [flag]
    if m["choices"] is not None:
        return [flag, str(next(c for c in m["choices"] if c != "auto"))]
    if m["type"] in (int, float):
        low = m["minimum"] if m["minimum"] is not None else (m["above"] or 0) + 1
        return [flag, str(m["type"](max(low, 1) if m["maximum"] is None else m["maximum"]))]
    return [flag, tmp]  # a path that exists


def bad_values(f: dataclasses.Field) -> list[str]:
    """Values of the option that its metadata rules out."""
    m = options.meta(f)
    if m["choices"] is not None:
        return ["not-a-choice"]
    if m["type"] in (int, float):
        bad = ["many"] + (["1.5"] if m["type"] is int else ["nan", "inf"])
        if m["minimum"] is not None:
            bad.append(str(m["type"](m["minimum"] - 1)))
        if m["above"] is not None:
            bad.append(str(m["type"](m["above"])))
        if m["maximum"] is not None:
            bad.append(str(m["type"](m["maximum"] + 1)))
        return bad
    return BAD_TEXT.get(f.name, [])


def cases():
    for f in flagged_fields():
        flag = options.flag_of(f)
        for value in bad_values(f):
            yield pytest.param([flag, value], flag, id=f"{flag}={value}")
        m = options.meta(f)
        if m["applies"] is not None:  # given under a placement it does not apply to
            other, needed = m["applies"]
            other_field = next(g for g in flagged_fields() if g.name == other)
            wrong = next(c for c in options.meta(other_field)["choices"] if c not in ("auto", needed))
            yield pytest.param(["good", f.name, options.flag_of(other_field), wrong], flag,
                               id=f"{flag} under {options.flag_of(other_field)} {wrong}")
    for flags, named in PAIRS:
        yield pytest.param(flags, named, id=" ".join(flags).replace("{tmp}", "DIR"))


def test_the_tables_cover_every_kind_of_option():
    """Each option with choices, a type or a range has bad values here (a switch has none: its `applies` is walked);
    each text option is in BAD_TEXT or is a path, an address or a name whose check needs the thing it names (the
    model, a profile, a Ray cluster)."""
    unchecked = {f.name for f in flagged_fields() if not bad_values(f) and options.meta(f)["type"] is not bool}
    assert unchecked <= {"model", "profile", "ray", "coordinator", "transfer_address", "default_vectors",
                         "estimator", "maps"}, unchecked


@pytest.mark.parametrize("flags, named", list(cases()))
def test_a_bad_value_is_one_line_naming_its_flag_before_the_load(flags, named, tmp_path, capsys):
    if flags[0] == "good":  # a good value of the option, under another placement: built here, with tmp_path
        f = next(g for g in flagged_fields() if g.name == flags[1])
        flags = good_value(f, str(tmp_path)) + flags[2:]
    flags = [x.replace("{tmp}", str(tmp_path)) for x in flags]
    output = tmp_path / "out.jsonl"
    argv = ["--input", EXAMPLES, "--model", NO_MODEL, *flags]
    if "--output" not in flags:
        argv += ["--output", str(output)]
    status, message = serve_stopped(capsys, argv)
    assert status == 2, (status, message)
    assert message and "\n" not in message and named in message, message
    assert NO_MODEL not in message, message
    assert not output.exists() and not os.path.exists(str(output) + ".partial")


@pytest.mark.slow
def test_as_a_process_no_traceback():
    """The same refusals from the command line: exit status 2, one line on stderr, nothing on stdout."""
    for flags in (["--kv-cache", "sometimes"], ["--resident-share", "2"], ["--placement", "cached", "--predictor",
                                                                            "router"], ["--max-batch-tokens", "x"]):
        r = subprocess.run([sys.executable, "-m", "launch.serve", "--input", EXAMPLES, *flags], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and r.stdout == "", (flags, r.returncode, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and flags[-2] in r.stderr, (flags, r.stderr)


@pytest.mark.parametrize("flags, message", [
    (["--num-layers", "99"], "--num-layers 99 outside 1..4"),
    (["--layout", "attn=dp,experts=ep,devices=4"], "--layout: devices=4 but only 1 are present"),
    (["--device-memory-gb", "0.0001"], "--model tiny-qwen3-moe: cannot fit: the weights that always stay"),
])
def test_a_load_error_names_the_flag_that_caused_it(flags, message, capsys):
    """Found by moejax.load (status 1): the flag the user typed, not `--model ...: moejax.load: <keyword>`."""
    status, text = serve_stopped(capsys, ["--input", EXAMPLES, "--model", "tiny-qwen3-moe", "--explain", *flags])
    assert status == 1 and text.startswith(message) and "moejax.load" not in text, text
