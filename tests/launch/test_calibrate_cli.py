"""launch.calibrate's defaults and refusals: it calibrates launch.serve's default model, whose example requests are
text, and a file without a usable prompt is refused with the reason its lines were bad."""
import os

import pytest

from launch import calibrate as calibrate_cli
from launch import serve as serve_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples", "requests.jsonl")


def test_no_usable_prompt_says_why_the_lines_were_bad(tmp_path):
    # a preset has no tokenizer: the examples' text prompts cannot be tokenized
    with pytest.raises(SystemExit) as exc:
        calibrate_cli.main(["--model", "tiny-qwen3-moe", "--input", EXAMPLES, "--out", str(tmp_path / "v")])
    lines = len(open(EXAMPLES).read().splitlines())
    assert exc.value.code.startswith(f"launch.calibrate: no usable prompt in {EXAMPLES!r} for --model tiny-qwen3-moe "
                                     f"({lines} bad lines; ")
    assert "line 1: body.prompt: model has no tokenizer; send prompt_token_ids" in exc.value.code
    assert not (tmp_path / "v").exists()


@pytest.mark.slow  # a CLI end to end: calibrates two prompts on one layer
def test_the_default_model_is_launch_serves_and_takes_its_examples(tmp_path, capsys):
    assert serve_cli.parse_args(["--input", EXAMPLES]).model == "pycode-moe"
    out = tmp_path / "vectors"
    assert calibrate_cli.main(["--input", EXAMPLES, "--out", str(out), "--num-layers", "1", "--max-prompts", "2",
                               "--max-tokens", "16"]) == 0
    assert out.is_dir() and "2 prompts" in capsys.readouterr().err
