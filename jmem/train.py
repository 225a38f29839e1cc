"""One jit-compiled training step and loop for Flax linen and Flax NNX classifiers.

A model of either API is first turned into a pair of pure functions (`ModelFns`), so the
step, the loop, the checkpointing and the memory measurements in `jmem.measure` are
written once. Randomness is a pure function of ``(seed, step)`` and batches are a pure
function of ``(seed, step)`` too, so a run resumed from a checkpoint is bit-identical to an
uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, traverse_util

from jmem import _context as context
from jmem import data as data_lib
from jmem import measure

__all__ = [
    "ModelFns", "TrainState", "TrainConfig", "TrainResult", "model_fns", "init_state",
    "check_batch", "make_loss", "make_train_step", "evaluate", "default_optimizer", "train",
    "override_params", "check_learning_rate",
]


class ModelFns(NamedTuple):
  """A classifier as pure functions.

  Attributes:
    init: ``(key, x) -> (params, model_state)``.
    apply: ``(params, model_state, x, *, train, rng) -> (logits, new_model_state)``.
    module: the original linen module or NNX graph definition (for reference).
    sharding: the `jax.sharding.Sharding` of every leaf of the training state (e.g.
      replicated over a mesh), or None (the default device). `train` puts the initial state
      there, where the step leaves it, so that the step compiles once.
  """

  init: Callable[..., tuple[Any, Any]]
  apply: Callable[..., tuple[jax.Array, Any]]
  module: Any
  sharding: Any = None


def _from_linen(module: nn.Module) -> ModelFns:
  def init(key, x):
    k_params, k_dropout = jax.random.split(key)
    variables = module.init({"params": k_params, "dropout": k_dropout}, x, train=False)
    variables = dict(variables)
    params = variables.pop("params")
    return params, variables

  def apply(params, model_state, x, *, train, rng=None):
    variables = {"params": params, **model_state}
    # "actnn" / "sbp": the streams of jmem.convert's ActNN and SBP sites.
    rngs = ({"dropout": rng, "actnn": jax.random.fold_in(rng, 0x61),
             "sbp": jax.random.fold_in(rng, 0x73)} if rng is not None else {})
    if train and model_state:
      logits, new_state = module.apply(variables, x, train=True, rngs=rngs,
                                       mutable=list(model_state))
      return logits, dict(new_state)
    return module.apply(variables, x, train=train, rngs=rngs), model_state

  return ModelFns(init, apply, module)


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

  def apply(params, model_state, x, *, train, rng=None):
    if rng is not None:
      model_state = _reseed(model_state, rng)
    m = nnx.merge(graphdef, params, model_state)
    if train:
      m.train()
    else:
      m.eval()
    if rng is None:
      logits = m(x)
    else:
      with context.rngs(actnn=jax.random.fold_in(rng, 0x61),    # jmem.convert's sites
                        sbp=jax.random.fold_in(rng, 0x73)):
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
      f"Expected a flax.linen.Module, a flax.nnx.Module or jmem.train.ModelFns, got "
      f"{type(model).__name__}.")


class TrainState(NamedTuple):
  """Everything a training step reads and writes.

  Attributes:
    step: ``int32[]`` number of steps taken.
    params: trainable parameters.
    model_state: non-trainable variables (BatchNorm statistics, NNX RNG counters).
    opt_state: optimiser state.
  """

  step: jax.Array
  params: Any
  model_state: Any
  opt_state: Any


def init_state(fns: ModelFns, optimizer: optax.GradientTransformation, key: jax.Array,
               example_x) -> TrainState:
  """Initialises parameters, model state and optimiser state (works under eval_shape)."""
  params, model_state = fns.init(key, example_x)
  return TrainState(jnp.zeros((), jnp.int32), params, model_state, optimizer.init(params))


def override_params(params, initial):
  """``params`` with the leaves of the sub-tree ``initial`` put in (same paths, shapes)."""
  flat = traverse_util.flatten_dict(params)
  for path, value in traverse_util.flatten_dict(initial).items():
    name = "/".join(map(str, path))
    if path not in flat:
      raise ValueError(f"initial_params has {name!r}, which the model's parameters do not "
                       f"(they have e.g. {'/'.join(map(str, next(iter(flat))))!r}).")
    if np.shape(value) != np.shape(flat[path]):
      raise ValueError(f"initial_params {name!r} has shape {np.shape(value)}, the model's "
                       f"parameter has {np.shape(flat[path])}.")
    flat[path] = jnp.asarray(value, flat[path].dtype)
  return traverse_util.unflatten_dict(flat)


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


def make_loss(fns: ModelFns) -> Callable[..., tuple[jax.Array, tuple[jax.Array, Any]]]:
  """``loss(params, model_state, x, y, rng) -> (mean cross-entropy, (logits, new_state))``.

  Raises:
    ValueError: (when traced) for an empty batch (see `check_batch`).
  """

  def loss(params, model_state, x, y, rng):
    check_batch(x, y)
    logits, new_state = fns.apply(params, model_state, x, train=True, rng=rng)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
    return ce.mean(), (logits, new_state)

  return loss


def make_train_step(fns: ModelFns, optimizer: optax.GradientTransformation, *,
                    seed: int = 0, donate: bool = True) -> Callable[..., Any]:
  """The jit-compiled step ``(state, x, y) -> (state, metrics)``.

  The step's PRNG key is ``fold_in(key(seed), state.step)``: no key is carried in the
  state, so randomness depends only on the seed and the step number. An empty batch
  raises ValueError when the step is traced (`check_batch`), before any parameter changes.
  """
  loss_fn = make_loss(fns)
  base_key = jax.random.key(seed)

  def step(state: TrainState, x, y):
    rng = jax.random.fold_in(base_key, state.step)
    (loss, (logits, new_model_state)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state.params, state.model_state, x, y, rng)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == y)
    return (TrainState(state.step + 1, params, new_model_state, opt_state),
            {"loss": loss, "accuracy": accuracy})

  return measure.jit(step, donate_argnums=(0,) if donate else ())


def evaluate(fns: ModelFns, state: TrainState, x: np.ndarray, y: np.ndarray, *,
             batch_size: int = 256) -> float:
  """Top-1 accuracy of the model in eval mode (running statistics, no dropout).

  The last batch is padded to the size of the others and the jitted prediction is kept per
  ``fns.apply``, so repeated evaluations compile once.
  """
  if len(x) == 0:
    raise ValueError("evaluate needs at least one example, got none.")
  predict = _predict_fn(fns.apply)
  # A model run on a mesh (fns.sharding) splits the batch over its devices: every batch,
  # the padded last one included, is a multiple of the mesh size (a test set smaller than
  # batch_size and not divisible by the data axis crashed the final evaluation).
  mesh = getattr(fns.sharding, "mesh", None)
  multiple = int(mesh.devices.size) if mesh is not None else 1
  size = -(-min(batch_size, len(x)) // multiple) * multiple
  correct = 0
  for i in range(0, len(x), size):
    xb, n = x[i:i + size], len(x[i:i + size])
    if n < size:     # eval mode is per example (running statistics): padding changes nothing
      xb = np.concatenate([xb, np.zeros((size - n,) + xb.shape[1:], xb.dtype)])
    logits = predict(state.params, state.model_state, jnp.asarray(xb))[:n]
    correct += int(jnp.sum(jnp.argmax(logits, -1) == jnp.asarray(y[i:i + n])))
  return correct / len(x)


@functools.lru_cache(maxsize=16)
def _predict_fn(apply: Callable[..., Any]) -> Callable[..., jax.Array]:
  def predict(params, model_state, x):
    return apply(params, model_state, x, train=False)[0]
  return measure.jit(predict)


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


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Options of `train`.

  Attributes:
    steps: optimiser steps.
    batch_size: examples per step (at most the number of training examples).
    learning_rate: peak learning rate of `default_optimizer`.
    weight_decay: AdamW weight decay.
    seed: seeds initialisation, batch order and dropout.
    eval_every: evaluate on the test set every this many steps (0: only at the end).
    checkpoint_dir: where orbax checkpoints go (``None``: no checkpoints); a fresh run needs
      a directory without checkpoints.
    checkpoint_every: save every this many steps (and at the end).
    resume: continue from the latest checkpoint in ``checkpoint_dir``; there must be one,
      written by a run with the same model, data and settings (see `train`).
    progress: show a progress bar.
  """

  steps: int = 300
  batch_size: int = 128
  learning_rate: float = 3e-3
  weight_decay: float = 1e-4
  seed: int = 0
  eval_every: int = 0
  checkpoint_dir: str | None = None
  checkpoint_every: int = 100
  resume: bool = False
  progress: bool = True

  def validate(self, num_train: int) -> None:
    if not isinstance(self.steps, int) or self.steps < 0:
      raise ValueError(f"steps must be a non-negative integer, got {self.steps!r}.")
    if not 0 < self.batch_size <= num_train:
      raise ValueError(
          f"batch_size {self.batch_size} must be between 1 and the number of training "
          f"examples ({num_train}); lower --batch-size.")
    check_learning_rate(self.learning_rate)
    if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
      raise ValueError(f"weight_decay must be a finite number >= 0, got {self.weight_decay}.")
    if self.eval_every < 0:
      raise ValueError(f"eval_every must be >= 0 (0: evaluate only at the end), got "
                       f"{self.eval_every}.")
    if self.checkpoint_every < 1:
      raise ValueError(f"checkpoint_every must be >= 1, got {self.checkpoint_every}.")
    if self.resume and self.checkpoint_dir is None:
      raise ValueError("resume=True needs a checkpoint_dir to resume from.")


