"""A small decoder-only byte-level transformer in Flax nnx, and its per-token loss.

Pre-LayerNorm blocks of causal self-attention and a GELU MLP, learned position
embeddings, untied output head. Dropout is keyed explicitly: ``model(tokens,
rng)`` with ``rng=None`` is deterministic, a key turns dropout on.

Every weight carries Megatron-style tensor-parallel metadata over the mesh
axis :data:`MODEL_AXIS` (``nnx.with_partitioning``; Shoeybi et al., 2019):
the fused q/k/v projection and the MLP's first layer are column-split (the
attention heads and the hidden units over ``"model"``), the attention output
projection and the MLP's second layer row-split, the token embedding and the
output head split over the vocabulary; LayerNorms, the position embedding and
the row-split layers' biases are replicated. ``jaxdp.adapters.nnx.partition_specs``
reads these off as ``init_state``'s ``param_specs``; on a mesh without a
``"model"`` axis they are simply not passed, and the model is the same.
The annotations change no value: the initial params are the same with or
without them.

``scan_layers=True`` stacks the blocks on a leading layer axis (``nnx.vmap``
over ``nnx.split_rngs``, so each layer draws its own weights; the stack's
axis is added to the partitioning metadata unsplit) and runs them with
``nnx.scan``; the loop body is rematerialised under
``jaxdp.sharding.layerwise.gather_policy()`` and calls ``jaxdp.adapters.nnx.gather`` on its layer, so at
ZeRO stage 3 with the layout ``jaxdp.data_parallel(mesh, zero_stage=3, layers=STACK)`` a layer's parameters are all-gathered
inside the loop and dropped after use (layer-wise stage 3). Dropout keys are
split per layer and scanned with the stack, as the list of blocks splits
them: with the same weights (:func:`stack_blocks`) the two models compute
the same function.

``functional_scan=True`` (with ``scan_layers``) runs the stack through
``jaxdp.scan_layers`` instead, as a pipelined step needs: the stacked Block
is split into its graph definition and its state, and the loop body merges
one layer's state back into a Block (``f(x, layer, key)``). Outside a
pipelined step that is ``lax.scan``, the same function as ``nnx.scan``. In
a pipelined step each microbatch runs a layer with that layer's dropout key,
so the microbatches of one step share their masks' key (each draws a mask of
its own shape from it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.nnx.nn import linear

import jaxdp

VOCAB = 256  # bytes
MODEL_AXIS = "model"

_M = MODEL_AXIS
_kernel, _zeros = linear.default_kernel_init, nnx.initializers.zeros_init()  # nnx.Linear's own defaults


def _split(init, *spec):
  """``init`` with tensor-parallel metadata: the value's dimensions split over ``spec``'s mesh axes."""
  return nnx.with_partitioning(init, spec)


class Block(nnx.Module):
  """``x + Drop(Attn(LN(x)))``, then ``x + Drop(MLP(LN(x)))``."""

  def __init__(self, d_model: int, heads: int, d_ff: int, dropout: float, *, rngs: nnx.Rngs):
    if d_model % heads:
      raise ValueError(f"d_model={d_model} is not a multiple of heads={heads}")
    self.heads = heads
    self.ln1, self.ln2 = nnx.LayerNorm(d_model, rngs=rngs), nnx.LayerNorm(d_model, rngs=rngs)
    # No qkv bias: a key bias cancels in the softmax, so its gradient is zero up to round-off,
    # which Adam would blow up to steps of size lr (noise, not learning).
    # The fused projection's kernel is [d_model, 3, heads, head_dim] (drawn as [d_model, 3 * d_model], then
    # reshaped), so that splitting its heads dimension gives every "model" device whole heads of q, k and v.
    self.qkv = nnx.LinearGeneral(
        d_model, (3, heads, d_model // heads), use_bias=False, kernel_init=_split(_kernel, None, None, _M, None),
        rngs=rngs,
    )
    self.proj = nnx.Linear(d_model, d_model, kernel_init=_split(_kernel, _M, None), rngs=rngs)  # row-split
    self.up = nnx.Linear(d_model, d_ff, kernel_init=_split(_kernel, None, _M), bias_init=_split(_zeros, _M), rngs=rngs)
    self.down = nnx.Linear(d_ff, d_model, kernel_init=_split(_kernel, _M, None), rngs=rngs)  # row-split
    self.drop = nnx.Dropout(dropout)

  def attend(self, x_BxTxD: jax.Array) -> jax.Array:
    b, t, d = x_BxTxD.shape
    qkv_BxTx3xNxH = self.qkv(x_BxTxD)
    q, k, v = (qkv_BxTx3xNxH[:, :, i] for i in range(3))
    return self.proj(jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d))

  def __call__(self, x_BxTxD: jax.Array, rng: jax.Array | None) -> jax.Array:
    keys = (None, None) if rng is None else tuple(jax.random.split(rng))
    off = rng is None
    x_BxTxD = x_BxTxD + self.drop(self.attend(self.ln1(x_BxTxD)), deterministic=off, rngs=keys[0])
    mlp = self.down(jax.nn.gelu(self.up(self.ln2(x_BxTxD))))
    return x_BxTxD + self.drop(mlp, deterministic=off, rngs=keys[1])


STACK = "blocks"
"""The key of the blocks in the params: with ``scan_layers`` the stack that the layout's ``layers=`` names."""


