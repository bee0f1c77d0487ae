"""A toy pipeline stage shared by the executor tests: ``H``-wide tanh stages with a tied shared
matrix, per-stage metrics and a max-combined leaf."""

import jax
import jax.numpy as jnp

H, MB = 4, 2
"""Hidden width and microbatch rows of the toy stages."""


def toy_stage_step(p, shared, d, received, vs, last):
    """Stage 0 embeds with the shared matrix, the last stage's loss uses it again (tied); every
    stage reports its output's sum; the chunk's ``amax`` leaf receives a max-combined cotangent;
    stages differ by their virtual-stage index too (``0.1 * vs``), so a misplaced chunk shows."""
    chunk, amax = p
    x = jnp.where(vs == 0, d["x"] @ shared["emb"], received)
    y = jnp.tanh(x @ chunk["w"] + chunk["b"] + 0.1 * vs) * amax
    loss = jnp.where(vs == last, jnp.mean((y @ shared["emb"].T - d["t"]) ** 2), 0.0)
    metrics = {"sum": jax.lax.stop_gradient(jnp.sum(y))}
    return y, (loss, {"loss": loss}), metrics
