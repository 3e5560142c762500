"""bench quality --tier2 (launch/bench/quality_tier2.py): the questions cut from source lines, and the CLI's record
on the qwen3_moe fixture."""
import inspect
import textwrap

import pytest

from launch.bench import cli as bench
from launch.bench.code_questions import code_questions
from launch.bench.quality_tier2 import source_lines
from launch.bench.results import read_runs

LINES = source_lines([inspect.getsource(textwrap)])


def test_same_indent_gives_every_choice_the_answers_indentation():
    plain = code_questions(LINES, 12, 4, 3, seed=1)
    same = code_questions(LINES, 12, 4, 3, seed=1, same_indent=True)
    for p, s in zip(plain, same, strict=True):
        assert p["context"] == s["context"] and p["gold"] == s["gold"]  # the same draws, only the text differs
        gold = s["choices"][s["gold"]]
        indent = gold[: len(gold) - len(gold.lstrip())]
        assert p["choices"][p["gold"]] == gold
        assert [c.lstrip() for c in p["choices"]] == [c.lstrip() for c in s["choices"]]
        assert all(c.startswith(indent) and c[len(indent):] == c.lstrip() for c in s["choices"])
        # the answer is the first two words of the line after the context, as the source has it
        context = s["context"].splitlines()
        at = next(i for i in range(len(LINES)) if LINES[i: i + 3] == context)
        assert " ".join(LINES[at + 3].split()[:2]) == gold.lstrip()


def test_no_context_spans_two_texts():
    lines = source_lines(["a = 1\nb = 2", "c = 3\nd = 4"])
    assert lines == ["a = 1", "b = 2", "", "c = 3", "d = 4", ""]
    docs = code_questions(lines, 2, 2, 1, seed=0)
    assert sorted(d["context"] for d in docs) == ["a = 1\n", "c = 3\n"]  # "b = 2" is followed by the blank line
    with pytest.raises(ValueError, match="--questions 3: the sources give 2 contexts"):
        code_questions(lines, 3, 2, 1, seed=0)


@pytest.mark.parametrize("argv, message", [
    (["--tier2", "--max-tokens", "5"], "--max-tokens: the perplexity run's, not --tier2's"),
    (["--questions", "5", "--seed", "3"], "--questions, --seed: --tier2's; add --tier2 or leave them out"),
])
def test_the_other_modes_flags_are_refused_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["quality", "--stdlib", "held_out", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow  # the CLI end to end on the qwen3_moe fixture: scoring and generation compiled
def test_bench_tier2_record(tmp_path):
    from conftest import fixture_dir
    source = tmp_path / "source.py"
    source.write_text(inspect.getsource(textwrap))
    out = tmp_path / "tier2.json"
    bench.main(["quality", "--tier2", "--model", fixture_dir("qwen3_moe"), "--dtype", "float32", "--text",
                str(source), "--questions", "4", "--choices", "3", "--context-lines", "3", "--out", str(out)])
    [record] = read_runs(str(out))
    answers = record["answers"]
    assert record["bench"] == "quality-tier2" and record["questions"] == len(answers) == 4
    assert record["scoring_accuracy"] == sum(a["scored"] == a["gold"] for a in answers) / 4
    assert record["generation_accuracy"] == sum(a["generated"] == a["gold"] for a in answers) / 4
    assert record["generation_unmatched"] == sum(a["generated"] is None for a in answers)
    for a in answers:
        assert len(a["choices"]) == len(a["loglikelihoods"]) == 3
        assert a["scored"] == max(range(3), key=lambda i: a["loglikelihoods"][i])
    assert record["device"]["platform"] == "cpu" and record["command"].startswith("python -m launch.bench")
