"""The commands a user runs, one module each (`python -m launch.<name>`): serve, bench (the benchmarks, a package),
plan, profile and profile_devices, calibrate, distill, train, gpu_check with gpu_env and gpu_ceilings, tune_gmm and
dispatch_probe. What they share lives in the package (moejax.serving: serve's engine, options and paths)."""