class TrainResult(NamedTuple):
  """What `train` returns.

  Attributes:
    state: final `TrainState`.
    test_accuracy: accuracy on the test set at the end.
    history: one dict per evaluation: ``step``, ``loss``, ``train_accuracy``,
      ``test_accuracy``.
    resumed_from: step the run resumed from (0 for a fresh run).
  """

  state: TrainState
  test_accuracy: float
  history: list[dict[str, float]]
  resumed_from: int


# ---------------------------------------------------------------- checkpointing (orbax)

def _is_key(x) -> bool:
  return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _to_savable(state: TrainState) -> list[Any]:
  leaves = jax.tree.leaves(state)
  return [np.asarray(jax.random.key_data(x)) if _is_key(x) else x for x in leaves]


def _from_savable(saved: list[Any], like: TrainState) -> TrainState:
  leaves, treedef = jax.tree.flatten(like)
  out = []
  for new, old in zip(saved, leaves, strict=True):
    if _is_key(old):
      out.append(jax.random.wrap_key_data(jnp.asarray(new), impl=jax.random.key_impl(old)))
    else:
      out.append(jnp.asarray(new, dtype=old.dtype))
  return jax.tree.unflatten(treedef, out)


class _Checkpoints:
  """The orbax checkpoints of one run in one directory.

  Each step holds two items: ``state`` (the `TrainState` leaves) and ``run`` (a JSON record
  of what the state means: model, technique, data, batch size, seed, optimiser settings, the
  state's size and a digest of its shapes and dtypes). A resume compares the record with the new run's and refuses any
  difference, and a fresh run refuses a directory that already holds checkpoints (orbax
  would silently skip every step it already has).
  """

  def __init__(self, directory: str, every: int, *, resume: bool):
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    self._ocp = ocp
    self.directory = directory = os.path.abspath(directory)
    if resume and not os.path.isdir(directory):
      raise ValueError(f"Cannot resume: the checkpoint directory {directory!r} does not exist. "
                       "Check the path, or start fresh by running without --resume "
                       "(resume=False).")
    try:
      os.makedirs(directory, exist_ok=True)
    except OSError as e:
      raise ValueError(f"Cannot create checkpoint directory {directory!r}: {e}") from e
    if not os.access(directory, os.W_OK):
      raise ValueError(f"Checkpoint directory {directory!r} is not writable.")
    options = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=every,
                                           enable_async_checkpointing=False)
    self._manager = ocp.CheckpointManager(directory, options=options)
    self.steps = sorted(self._manager.all_steps())
    if resume and not self.steps:
      self.close()
      raise ValueError(f"Cannot resume: there is no checkpoint in {directory!r}. To start "
                       "fresh, run without --resume (resume=False).")
    if not resume and self.steps:
      self.close()
      raise ValueError(
          f"Checkpoint directory {directory!r} already holds checkpoints (steps "
          f"{', '.join(map(str, self.steps))}), which a fresh run would not replace. Pass "
          "--resume (resume=True) to continue that run, or start fresh in an empty "
          "--checkpoint-dir (or delete those steps).")

  def _unreadable(self, step: int, why: str) -> ValueError:
    earlier = [s for s in self.steps if s < step]
    fix = (f"Delete {os.path.join(self.directory, str(step))!r} to resume from step "
           f"{earlier[-1]}, or start" if earlier else "Start")
    self.close()
    return ValueError(f"Checkpoint step {step} in {self.directory!r} is unreadable ({why}). "
                      f"{fix} fresh in an empty --checkpoint-dir without --resume.")

  def check_record(self, record: dict[str, Any]) -> None:
    """Raises a ValueError unless the latest step was written by a run with ``record``."""
    step, ocp = self.steps[-1], self._ocp
    if not os.path.isdir(os.path.join(self.directory, str(step), "run")):
      raise self._unreadable(step, "it has no run record: written by an earlier jmem, or "
                             "incomplete")
    try:
      saved = self._manager.restore(step, args=ocp.args.Composite(run=ocp.args.JsonRestore()))
      saved = dict(saved["run"])
    except Exception as e:  # pylint: disable=broad-except  (tensorstore raises Exception)
      raise self._unreadable(step, _first_line(e)) from e
    show = lambda r, k: repr(r[k]) if k in r else "not recorded"
    diffs = [f"{k}: {show(saved, k)} there, {show(record, k)} now"
             for k in {**saved, **record} if saved.get(k) != record.get(k)]
    if diffs:
      self.close()
      raise ValueError(
          f"Cannot resume from checkpoint step {step} in {self.directory!r}: it was written by "
          f"a different run ({'; '.join(diffs)}). Resume with the settings it was written "
          "with, or start fresh in an empty --checkpoint-dir without --resume.")

  def restore(self, like: TrainState) -> TrainState:
    """The latest step's state, with the structure, shapes and dtypes of ``like``."""
    step, ocp = self.steps[-1], self._ocp
    target = [jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype) for x in _to_savable(like)]
    try:
      saved = self._manager.restore(
          step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))["state"]
    except Exception as e:  # pylint: disable=broad-except  (tensorstore raises Exception)
      raise self._unreadable(step, _first_line(e)) from e
    return _from_savable(list(saved), like)

  def save(self, step: int, state: TrainState, record: dict[str, Any], *, force: bool) -> None:
    ocp = self._ocp
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(_to_savable(state)), run=ocp.args.JsonSave(record)),
                       force=force)

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def _first_line(e: Exception) -> str:
  """The gist of an orbax / tensorstore error (their messages run to a page)."""
  text = str(e).strip().splitlines()
  text = text[0].split(" See full TensorStore details")[0] if text else type(e).__name__
  return f"perhaps truncated or corrupted: {text[:300]}"


