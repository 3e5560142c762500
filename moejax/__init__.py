"""moejax: serve Mixture-of-Experts language models with JAX."""
from moejax.config import ConfigError, ModelConfig
from moejax.engine import Engine
from moejax.loading import load, presets
from moejax.models.checkpoint import CheckpointError
from moejax.sampling import SamplingParams

__all__ = ["CheckpointError", "ConfigError", "Engine", "ModelConfig", "SamplingParams", "load", "presets"]
__version__ = "0.1.0"
