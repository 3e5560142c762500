"""Evaluation clients on the Engine, in-process. `moejax.eval.lm_eval_model` is lm-evaluation-harness's
`--model moejax` (the optional extra `moejax[eval]`); nothing here imports lm-eval until that module is imported.
`python -m moejax.eval ARGS` is lm-eval's CLI with the model registered."""