def _scan_blocks(x_BxTxD: jax.Array, stack: Block, keys: jax.Array | None) -> jax.Array:
  """``x`` through every layer of ``stack`` (an ``nnx.vmap``-made :class:`Block`), one ``nnx.scan`` iteration each.

  The body is rematerialised with ``jaxdp.sharding.layerwise.gather_policy()`` (FSDP2's ``reshard_after_forward=True``): at
  layer-wise stage 3 the gathered layer is dropped after its forward use and gathered again for the backward.
  """
  if keys is None:
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    @nnx.remat(policy=jaxdp.sharding.layerwise.gather_policy())
    def run(x, block):
      return jaxdp.adapters.nnx.gather(block)(x, None)

    return run(x_BxTxD, stack)

  @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=nnx.Carry)
  @nnx.remat(policy=jaxdp.sharding.layerwise.gather_policy())
  def run_keyed(x, block, key):
    return jaxdp.adapters.nnx.gather(block)(x, key)

  return run_keyed(x_BxTxD, stack, keys)


def _scan_layers_blocks(x_BxTxD: jax.Array, stack: Block, keys: jax.Array | None) -> jax.Array:
  """``x`` through every layer of ``stack`` with ``jaxdp.scan_layers`` (a pipeline in a pipelined step)."""
  graphdef, layers = nnx.split(stack)

  def f(x, layer, key):
    return nnx.merge(graphdef, layer)(x, key), None

  x_BxTxD, _ = jaxdp.scan_layers(f, x_BxTxD, layers, xs=keys)
  return x_BxTxD


