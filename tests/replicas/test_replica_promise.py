"""The README's promise for engine replicas is the one tests/replicas/test_replicas.py checks: one engine's results in
float32; in bfloat16 a request's last bits follow its batch, so it must not promise the same texts there."""
import os
import re

README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")


def test_readme_states_what_replicas_give_in_each_dtype():
    with open(README, encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("### Engine replicas"):]
    section = " ".join(section[: section.index("\n### ", 1)].split())
    assert not re.search(r"Results are one engine's: the same tokens and texts", section)  # no unconditional promise
    assert "In float32 the results are one engine's: the same tokens and texts" in section
    assert re.search(r"In bfloat16 they are not: a request's last bits follow the batch it is packed in.*greedy text "
                     r"can diverge", section)
    assert "batch-invariant mode" in section
