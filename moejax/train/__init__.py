"""Training moejax's embedded model: the corpus, the tokenizer, and (to come) the optax loop."""