class Transformer(nnx.Module):
  """Byte tokens ``[B, T]`` to next-byte logits ``[B, T, 256]``; ``scan_layers``: the blocks stacked and scanned.

  ``functional_scan``: the stacked blocks run through ``jaxdp.scan_layers`` (needs ``scan_layers``).
  """

  def __init__(self, *, seq_len: int, layers: int, d_model: int, heads: int, d_ff: int, dropout: float, rngs: nnx.Rngs,
               scan_layers: bool = False, functional_scan: bool = False):
    if functional_scan and not scan_layers:
      raise ValueError("functional_scan=True runs the stacked blocks: it needs scan_layers=True.")
    self.embed = nnx.Embed(VOCAB, d_model, embedding_init=_split(linear.default_embed_init, _M, None), rngs=rngs)
    self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq_len, d_model)))
    self.scan_layers = scan_layers
    self.functional_scan = functional_scan
    if scan_layers:
      # One Block per layer on a leading axis, each from its own split of the params stream; the partitioning
      # metadata gets the layer axis, unsplit (None), so the tensor-parallel specs keep naming one layer's dims.
      @nnx.split_rngs(splits=layers)
      @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
      def stack(rngs: nnx.Rngs) -> Block:
        return Block(d_model, heads, d_ff, dropout, rngs=rngs)

      self.blocks = stack(rngs)
    else:
      self.blocks = nnx.List([Block(d_model, heads, d_ff, dropout, rngs=rngs) for _ in range(layers)])
    self.layers = layers
    self.ln = nnx.LayerNorm(d_model, rngs=rngs)
    self.head = nnx.Linear(d_model, VOCAB, kernel_init=_split(_kernel, None, _M), bias_init=_split(_zeros, _M), rngs=rngs)

  def __call__(self, tokens_BxT: jax.Array, rng: jax.Array | None = None) -> jax.Array:
    t = tokens_BxT.shape[1]
    x_BxTxD = self.embed(tokens_BxT) + self.pos[None, :t]
    if self.scan_layers:
      run = _scan_layers_blocks if self.functional_scan else _scan_blocks
      x_BxTxD = run(x_BxTxD, self.blocks, None if rng is None else jax.random.split(rng, self.layers))
      return self.head(self.ln(x_BxTxD))
    keys = [None] * len(self.blocks) if rng is None else list(jax.random.split(rng, len(self.blocks)))
    for block, key in zip(self.blocks, keys):
      x_BxTxD = block(x_BxTxD, key)
    return self.head(self.ln(x_BxTxD))


def make_model(*, seed: int, scan_layers: bool = False, functional_scan: bool = False,
               **sizes) -> tuple[jaxdp.adapters.nnx.Definition, nnx.State]:
  """``(definition, params)`` of a :class:`Transformer` initialised from ``seed``, split by ``jaxdp.adapters.nnx``.

  The params are ordinary (unsharded) arrays that keep their partitioning
  metadata: built without eager sharding, so no mesh is needed here and
  every layout starts from the same values; ``jaxdp.adapters.nnx.partition_specs(params)``
  gives the tensor-parallel specs. The model has no model state (LayerNorm,
  no BatchNorm) and no stored RNG streams (its dropout is keyed explicitly),
  so ``params`` is all there is.
  """
  with nnx.use_eager_sharding(False):
    model = Transformer(**sizes, rngs=nnx.Rngs(seed), scan_layers=scan_layers, functional_scan=functional_scan)
  definition, params, model_state = jaxdp.adapters.nnx.split(model)
  assert model_state is None, "the transformer has no model state"
  return definition, params


def stack_blocks(params: nnx.State) -> nnx.State:
  """The params of the list-of-blocks model laid out for ``scan_layers=True``: each block leaf stacked over the layers.

  The stacked model built from the same seed draws other weights (``nnx.split_rngs`` keys); with these it is
  the same function as the list model (the layer axis is added to the partitioning metadata, unsplit).
  """
  raw = params.raw_mapping
  layers = [raw[STACK][i] for i in sorted(raw[STACK])]

  def stack(*variables):
    first = variables[0]
    sharding = first.get_metadata().get("out_sharding")  # nnx.with_partitioning's spec: gets the layer axis
    extra = {} if sharding is None else {"out_sharding": (None, *sharding)}
    return first.replace(jnp.stack([v.get_value() for v in variables]), **extra)

  stacked = jax.tree.map(stack, *layers, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.State({**raw, STACK: stacked})


def next_byte_loss(model: Transformer, batch: dict, *, rngs: nnx.Rngs | None, train: bool):
  """Per-token cross-entropy and next-byte accuracy ``[b, t]``; dropout on in training when a key is given."""
  key = rngs() if (train and rngs is not None) else None
  logits_BxTxV = model(batch["inputs"], key).astype(jnp.float32)
  losses_BxT = optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, batch["targets"])
  return losses_BxT, {"accuracy": (jnp.argmax(logits_BxTxV, -1) == batch["targets"]).astype(jnp.float32)}


def make_loss_fn(definition: jaxdp.adapters.nnx.Definition):
  """jaxdp's ``loss_fn(params, batch, rng=None, ...)`` of the model: per-token losses and accuracy."""
  return jaxdp.adapters.nnx.loss_fn(definition, next_byte_loss)
