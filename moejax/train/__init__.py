"""Training moejax's embedded model (issue 16): the corpus, the tokenizer, and (to come) the optax loop."""
