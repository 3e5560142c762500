"""`--model moejax`'s model_args, walked from the options' own metadata (moejax.options): every bad value of a
moejax.load option and of the model's own arguments is one ModelArgsError naming the key, before the model loads,
and `python -m moejax.eval` prints it as one line (exit status 2), without a traceback."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("lm_eval")

from moejax import options  # noqa: E402
from moejax.eval.lm_eval_model import _HARNESS_ARGS, ModelArgsError, MoejaxLM  # noqa: E402
from moejax.offload.settings import PlacementSettings  # noqa: E402
from moejax.plan.engine_plan import WORKLOAD_OPTIONS, Workload  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(ROOT, "tests", "data", "lm_eval")  # a local task: nothing to download
HARNESS = {"batch_size": 1, "max_batch_size": None, "device": None}  # what lm-eval passes every model


def metadata_cases():
    """(key, bad value) of every load option with choices, a type or a range (lm-eval passes numbers as numbers and
    anything else as text)."""
    # (a key lm-eval passes every model itself, such as batch_size, cannot be a model_arg)
    fields = [(f.name, f) for f in options.fields(PlacementSettings) if f.name not in _HARNESS_ARGS]
    fields += [(key, f) for key, name in WORKLOAD_OPTIONS.items() for f in options.fields(Workload) if f.name == name]
    for key, f in fields:
        m = options.meta(f)
        if m["choices"] is not None:
            yield key, "bogus"
        elif m["type"] in (int, float):
            yield key, "many"
            for bad in (m["minimum"] - 1 if m["minimum"] is not None else None, m["above"],
                        m["maximum"] + 1 if m["maximum"] is not None else None):
                if bad is not None:
                    yield key, m["type"](bad)


OWN = [("max_length", 0), ("max_length", "long"), ("max_gen_toks", 0), ("seed", "abc"), ("prefix_token_id", -1),
       ("add_bos_token", "maybe"), ("max_batch_tokens", 8), ("prefix_cache_mb", -1.0), ("kv_cache", "maybe"),
       ("kv_pool_mb", 0.0), ("dtype", "int8"), ("layout", "not-a-layout"), ("kernels", "bogus"),
       ("batch_invariant", "maybe")]


@pytest.mark.parametrize("key, value", list(metadata_cases()) + OWN)
def test_a_bad_model_arg_names_its_key_before_the_load(key, value):
    with pytest.raises(ModelArgsError) as e:
        MoejaxLM.create_from_arg_string(f"pretrained=pycode-moe,{key}={value}", HARNESS)
    assert key in e.value.detail and "\n" not in str(e.value), e.value.detail
    assert not e.value.detail.startswith("moejax.load"), e.value.detail


def test_an_unknown_key_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="unknown colour"):
        MoejaxLM.create_from_arg_string("pretrained=pycode-moe,colour=blue", HARNESS)


@pytest.mark.slow
@pytest.mark.parametrize("model_args, key", [("colour=blue", "colour"), ("placement=bogus", "placement"),
                                             ("max_length=0", "max_length"), ("prefetch_depth=0", "prefetch_depth")])
def test_the_cli_prints_one_line_without_a_traceback(model_args, key, tmp_path):
    r = subprocess.run([sys.executable, "-m", "moejax.eval", "--model", "moejax", "--model_args",
                        f"pretrained=pycode-moe,{model_args}", "--tasks", "moejax_mc_greedy", "--include_path", DATA,
                        "--limit", "1",
                        "--output_path", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("python -m moejax.eval: --model_args: ") and key in last, last
    assert os.listdir(tmp_path) == []
