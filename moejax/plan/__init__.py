"""Plans are data (docs/design.md): pure functions from a model config, a workload and a hardware profile to the
configuration a planner chooses, with the predicted times behind the choice. No devices are needed."""
