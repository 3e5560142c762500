"""Measurements on the devices present for the planners: the hardware profile (hardware), the quick profile measured
at load when none exists (quick_profile), and DEP's task micro-benchmarks (dep)."""