def _run_record(state, dataset: data_lib.Dataset, config: TrainConfig, *,
                default_optimizer_used: bool, run_info: dict[str, Any] | None) -> dict[str, Any]:
  """What a checkpoint's state means, as JSON: compared field by field on resume."""
  record = dict(run_info or {})
  leaves = jax.tree.leaves(state)
  layout = json.dumps([[list(np.shape(x)), str(x.dtype)] for x in leaves])
  params = sum(int(np.prod(np.shape(p))) for p in jax.tree.leaves(state.params))
  record.update(dataset=dataset.name, example_shape=list(dataset.example_shape),
                num_classes=dataset.num_classes, num_train=len(dataset.x_train),
                batch_size=config.batch_size, seed=config.seed,
                state=f"{len(leaves)} arrays, {params:,} parameters, shapes and dtypes "
                      f"#{hashlib.sha256(layout.encode()).hexdigest()[:12]}")
  if default_optimizer_used:       # the schedule depends on the number of steps
    record.update(optimizer="default_optimizer", learning_rate=config.learning_rate,
                  weight_decay=config.weight_decay, steps=config.steps)
  else:
    record.update(optimizer="given")
  return json.loads(json.dumps(record))


def train(model: nn.Module | nnx.Module | ModelFns, dataset: data_lib.Dataset,
          config: TrainConfig = TrainConfig(), *,
          optimizer: optax.GradientTransformation | None = None,
          initial_params: Any = None, stop_after: int | None = None,
          run_info: dict[str, Any] | None = None) -> TrainResult:
  """Trains a classifier on ``dataset`` with one jit-compiled step.

  Args:
    model: a linen module (``__call__(x, train)``), an NNX module or `ModelFns`.
    dataset: the data (see `jmem.data`).
    config: a `TrainConfig`.
    optimizer: overrides `default_optimizer` (``config.learning_rate`` is then unused).
    initial_params: a sub-tree of the parameters to start from instead of the fresh
      initialisation (e.g. ``{"spatial": pretrained_cnn_params}``); a checkpoint being
      resumed wins over it.
    stop_after: stop (as if killed) once this many total steps are done, without the final
      evaluation; used to test that resuming is exact.
    run_info: JSON-serialisable facts about the run that the state does not show, such as
      ``{"model": "resnet8", "technique": "remat"}``: recorded with every checkpoint, beside
      the data, batch size, seed, optimiser settings and the state's size, and compared on
      resume.

  Returns:
    A `TrainResult`.

  Raises:
    ValueError: for a bad config; with ``config.resume``, if the checkpoint directory holds
      no checkpoint, its latest step is unreadable, or it was written by a run with another
      record; without it, if the directory already holds checkpoints.
  """
  config.validate(len(dataset.x_train))
  fns = model_fns(model)
  default_used = optimizer is None
  optimizer = optimizer or default_optimizer(config.learning_rate, config.steps,
                                             weight_decay=config.weight_decay)
  key = jax.random.fold_in(jax.random.key(config.seed), 1)
  x1 = jnp.asarray(dataset.x_train[:1])
  checkpoints = record = None
  if config.checkpoint_dir is not None:   # directory and record checked before any work
    checkpoints = _Checkpoints(config.checkpoint_dir, config.checkpoint_every,
                               resume=config.resume)
    record = _run_record(jax.eval_shape(lambda k, x: init_state(fns, optimizer, k, x), key, x1),
                         dataset, config, default_optimizer_used=default_used, run_info=run_info)
    if config.resume:
      checkpoints.check_record(record)
  state = init_state(fns, optimizer, key, x1)
  if initial_params is not None:
    params = override_params(state.params, initial_params)
    state = state._replace(params=params, opt_state=optimizer.init(params))
  start = 0
  if checkpoints is not None and config.resume:
    state = checkpoints.restore(state)
    start = int(state.step)
  if fns.sharding is not None:     # where the step leaves it: no second compile
    state = jax.device_put(state, fns.sharding)
  # The step donates its state; copy it so arrays the caller owns (an NNX model's
  # parameters, say) are never invalidated.
  state = jax.tree.map(lambda a: a.copy(), state)
  step_fn = make_train_step(fns, optimizer, seed=config.seed)
  x_all, y_all = dataset.x_train, dataset.y_train
  history: list[dict[str, float]] = []
  end = config.steps if stop_after is None else min(stop_after, config.steps)

  from rich.progress import Progress  # pylint: disable=g-import-not-at-top
  with Progress(disable=not config.progress, transient=True) as bar:
    task = bar.add_task(f"train {dataset.name}", total=config.steps, completed=start)
    metrics = None
    for step in range(start, end):
      idx = data_lib.batch_indices(len(x_all), config.batch_size, step, seed=config.seed)
      state, metrics = step_fn(state, jnp.asarray(x_all[idx]), jnp.asarray(y_all[idx]))
      done = step + 1
      if checkpoints is not None and (done % config.checkpoint_every == 0
                                      or done == config.steps):
        checkpoints.save(done, state, record, force=done == config.steps)
      if config.eval_every and done % config.eval_every == 0 and done != config.steps:
        history.append({"step": done, "loss": float(metrics["loss"]),
                        "train_accuracy": float(metrics["accuracy"]),
                        "test_accuracy": evaluate(fns, state, dataset.x_test, dataset.y_test)})
      bar.update(task, completed=done)
  if checkpoints is not None:
    checkpoints.close()
  if stop_after is not None and end < config.steps:
    return TrainResult(state, float("nan"), history, start)
  acc = evaluate(fns, state, dataset.x_test, dataset.y_test)
  final = {"step": config.steps, "test_accuracy": acc}
  if metrics is not None:
    final.update(loss=float(metrics["loss"]), train_accuracy=float(metrics["accuracy"]))
  history.append(final)
  return TrainResult(state, acc, history, start)
