"""Delayed scaling (core.fp8.scaling) against Transformer Engine's update rules, on a fixed
sequence of amaxes whose expected histories and scales are worked out by hand below."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from core.fp8 import FLT_MAX, FP8Config, delayed_update, init_delayed_state, reduce_amax

INF = np.inf
# One step per row: the step's (reduced) amax, fed to all three slots.
AMAXES = [2.0, 8.0, 1.0, 0.0, 0.5, INF, 1.5e-38, 4.0, 4.0]
# History length 3, margin 1: scaled max 448/2 = 224 for x and w (E4M3), 57344/2 = 28672 for dy
# (E5M2 under hybrid). TE's rules: a nonzero amax rolls the history (slot i <- i+1, last <- amax,
# slot 0 <- 0); amax 0 leaves it (the history's slot 0, also 0, is the "last" amax); most_recent
# uses the step's amax, max the maximum of the rolled window; 0/inf/nan keep the previous scale;
# an overflowing scale (224 / 1.5e-38) becomes FLT_MAX.
HISTORIES = [
    [0, 0, 2],        # roll in 2
    [0, 2, 8],        # roll in 8
    [0, 8, 1],        # roll in 1 (window before zeroing slot 0: 2, 8, 1)
    [0, 8, 1],        # amax 0: unchanged
    [0, 1, 0.5],      # window 8, 1, 0.5
    [0, 0.5, INF],    # window 1, 0.5, inf
    [0, INF, 1.5e-38],
    [0, 1.5e-38, 4],  # window inf, 1.5e-38, 4
    [0, 4, 4],        # window 1.5e-38, 4, 4
]
# The amax each algorithm uses per step, and the resulting x/w scales (224 / amax) and dy scales (28672 / amax).
MOST_RECENT_X = [112, 28, 224, 224, 448, 448, FLT_MAX, 56, 56]        # steps 4, 6 keep; step 7 overflows
MOST_RECENT_DY = [14336, 3584, 28672, 28672, 57344, 57344, FLT_MAX, 7168, 7168]
MAX_X = [112, 28, 28, 28, 28, 28, 28, 28, 56]                  # window max 8 through step 5; inf keeps 28
MAX_DY = [14336, 3584, 3584, 3584, 3584, 3584, 3584, 3584, 7168]


@pytest.mark.parametrize("algo,expected_x,expected_dy", [("most_recent", MOST_RECENT_X, MOST_RECENT_DY),
                                                         ("max", MAX_X, MAX_DY)])
def test_delayed_update_golden(algo, expected_x, expected_dy):
    config = FP8Config(fp8="hybrid", fp8_recipe="delayed", fp8_margin=1, fp8_amax_history_len=3,
                       fp8_amax_compute_algo=algo)
    state = init_delayed_state(config)
    update = jax.jit(lambda s, a: delayed_update(s, a, config))
    for step, amax in enumerate(AMAXES):
        state = update(state, jnp.full(3, amax, jnp.float32))
        history = np.asarray(state["amax_history"])
        for slot in range(3):
            np.testing.assert_array_equal(history[:, slot], np.array(HISTORIES[step], np.float32), err_msg=f"{step}")
        scale = np.asarray(state["scale"])
        want = np.array([expected_x[step], expected_x[step], expected_dy[step]], np.float32)
        np.testing.assert_allclose(scale, want, rtol=1e-7, err_msg=f"step {step}")


def test_history_of_one_keeps_slot_zero_empty_and_uses_the_step_amax():
    config = FP8Config(fp8="e4m3", fp8_recipe="delayed", fp8_amax_compute_algo="max")
    state = init_delayed_state(config, (2,))  # a stack of two layers
    state = delayed_update(state, jnp.array([[1.0, 2.0, 4.0], [8.0, 0.0, 16.0]]), config)
    np.testing.assert_array_equal(state["amax_history"], np.zeros((2, 1, 3)))
    np.testing.assert_allclose(state["scale"], [[448, 224, 112], [56, 1, 28]])


def test_nan_amax_keeps_the_scale_and_max_skips_it():
    config = FP8Config(fp8="e4m3", fp8_recipe="delayed", fp8_amax_history_len=2, fp8_amax_compute_algo="max")
    state = delayed_update(init_delayed_state(config), jnp.full(3, 4.0), config)
    state = delayed_update(state, jnp.full(3, jnp.nan), config)
    # Window (4, nan): fmaxf skips the NaN, so max uses 4; most_recent would keep the scale.
    np.testing.assert_allclose(state["scale"], [112, 112, 112])
    recent = FP8Config(fp8="e4m3", fp8_recipe="delayed", fp8_amax_history_len=2)
    state = delayed_update(delayed_update(init_delayed_state(recent), jnp.full(3, 2.0), recent),
                           jnp.full(3, jnp.nan), recent)
    np.testing.assert_allclose(state["scale"], [224, 224, 224])


def test_amax_reduces_with_max_over_the_sharing_axes():
    """Each rank's amax is its index; the reduction over ("dp", "tp") gives every rank of a
    pipeline stage the stage's maximum, and stages keep their own (pp does not share)."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("pp", "dp", "tp"))
    local = jnp.arange(8, dtype=jnp.float32).reshape(2, 2, 2, 1) * jnp.ones(3)

    def body(a):
        return reduce_amax(a, ("dp", "tp"))

    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("pp", "dp", "tp"), out_specs=P("pp", "dp", "tp")))(local)
    np.testing.assert_array_equal(out[0], np.full((2, 2, 3), 3.0))
    np.testing.assert_array_equal(out[1], np.full((2, 2, 3), 7.0))


def test_config_validation():
    for bad in ({"fp8": "e5m2"}, {"fp8_recipe": "mxfp8"}, {"fp8_amax_compute_algo": "mean"},
                {"fp8_amax_history_len": 0}):
        with pytest.raises(ValueError):
            FP8Config(**{"fp8": "hybrid", **bad})
    assert not FP8Config().enabled and FP8Config(fp8="e4m3").delayed
    assert FP8Config(fp8="hybrid").slot_maxes() == (448.0, 448.0, 57344.0)
    assert FP8Config(fp8="e4m3").slot_maxes() == (448.0, 448.0, 448.0)
