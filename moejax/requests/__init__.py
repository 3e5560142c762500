"""Request formats: JSONL request lines (the OpenAI batch envelope) parsed and checked field by field, the response
bodies clients parse, tokens as text, and the crash-safe, input-ordered results file with its lock."""
