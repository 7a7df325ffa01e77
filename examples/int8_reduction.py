"""A reduction of your own: an int8 all-reduce with per-block scales and error feedback (1 byte per element).

Each block of 256 gradient sums shares one scale, the largest magnitude over the replicas (a small all-reduce
of floats) divided by 127 // N, so that the int8 sum of the N replicas' quantised blocks cannot overflow. What
quantisation loses stays in this replica's error feedback and is sent with the next step's gradient.
"""
import jax
import jax.numpy as jnp

import jaxdp


def int8_allreduce(block: int = 256) -> jaxdp.reductions.Reduction:
  def init(params, layout):  # one replica's state; jaxdp keeps a copy per replica
    return jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)

  def one_leaf(g, error, axis_name):
    x = g + error
    flat = jnp.pad(x.reshape(-1), (0, -x.size % block)).reshape(-1, block)
    levels = 127 // jax.lax.psum(1, axis_name)  # N replicas' values sum within int8
    scale = jax.lax.pmax(jnp.max(jnp.abs(flat), axis=1, keepdims=True), axis_name) / levels
    q = jnp.round(flat / jnp.where(scale > 0, scale, 1)).astype(jnp.int8)
    unflat = lambda b: b.reshape(-1)[: x.size].reshape(x.shape)  # noqa: E731
    total = jax.lax.psum(q, axis_name).astype(jnp.float32) * scale
    return unflat(total), x - unflat(q.astype(jnp.float32) * scale)

  def reduce(sums, state, axis_name):
    pairs = jax.tree.map(lambda g, e: one_leaf(g, e, axis_name), sums, state)
    summed = jax.tree.map(lambda _, pair: pair[0], sums, pairs)
    return summed, jax.tree.map(lambda _, pair: pair[1], sums, pairs)

  return jaxdp.reductions.Reduction(init, reduce)


if __name__ == "__main__":
  import numpy as np
  import optax

  mesh = jaxdp.data_mesh()
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 3)).astype(np.float32)
  data = {"x": x, "y": x @ np.array([1.0, -2.0, 0.5], np.float32)}

  def loss_fn(params, batch):
    return 0.5 * (batch["x"] @ params["w"] - batch["y"]) ** 2

  opt, reduction = optax.sgd(0.1), int8_allreduce()
  state = jaxdp.init_state({"w": jnp.zeros(3)}, opt, mesh, reduction=reduction)
  step = jaxdp.make_train_step(loss_fn, opt, mesh, reduction=reduction)
  batch, weights = jaxdp.split_batch(data, mesh)
  for _ in range(50):
    state, metrics = step(state, batch, weights)
  print(f"loss {float(metrics['loss']):.2e}, w = {np.round(np.asarray(state.params['w']), 3)}")
