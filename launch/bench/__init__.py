"""The benchmarks of `python -m launch.bench <command> ...`: the commands and their flags (cli.py), one module per
command, and what they share (results files, timing, workloads, plots). Each run is appended as JSON to
bench/results/."""
