"""python -m moejax.eval: lm-eval's own command line (`lm_eval ARGS`) with `--model moejax` registered.

lm-eval finds models only in its own registry (lm_eval.models.MODEL_MAPPING, no entry points), so the plain
`lm_eval` command cannot see a model another package defines; this imports moejax's first and then runs lm-eval's
CLI unchanged (same arguments, same output)."""
import sys

try:  # lm-evaluation-harness is the optional extra moejax[eval]; lm_eval_model registers "moejax" in its registry
    from lm_eval.__main__ import cli_evaluate

    from moejax.eval.lm_eval_model import ModelArgsError
    MISSING: ImportError | None = None
except ImportError as e:
    MISSING = e


def main() -> None:
    if MISSING is not None:
        sys.exit(f"python -m moejax.eval needs lm-evaluation-harness: pip install 'moejax[eval]' ({MISSING})")
    try:
        cli_evaluate()
    except ModelArgsError as e:  # the user's --model_args: one line naming the key, exit status 2 as argparse's
        print(f"python -m moejax.eval: --model_args: {e.detail}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
