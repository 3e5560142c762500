"""Expert predictors for the cached placement: `(pass, layer, residual, MoE input, true expert ids, weights)` ->
{target layer: (predicted expert ids [N, k], predicted weights [N, k])}.

- `router` (Speculating Experts §3): layer l+d's router applied to the quasi-hidden state
  norm_{l+1}(r_l + Σ_e g_e·d_{l,e}), chained d layers ahead, with default vectors d from `calibrate`.
- `estimator` / `hybrid` (§6.3): a distilled network from the quasi-hidden state to layer l+d's router logits, at
  every layer (Est-PF) or where the router predictor measured poorly (Hybrid-PF); `launch.distill` trains it.
- `expert_map` (fMoE §4): per-iteration gate distributions found for each request by semantic then trajectory
  search on a matcher thread, a similarity-aware number of experts per layer; `launch.calibrate --maps` builds
  the store.
- `moe_infinity` (MoE-Infinity, fMoE's baseline): request-level expert activation matrices collected while serving,
  a request matched to the most similar by cosine and the match's most used experts ahead prefetched
  (`activation_matrices`).
- `previous_hidden` (§3.3's baseline): layer l's router input fed to layer l+d's router.
- `oracle`: the true router of the layer itself (distance 0); the reference a speculative run must match.
- `lookahead.LookAheadOracle` (an object, not a name: it needs a trace): layer l+1's true experts at layer l, from a
  `RoutingRecorder` trace of the same requests; the bound of any layer-ahead predictor.

`traces` records what predictors are trained and measured on; `replay` measures them on it."""
from moejax.offload.predict.baselines import PreviousHiddenPredictor
from moejax.offload.predict.estimator import EstimatorNet
from moejax.offload.predict.learned import EstimatorPredictor, HybridPredictor
from moejax.offload.predict.oracle import OraclePredictor
from moejax.offload.predict.router import DefaultVectors, RouterPredictor, calibrate

PREDICTORS = ("router", "estimator", "hybrid", "expert_map", "moe_infinity", "previous_hidden", "oracle")

__all__ = ["PREDICTORS", "DefaultVectors", "EstimatorNet", "EstimatorPredictor", "HybridPredictor", "OraclePredictor",
           "PreviousHiddenPredictor", "RouterPredictor", "calibrate"]
