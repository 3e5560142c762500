"""Expert predictors for the cached placement: `(pass, layer, residual, MoE input, true expert ids, weights)` ->
{target layer: (predicted expert ids [N, k], predicted weights [N, k])}.

- `router` (Speculating Experts §3): layer l+d's router applied to the quasi-hidden state
  norm_{l+1}(r_l + Σ_e g_e·d_{l,e}), chained d layers ahead, with default vectors d from `calibrate`.
- `oracle`: the true router of the layer itself (distance 0); the reference a speculative run must match."""
from moejax.offload.predict.oracle import OraclePredictor
from moejax.offload.predict.router import DefaultVectors, RouterPredictor, calibrate

PREDICTORS = ("router", "oracle")

__all__ = ["PREDICTORS", "DefaultVectors", "OraclePredictor", "RouterPredictor", "calibrate"]
