"""Orbax checkpoints of a training run: parameters, optimizer state, and the run's position (step, which fixes
the data position since batches depend only on (seed, step), tokens seen, wall seconds). Saves are atomic (a
run killed mid-save leaves the previous checkpoint intact); the two newest are kept."""
from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


class RunCheckpoints:
    def __init__(self, directory: str):
        self.manager = ocp.CheckpointManager(
            os.path.abspath(directory), options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True),
            item_names=("state", "position"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: dict, position: dict) -> None:
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        position=ocp.args.JsonSave(position)))
        self.manager.wait_until_finished()

    def restore(self, step: int, like: dict) -> tuple[dict, dict]:
        """-> (state shaped like `like`, position)."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                 position=ocp.args.JsonRestore()))
        return out.state, out.position

    def params_at(self, step: int | None = None) -> tuple[dict, dict]:
        """(parameters, position) of the checkpoint at `step` (default: the newest), without a template."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"{self.manager.directory}: no checkpoint")
        out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(),
                                                                 position=ocp.args.JsonRestore()))
        return out.state["params"], out.position

    def close(self) -> None:
        self.manager.close()
