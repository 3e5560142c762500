"""docs/replicas.md's promise for engine replicas is the one tests/replicas/test_replicas.py checks: one engine's
results in float32; in bfloat16 a request's last bits follow its batch, so it must not promise the same texts there."""
import os
import re

PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs",
                    "replicas.md")


def test_docs_state_what_replicas_give_in_each_dtype():
    with open(PAGE, encoding="utf-8") as f:
        text = f.read()
    section = " ".join(text[text.index("# Engine replicas"):].split())
    assert not re.search(r"Results are one engine's: the same tokens and texts", section)  # no unconditional promise
    assert "In float32 the results are one engine's: the same tokens and texts" in section
    assert re.search(r"In bfloat16 they are not: a request's last bits follow the batch it is packed in.*greedy text "
                     r"can diverge", section)
    assert "batch-invariant mode" in section
