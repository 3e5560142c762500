"""`python -m launch.profile`: the same command as `python -m launch.profile_devices` (its docstring says what it
measures; `--dep` adds DEP's task fits)."""
import sys

from launch.profile_devices import main

if __name__ == "__main__":
    sys.exit(main())
