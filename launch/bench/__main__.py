"""`python -m launch.bench <command> ...`: launch/bench/cli.py."""
from launch.bench.cli import main

main()
