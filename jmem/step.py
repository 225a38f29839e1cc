"""One training step for Flax linen and Flax NNX models, below the training loop.

::

  init, step = jmem.train_step(model, optax.adam(1e-3), loss_fn=loss_fn)  # jmem.train_step
  state = init(jax.random.key(0), x)
  state, metrics = step(state, x, y)

A model of either API is turned into a pair of pure functions (`ModelFns`), so the loss, the
step, the loop (`jmem.train`), the planner (`jmem.plan`), the bench and the memory
measurements in `jmem.measure` are written once. This module holds that adapter, the train
state, the loss (integer-label cross-entropy, or your ``loss_fn``) and the jit-compiled
step, and how a batch is laid out on a mesh; the loop with its checkpoints is `jmem.train`,
which imports this module (never the reverse).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jmem import _bn_core as bn_core
from jmem import _context as context
from jmem import measure

__all__ = [
    "ModelFns", "TrainState", "model_fns", "init_state", "abstract_state", "check_batch",
    "make_loss", "make_train_step", "default_optimizer", "check_learning_rate", "takes_train",
    "mode_kwargs",
    "padded_size", "global_batch", "per_example_losses", "LossFn", "TrainStep", "train_step",
]


class ModelFns(NamedTuple):
  """A model as pure functions.

  Attributes:
    init: ``(key, x) -> (params, model_state)``.
    apply: ``(params, model_state, x, *, train, rng) -> (outputs, new_model_state)``
      (outputs: the logits of a classifier); ``rng``: the step's key, from which every
      stream the model draws from is made (`jmem.rngs`; None: no keys, as inference
      needs).
    module: the original linen module or NNX graph definition (for reference).
    sharding: the `jax.sharding.Sharding` of every leaf of the training state (e.g.
      replicated over a mesh), or None (the default device). `jmem.train.train` and
      `train_step` put the initial state
      there, where the step leaves it, so that the step compiles once.
    batch_sharding: the `jax.sharding.NamedSharding` of a batch's inputs ``x`` on that mesh
      (e.g. ``P("data")``: data parallel), or None (the default device). The labels and the
      validity mask take the partitioning of its first axis. With it, `jmem.train.train`
      and `jmem.train.evaluate`
      build every batch as a global array from the rows each process holds, and pad (and
      mask) a batch that the data axis does not divide.

  ``apply`` also takes ``mask=`` (boolean ``[N]``, True = a real example) in training when a
  batch is padded; the models `model_fns` makes pass it to their BatchNorm layers
  (`jmem.batch_mask`), and refuse a BatchNorm that would ignore it.
  """

  init: Callable[..., tuple[Any, Any]]
  apply: Callable[..., tuple[jax.Array, Any]]
  module: Any
  sharding: Any = None
  batch_sharding: Any = None


# The keyword a model's __call__ takes for its mode -> its value in training: ``train`` and
# its spellings, or Flax's ``deterministic`` (dropout's), the other way round.
MODE_KEYWORDS = {"train": True, "training": True, "is_training": True, "deterministic": False}


def mode_keyword(module: nn.Module) -> str | None:
  """The keyword of `MODE_KEYWORDS` that ``module``'s ``__call__`` takes (None: none; a
  model whose mode is a field, ``UNet(train=True)``, is called without one). A wrapper that
  forwards ``**kwargs`` (`jmem.convert`'s) is asked about the model it wraps; ``**kwargs``
  alone takes ``train``."""
  while True:
    try:
      params = inspect.signature(module.__call__).parameters
    except (TypeError, ValueError):
      return "train"
    for name in MODE_KEYWORDS:
      if name in params:
        return name
    inner = getattr(module, "model", None)
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if var_kw and isinstance(inner, nn.Module):
      module = inner
      continue
    return "train" if var_kw else None


def mode_kwargs(module: nn.Module, train: bool) -> dict[str, bool]:
  """The keyword argument that puts ``module`` in training (``train``) or evaluation mode:
  ``{"train": train}``, ``{"deterministic": not train}``, ... or {} (`mode_keyword`)."""
  name = mode_keyword(module)
  return {} if name is None else {name: train if MODE_KEYWORDS[name] else not train}


def takes_train(module: nn.Module) -> bool:
  """Whether ``module`` is called with a mode keyword (`mode_keyword`)."""
  return mode_keyword(module) is not None


def _mode(module: nn.Module) -> Callable[[bool], tuple[nn.Module, dict[str, Any]]]:
  """``train -> (module to call, keyword arguments)``: the mode keyword at call time where
  the model takes one (`mode_kwargs`), else the model cloned with its ``train`` field (a
  `jmem.convert` wrapper's wrapped model cloned), else the model as it is."""
  if takes_train(module):
    return lambda train: (module, mode_kwargs(module, train))
  fields = lambda m: {f.name for f in dataclasses.fields(m)}
  if "train" in fields(module):
    return lambda train: (module.clone(train=train), {})
  inner = getattr(module, "model", None)
  if isinstance(inner, nn.Module) and "train" in fields(inner):
    return lambda train: (module.clone(model=inner.clone(train=train)), {})
  return lambda train: (module, {})


def _from_linen(module: nn.Module) -> ModelFns:
  mode = _mode(module)

  def init(key, x):
    k_params, k_dropout = jax.random.split(key)
    m, kw = mode(False)
    variables = m.init({"params": k_params, "dropout": k_dropout}, x, **kw)
    variables = dict(variables)
    params = variables.pop("params")
    return params, variables

  def apply(params, model_state, x, *, train, rng=None, mask=None):
    variables = {"params": params, **model_state}
    # "dropout", and "actnn" / "sbp": the streams of jmem.convert's ActNN and SBP sites.
    # Evaluation needs none: without a backward pass the sites draw nothing that is used.
    rngs = context.rngs(rng) if rng is not None else {}
    m, kw = mode(train)
    with _masked(mask, linen=not getattr(module, "_jmem_guards_batch_mask", False)):
      if train and model_state:
        logits, new_state = m.apply(variables, x, **kw, rngs=rngs, mutable=list(model_state))
        return logits, dict(new_state)
      return m.apply(variables, x, **kw, rngs=rngs), model_state

  return ModelFns(init, apply, module)


def _padding_error(path: str, what: str) -> ValueError:
  return ValueError(
      f"The batch holds padded rows (the data axis does not divide the batch size, so jmem "
      f"pads it and masks the padding out), but {what} at {path or '<top>'!r} keeps BatchNorm "
      "statistics and ignores masks: the padding would enter its statistics. Use a batch size "
      "that the mesh's data axis divides, or convert the model with jmem.convert(model, "
      "jmem.SyncBN()) (or jmem.InPlaceABN()), whose BatchNorm skips masked rows.")


def _linen_mask_guard(next_fun, args, kwargs, ctx):
  """Raises for a linen BatchNorm-like module that would ignore `jmem.batch_mask`."""
  y = next_fun(*args, **kwargs)
  mod = ctx.module
  if (ctx.method_name == "__call__" and not getattr(mod, "_jmem_reads_batch_mask", False)
      and bn_core.linen_has_bn_variables(mod)):
    raise _padding_error("/".join(map(str, mod.scope.path)) if mod.scope else "",
                         type(mod).__name__)
  return y


def _nnx_mask_check(model: nnx.Module) -> None:
  """Raises for an NNX BatchNorm-like module that would ignore `jmem.batch_mask` (jmem.convert
  sites and guards, which read or refuse it themselves, pass)."""
  for path, m in nnx.iter_graph(model):
    if not isinstance(m, nnx.Module) or getattr(m, "_jmem_reads_batch_mask", False):
      continue
    # (The top module's "between" class, `jmem.ops.actnn.between`, reads no mask.)
    if any(k.__dict__.get("_jmem_site", ("between",))[0] != "between" for k in type(m).__mro__):
      continue
    if bn_core.nnx_has_bn_stats(m):
      raise _padding_error("/".join(map(str, path)), type(m).__name__)


@contextlib.contextmanager
def _masked(mask, *, linen: bool):
  """`jmem.batch_mask(mask)` (nothing for None); ``linen``: refusing linen BatchNorm-like
  modules that would ignore it."""
  if mask is None:
    yield
    return
  with context.batch_mask(mask):
    if linen:
      with nn.intercept_methods(_linen_mask_guard):
        yield
    else:
      yield


def _reseed(model_state, rng):
  """Replaces every PRNG key in an NNX state by ``fold_in(rng, i)`` (i: its leaf index)."""
  leaves, treedef = jax.tree.flatten(model_state)
  keys = iter(range(len(leaves)))
  leaves = [jax.random.fold_in(rng, next(keys)) if _is_key(x) and x.shape == () else x
            for x in leaves]
  return jax.tree.unflatten(treedef, leaves)


def _from_nnx(model: nnx.Module) -> ModelFns:
  graphdef, params, model_state = nnx.split(model, nnx.Param, ...)

  def init(key, x):
    del key, x  # an NNX model is initialised when it is constructed
    return params, model_state

  def apply(params, model_state, x, *, train, rng=None, mask=None):
    # A fresh tree either way: merging the caller's own variables would let the model's
    # updates (BatchNorm statistics) mutate them from inside the caller's trace.
    model_state = (_reseed(model_state, rng) if rng is not None
                   else jax.tree.map(lambda a: a, model_state))
    m = nnx.merge(graphdef, params, model_state)
    if train:
      m.train()
    else:
      m.eval()
    if mask is not None:
      _nnx_mask_check(m)
    with _masked(mask, linen=False):
      if rng is None:
        logits = m(x)
      else:
        with context.rngs(rng):          # the "actnn" and "sbp" keys of jmem.convert's sites
          logits = m(x)
    _, _, new_state = nnx.split(m, nnx.Param, ...)
    return logits, new_state

  return ModelFns(init, apply, graphdef)


def model_fns(model: nn.Module | nnx.Module | ModelFns) -> ModelFns:
  """Wraps a linen module (called as ``apply(v, x, train=...)``) or an NNX module.

  An NNX module is used through ``model.train()`` / ``model.eval()`` and its RNG streams are
  reseeded from the step's key, so it gets the same determinism as a linen module.
  """
  if isinstance(model, ModelFns):
    return model
  if isinstance(model, nn.Module):
    return _from_linen(model)
  if isinstance(model, nnx.Module):
    return _from_nnx(model)
  raise TypeError(
      f"Expected a flax.linen.Module, a flax.nnx.Module or jmem.step.ModelFns, got "
      f"{type(model).__name__}.")


class TrainState(NamedTuple):
  """Everything a training step reads and writes.

  Attributes:
    step: ``int32[]`` number of steps taken.
    params: trainable parameters.
    model_state: non-trainable variables (BatchNorm statistics, NNX RNG counters).
    opt_state: optimiser state.
    key: the PRNG key of the steps' randomness (`train_step`'s state): step ``i`` draws
      from ``fold_in(key, i)``. None (the training loop's state, no leaf): the step's
      ``seed`` instead (`make_train_step`).
  """

  step: jax.Array
  params: Any
  model_state: Any
  opt_state: Any
  key: Any = None


def init_state(fns: ModelFns, optimizer: optax.GradientTransformation, key: jax.Array,
               example_x) -> TrainState:
  """Initialises parameters, model state and optimiser state (works under eval_shape)."""
  params, model_state = fns.init(key, example_x)
  return TrainState(jnp.zeros((), jnp.int32), params, model_state, optimizer.init(params))


def abstract_state(fns: ModelFns, optimizer: optax.GradientTransformation, x) -> TrainState:
  """The train state's shapes for a batch like ``x`` (an array or ShapeDtypeStruct; one
  example is traced, nothing is computed)."""
  return jax.eval_shape(lambda k, v: init_state(fns, optimizer, k, v), jax.random.key(0),
                        jax.ShapeDtypeStruct((1,) + tuple(x.shape[1:]), x.dtype))


def check_batch(x, y) -> None:
  """Raises ValueError for an empty batch (shapes are static: at trace time).

  A mean over zero examples is NaN: the loss, BatchNorm's running statistics and, through
  them, gradients and parameters (a ResNet-8 had all its statistics and 9 of its 29
  parameter arrays NaN after two such steps).
  """
  for name, a in (("x", x), ("y", y)):
    shape = np.shape(a)
    if shape and shape[0] == 0:
      raise ValueError(
          f"Empty batch: {name} has shape {shape}, so the mean loss over it is NaN and a "
          "step would turn batch statistics and parameters NaN. Give each step at least one "
          "example (check batch_size, and a data pipeline whose last batch may be empty).")


# A user loss: ``loss_fn(outputs, targets) -> losses``, one per example (``[N]``) or per
# pixel (``[N, H, W]``), the optax convention (``optax.l2_loss``, ``optax.softmax_cross_entropy``
# and the like return them so); jmem takes the (masked) mean.
LossFn = Callable[[Any, Any], jax.Array]


def per_example_losses(loss_fn: LossFn | None, outputs, y) -> jax.Array:
  """``loss_fn(outputs, y)`` as float32, checked to hold one loss per example (or more per
  example: per pixel); `None`: softmax cross-entropy of the logits ``outputs`` with the
  integer labels ``y`` (the default). Floating outputs reach ``loss_fn`` in float32, as the
  logits reach the default loss.

  Raises:
    ValueError: (when traced) for float labels with the default loss, and for a
      ``loss_fn`` that returns a scalar, or losses whose leading axis is not the batch.
    TypeError: for a ``loss_fn`` that returns no floating array.
  """
  if loss_fn is None:
    dtype = getattr(y, "dtype", None)
    if dtype is not None and not jnp.issubdtype(dtype, jnp.integer):
      raise ValueError(
          f"The default loss is softmax cross-entropy with integer class labels, but the "
          f"labels y have dtype {dtype}: give class indices (y.astype(jnp.int32)), or pass "
          "your loss as loss_fn=, e.g. for regression loss_fn=lambda out, y: "
          "optax.l2_loss(out, y).sum(-1) (one loss per example).")
    return optax.softmax_cross_entropy_with_integer_labels(outputs.astype(jnp.float32), y)
  outputs = jax.tree.map(
      lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a, outputs)
  v = loss_fn(outputs, y)
  batch = jax.tree.leaves(outputs)[0].shape[0] if jax.tree.leaves(outputs) else None
  name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
  if not hasattr(v, "dtype") or not jnp.issubdtype(v.dtype, jnp.floating):
    dtype = f" of dtype {v.dtype}" if hasattr(v, "dtype") else ""
    raise TypeError(f"loss_fn {name} must return a floating array of losses, one per example, "
                    f"got {type(v).__name__}{dtype}.")
  if v.ndim == 0:
    raise ValueError(
        f"loss_fn {name} returned a scalar; it must return one loss per example (shape "
        f"({batch},) for this batch, or ({batch}, H, W) per pixel): jmem takes the mean "
        "itself, over the real examples only, so that padding rows stay out. Drop the mean "
        "(or sum) over the batch, e.g. lambda out, y: optax.l2_loss(out, y).sum(-1).")
  if batch is not None and v.shape[0] != batch:
    raise ValueError(
        f"loss_fn {name} returned losses of shape {v.shape}, whose leading axis is not the "
        f"batch's ({batch} examples): return one loss per example along axis 0 (shape "
        f"({batch},), or ({batch}, H, W) per pixel), reducing any other axes.")
  return v.astype(jnp.float32)


def make_loss(fns: ModelFns, loss_fn: LossFn | None = None
              ) -> Callable[..., tuple[jax.Array, tuple[Any, Any]]]:
  """``loss(params, model_state, x, y, rng, mask=None) -> (mean loss, (outputs,
  new_state))``.

  The mean is over the per-example (or per-pixel) losses of ``loss_fn(outputs, y)``
  (`per_example_losses`; default: softmax cross-entropy with integer labels). With a
  boolean ``mask`` (True = a real example) it is over the real examples only, and the model
  gets the mask (``fns.apply(..., mask=mask)``) for its BatchNorm statistics.

  Raises:
    TypeError: for a ``loss_fn`` that is not a function.
    ValueError: (when traced) for an empty batch (see `check_batch`), and as
      `per_example_losses`.
  """
  if loss_fn is not None and not callable(loss_fn):
    raise TypeError(f"loss_fn must be a function (outputs, targets) -> losses, one per "
                    f"example, or None (cross-entropy); got {type(loss_fn).__name__}.")

  def loss(params, model_state, x, y, rng, mask=None):
    check_batch(x, y)
    kw = {} if mask is None else {"mask": mask}
    outputs, new_state = fns.apply(params, model_state, x, train=True, rng=rng, **kw)
    return _mean(per_example_losses(loss_fn, outputs, y), mask), (outputs, new_state)

  return loss


def _mean(v, mask):
  """Mean of ``v`` (one value per example, or per pixel) over the examples ``mask`` keeps
  (all for None; 0 if it keeps none)."""
  if mask is None:
    return v.mean()
  w = jnp.broadcast_to(_per_label(mask, v.ndim), v.shape).astype(jnp.float32)
  return jnp.sum(v * w) / jnp.maximum(jnp.sum(w), 1.0)


def _per_label(mask, ndim: int):
  """The examples' ``mask`` (``[N]``) shaped to broadcast over ``ndim``-dimensional labels
  (per example: 1; per pixel: 3)."""
  return mask.reshape(mask.shape + (1,) * (ndim - 1))


def class_labels(outputs, y) -> bool:
  """Whether ``y`` are class labels of ``outputs``: integer labels, and outputs of their shape
  with a class axis last (logits), where accuracy means something."""
  return (jnp.issubdtype(jnp.result_type(y), jnp.integer) and
          jnp.ndim(outputs) == jnp.ndim(y) + 1 and
          tuple(jnp.shape(outputs)[:-1]) == tuple(jnp.shape(y)))


def make_train_step(fns: ModelFns, optimizer: optax.GradientTransformation, *,
                    seed: int = 0, donate: bool = True,
                    loss_fn: LossFn | None = None) -> Callable[..., Any]:
  """The jit-compiled step ``(state, x, y, mask=None) -> (state, metrics)``.

  The step's PRNG key is ``fold_in(state.key, state.step)``, or where the state carries no
  key (the loop's), ``fold_in(key(seed), state.step)``: randomness depends only on the key
  (or seed) and the step number; every stream the model draws from comes from it
  (`jmem.rngs`). An empty batch raises ValueError when the step is traced (`check_batch`),
  before any parameter changes. ``mask`` (boolean ``[N]``: the real examples of a padded
  batch, see `make_loss`) keeps the padding out of the loss and the metrics.

  ``metrics``: ``loss``, the mean of ``loss_fn`` (`make_loss`), and where the targets are
  class labels (integer labels, outputs of their shape plus a class axis: always with the
  default loss, and with a ``loss_fn`` on such targets) ``accuracy``, the share of examples
  (or pixels) whose largest logit is the label's. Other targets (a regression's) give no
  accuracy.
  """
  loss = make_loss(fns, loss_fn)
  base_key = jax.random.key(seed)

  def step(state: TrainState, x, y, mask=None):
    rng = jax.random.fold_in(base_key if state.key is None else state.key, state.step)
    (value, (outputs, new_model_state)), grads = jax.value_and_grad(loss, has_aux=True)(
        state.params, state.model_state, x, y, rng, mask)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": value}
    if loss_fn is None or class_labels(outputs, y):
      metrics["accuracy"] = _mean(jnp.argmax(outputs, -1) == y, mask)
    return (state._replace(step=state.step + 1, params=params, model_state=new_model_state,
                           opt_state=opt_state), metrics)

  return measure.jit(step, donate_argnums=(0,) if donate else ())


class TrainStep(NamedTuple):
  """What `train_step` returns: two functions, as an optax transformation is.

  Attributes:
    init: ``init(key, x) -> TrainState``: parameters (from ``key``; an NNX model's own),
      model state and optimiser state for inputs like ``x`` (an array or a
      `jax.ShapeDtypeStruct`; only its shape and dtype are read), and the key of the
      steps' randomness (also from ``key``), compiled once.
    step: ``step(state, x, y, mask=None) -> (state, metrics)``: one optimiser step,
      compiled with `jmem.jit` and donating ``state`` (`make_train_step`).
  """

  init: Callable[..., TrainState]
  step: Callable[..., tuple[TrainState, dict[str, jax.Array]]]


def train_step(model: nn.Module | nnx.Module | ModelFns,
               optimizer: optax.GradientTransformation, *, loss_fn: LossFn | None = None,
               donate: bool = True) -> TrainStep:
  """A compiled training step for ``model``, with every key it needs: ``(init, step)``.

  The step is what `jmem.train.train` runs, on your own data and loop: it is compiled
  with `jmem.jit` (on XLA:CPU plain ``jax.jit`` loses much of a technique's saving), it
  donates the state (the old state's buffers are reused: do not touch them after the
  call), and its randomness, every stream a converted model draws from (ActNN's rounding,
  SBP's kept nodes, dropout: `jmem.rngs`), comes from the state's key folded with the
  step number, so nothing about keys is left to get wrong.

  Args:
    model: a linen module (called ``apply(variables, x, train=...)``), an NNX module, or a
      `ModelFns` (e.g. ``plan.model_fns(model)``, `jmem.parallel.data_parallel`'s).
    optimizer: an optax transformation.
    loss_fn: ``loss_fn(outputs, targets) -> losses``, one per example (``[N]``) or per
      pixel (``[N, H, W]``), as optax's losses are, e.g.
      ``optax.softmax_cross_entropy_with_integer_labels`` or
      ``lambda out, y: optax.l2_loss(out, y).sum(-1)``; jmem takes the mean (over the
      real examples, with ``mask``). Default: softmax cross-entropy with integer labels.
    donate: donate the state to the step (the memory the plan counts on).

  Returns:
    A `TrainStep` ``(init, step)``; ``step``'s metrics are ``loss`` and, where the targets
    are class labels (`class_labels`), ``accuracy``.

  Examples:
    >>> model = jmem.convert(model, jmem.ActNN("L3"))
    >>> init, step = jmem.train_step(model, optax.adam(1e-3), loss_fn=loss_fn)
    >>> state = init(jax.random.key(0), x)
    >>> for x, y in batches:
    ...   state, metrics = step(state, x, y)
  """
  fns = model_fns(model)
  compiled = make_train_step(fns, optimizer, donate=donate, loss_fn=loss_fn)
  # Compiled: op-by-op initialisation is slow.
  make = jax.jit(lambda k, x: init_state(fns, optimizer, k, x), out_shardings=fns.sharding)

  def init(key, x) -> TrainState:
    key = context.check_key(key, "train_step's init key")
    k_params, k_steps = jax.random.split(key)
    example = jnp.zeros((1,) + tuple(x.shape[1:]), x.dtype)
    state = make(k_params, example)
    if not isinstance(fns.module, nn.Module):
      # Copies, so the donating step never takes the arrays of an NNX model the caller
      # still holds (jit may hand an unchanged array back as it is).
      state = jax.tree.map(jnp.copy, state)
    if fns.sharding is not None:
      k_steps = jax.device_put(k_steps, fns.sharding)
    return state._replace(key=k_steps)

  return TrainStep(init, compiled)


def default_optimizer(learning_rate: float, steps: int, *,
                      weight_decay: float = 1e-4) -> optax.GradientTransformation:
  """AdamW with linear warm-up (5% of steps) and cosine decay to zero."""
  warmup = max(1, steps // 20)
  schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup, max(steps, warmup + 1))
  return optax.adamw(schedule, weight_decay=weight_decay)


def check_learning_rate(learning_rate: float) -> None:
  """Raises a ValueError unless ``learning_rate`` is a finite number > 0.

  A NaN or infinite rate would train without complaint and turn every parameter NaN.
  """
  if not (math.isfinite(learning_rate) and learning_rate > 0):
    raise ValueError(f"learning_rate must be a finite number > 0, got {learning_rate!r}; "
                     "pass e.g. --learning-rate 3e-3.")


# ---------------------------------------------------------------- batches on a mesh

def _data_shards(sharding) -> int:
  """How many ways ``sharding`` (a NamedSharding) splits an array's first axis."""
  first = sharding.spec[0] if len(sharding.spec) else None
  if first is None:
    return 1
  names = first if isinstance(first, tuple) else (first,)
  return math.prod(sharding.mesh.shape[n] for n in names)


def _rows_sharding(sharding, ndim: int = 1) -> NamedSharding:
  """The sharding of ``ndim``-dimensional labels (per example: 1; per pixel: 3) and of the
  mask: the partitioning of ``sharding``'s first ``ndim`` axes (per-pixel labels split
  over H and W as the images are)."""
  spec = (tuple(sharding.spec) + (None,) * ndim)[:ndim]
  return NamedSharding(sharding.mesh, P(*spec))


def _check_takes_mask(fns: ModelFns) -> None:
  """Raises unless ``fns.apply`` takes ``mask=`` (needed for a padded batch)."""
  try:
    params = inspect.signature(fns.apply).parameters
  except (TypeError, ValueError):
    return
  if "mask" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
    raise ValueError(
        "The batch must be padded (the mesh's data axis does not divide the batch size), but "
        "this ModelFns' apply takes no mask= to keep the padding out of the model's "
        "statistics. Use a batch size that the data axis divides, or give apply a mask "
        "keyword (the ModelFns that jmem.step.model_fns makes have one).")


def padded_size(fns: ModelFns, n: int) -> int:
  """``n`` rounded up to a multiple of the ways ``fns.batch_sharding`` splits a batch."""
  k = 1 if fns.batch_sharding is None else _data_shards(fns.batch_sharding)
  return -(-n // k) * k


def global_batch(fns: ModelFns, x_all: np.ndarray, y_all: np.ndarray, idx: np.ndarray,
                 size: int) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """``(x_all[idx], y_all[idx], mask)`` padded with zero rows to ``size``, where ``mask``
  (True = a real example) is None when nothing is padded.

  On ``fns.batch_sharding`` every process reads only the rows (and, sharded spatially, the
  H/W blocks) that its own devices hold, and the pieces form one global array
  (`jax.make_array_from_callback`): the batch is a function of ``idx`` alone, whatever the
  number of processes. Without a batch sharding: arrays on the default device.
  """
  n = len(idx)
  if n > size:
    raise ValueError(f"global_batch: {n} examples do not fit a batch of {size}.")
  mask = None if size == n else np.arange(size) < n
  if fns.batch_sharding is None:
    if mask is not None:
      raise ValueError("Only a model with a batch_sharding pads its batches.")
    return jnp.asarray(x_all[idx]), jnp.asarray(y_all[idx]), None

  def take(a, index):
    sel = np.arange(size)[index[0]]          # global rows of this shard, ascending
    block = a[idx[sel[sel < n]]]
    block = block[(slice(None),) + tuple(index[1:])]
    pad = int(np.sum(sel >= n))
    if pad:
      block = np.concatenate([block, np.zeros((pad,) + block.shape[1:], block.dtype)])
    return block

  xs = fns.batch_sharding
  x = jax.make_array_from_callback((size,) + x_all.shape[1:], xs, lambda i: take(x_all, i))
  y = jax.make_array_from_callback((size,) + y_all.shape[1:], _rows_sharding(xs, y_all.ndim),
                                   lambda i: take(y_all, i))
  m = None if mask is None else jax.make_array_from_callback(
      (size,), _rows_sharding(xs), lambda i: mask[i])
  return x, y, m


def _is_key(x) -> bool:
  return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
