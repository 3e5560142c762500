"""python -m moejax.eval: lm-eval's own command line (`lm_eval ARGS`) with `--model moejax` registered.

lm-eval finds models only in its own registry (lm_eval.models.MODEL_MAPPING, no entry points), so the plain
`lm_eval` command cannot see a model another package defines; this imports moejax's first and then runs lm-eval's
CLI unchanged (same arguments, same output)."""
import sys


def main() -> None:
    try:
        import moejax.eval.lm_eval_model  # noqa: F401  (registers "moejax" in lm-eval's model registry)
        from lm_eval.__main__ import cli_evaluate
    except ImportError as e:
        sys.exit(f"python -m moejax.eval needs lm-evaluation-harness: pip install 'moejax[eval]' ({e})")
    cli_evaluate()


if __name__ == "__main__":
    main()
