"""Small models and single-device references shared by the DDP tests (both levels)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from core.optimizer.clip_grads import clip_coefficient
from core.optimizer.optimizer_config import OptimizerConfig


class MLP(nn.Module):
    """A few dense layers (weights and biases), names sorting in forward order."""

    features: tuple[int, ...] = (16, 32, 24, 4)

    @nn.compact
    def __call__(self, x):
        for i, f in enumerate(self.features):
            x = nn.Dense(f, name=f"layer_{i:02d}")(x)
            if i < len(self.features) - 1:
                x = jnp.tanh(x)
        return x


def mse_loss(module):
    """Mean squared error of ``module`` on a (x, y) microbatch."""

    def loss(params, batch):
        x, y = batch
        return jnp.mean((module.apply({"params": params["params"]}, x) - y) ** 2)

    return loss


def make_batch(global_batch, in_dim=8, out_dim=4, seed=0):
    """A deterministic regression batch."""
    rng = np.random.default_rng(seed)
    return rng.normal(size=(global_batch, in_dim)).astype(np.float32), rng.normal(size=(global_batch, out_dim)).astype(np.float32)


def reference_tx(config: OptimizerConfig, params):
    """The single-device optax optimizer equal to the package's chain for ``config``."""
    mask = jax.tree.map(lambda p: p.ndim > 1, params)
    if config.optimizer == "adam":
        return optax.adamw(config.lr, config.adam_beta1, config.adam_beta2, config.adam_eps,
                           weight_decay=config.weight_decay, mask=mask)
    inner = optax.trace(decay=config.sgd_momentum) if config.sgd_momentum else optax.identity()
    return optax.chain(inner, optax.add_decayed_weights(config.weight_decay, mask), optax.scale_by_learning_rate(config.lr))


def reference_train(module, params, batches, config: OptimizerConfig):
    """Plain single-device training on whole global batches; returns params and losses."""
    loss_fn = mse_loss(module)
    tx = reference_tx(config, params)

    @jax.jit
    def step(params, opt, batch):
        loss, g = jax.value_and_grad(loss_fn)(params, batch)
        if config.clip_grad:
            coef = clip_coefficient(optax.tree.norm(g), config.clip_grad)
            g = jax.tree.map(lambda x: x * coef, g)
        updates, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    opt = tx.init(params)
    losses = []
    for batch in batches:
        params, opt, loss = step(params, opt, batch)
        losses.append(float(loss))
    return params, losses
