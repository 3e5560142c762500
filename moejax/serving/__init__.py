"""What `python -m launch.serve` runs: the engine its flags load, its model and process options, the output paths it
checks before loading, the run over replicas, and the XLA settings read when JAX starts."""
