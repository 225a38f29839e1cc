"""The training loop for Flax linen and Flax NNX models, with orbax checkpoints.

The step it runs, and the model adapter (`ModelFns`) under it, are `jmem.step`'s (re-exported
here). Randomness is a pure function of ``(seed, step)`` and batches are a pure function of
``(seed, step)`` too, so a run resumed from a checkpoint is bit-identical to an uninterrupted
one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, traverse_util

from jmem import data as data_lib
from jmem import measure
# The step and its model adapter live in jmem.step (below this loop); re-exported here, so
# jmem.train.<name> keeps working.
from jmem.step import ModelFns as ModelFns
from jmem.step import TrainState as TrainState
from jmem.step import abstract_state as abstract_state
from jmem.step import check_batch as check_batch
from jmem.step import check_learning_rate as check_learning_rate
from jmem.step import default_optimizer as default_optimizer
from jmem.step import LossFn as LossFn
from jmem.step import global_batch as global_batch
from jmem.step import init_state as init_state
from jmem.step import make_loss as make_loss
from jmem.step import make_train_step as make_train_step
from jmem.step import model_fns as model_fns
from jmem.step import padded_size as padded_size
from jmem.step import per_example_losses as per_example_losses
from jmem.step import takes_train as takes_train
from jmem.step import (_check_takes_mask, _is_key, _per_label,  # pylint: disable=unused-import
                       _rows_sharding)

_LOG = logging.getLogger("jmem")

__all__ = [
    "ModelFns", "TrainState", "TrainConfig", "TrainResult", "model_fns", "init_state",
    "abstract_state",
    "check_batch", "make_loss", "make_train_step", "evaluate", "evaluate_loss",
    "default_optimizer", "train",
    "override_params", "check_learning_rate", "takes_train", "CheckpointFallbackWarning",
    "Interrupted",
]


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


def evaluate(fns: ModelFns, state: TrainState, x: np.ndarray, y: np.ndarray, *,
             batch_size: int = 256) -> float:
  """Top-1 accuracy of the model in eval mode (running statistics, no dropout): over the
  labels, one per example or per pixel (segmentation: pixel accuracy).

  The last batch is padded to the size of the others (its padding masked out of the count)
  and the jitted count is kept per ``fns.apply``, so repeated evaluations compile once; the
  logits stay on the device. On a mesh (``fns.batch_sharding``) every batch is a global
  array built from each process's rows (`global_batch`), padded to a multiple of the data
  axis, and the count of correct predictions over the real rows is computed on the
  devices: every process gets the accuracy of the whole test set.
  """
  if len(x) == 0:
    raise ValueError("evaluate needs at least one example, got none.")
  if fns.batch_sharding is not None:
    size = padded_size(fns, min(batch_size, len(x)))
    count = _count_correct_fn(fns.apply)
    full = jax.make_array_from_callback((size,), _rows_sharding(fns.batch_sharding),
                                        lambda i: np.ones(size, bool)[i])   # no padding
    correct = 0
    for i in range(0, len(x), size):
      idx = np.arange(i, min(i + size, len(x)))
      xb, yb, mb = global_batch(fns, x, y, idx, size)
      correct += int(count(state.params, state.model_state, xb, yb,
                           full if mb is None else mb))
    return correct / np.size(y)
  count = _count_correct_fn(fns.apply)
  # A model run on a mesh (fns.sharding) splits the batch over its devices: every batch,
  # the padded last one included, is a multiple of the mesh size (a test set smaller than
  # batch_size and not divisible by the data axis crashed the final evaluation).
  mesh = getattr(fns.sharding, "mesh", None)
  multiple = int(mesh.devices.size) if mesh is not None else 1
  size = -(-min(batch_size, len(x)) // multiple) * multiple
  correct = 0
  for i in range(0, len(x), size):
    xb, yb = x[i:i + size], np.asarray(y[i:i + size])
    n = len(xb)
    if n < size:     # eval mode is per example (running statistics): padding changes nothing
      xb = np.concatenate([xb, np.zeros((size - n,) + xb.shape[1:], xb.dtype)])
      yb = np.concatenate([yb, np.zeros((size - n,) + yb.shape[1:], yb.dtype)])
    # Counted in the compiled call, padding rows masked out: eager ops would compile per
    # batch shape, and the logits stay on the device.
    correct += int(count(state.params, state.model_state, jnp.asarray(xb), jnp.asarray(yb),
                         np.arange(size) < n))
  return correct / np.size(y)


def evaluate_loss(fns: ModelFns, state: TrainState, x: np.ndarray, y: np.ndarray,
                  loss_fn: LossFn, *, batch_size: int = 256) -> float:
  """The mean of ``loss_fn`` over ``x``, ``y`` with the model in eval mode (running
  statistics, no dropout): over every loss it returns, one per example or per pixel, as
  in training (`jmem.step.make_loss`).

  Batched and padded as `evaluate` (the padding is masked out of the mean); on a mesh,
  every process gets the loss of the whole set.
  """
  if len(x) == 0:
    raise ValueError("evaluate_loss needs at least one example, got none.")
  total = _loss_sum_fn(fns.apply, loss_fn)
  sums = []
  if fns.batch_sharding is not None:
    size = padded_size(fns, min(batch_size, len(x)))
    full = jax.make_array_from_callback((size,), _rows_sharding(fns.batch_sharding),
                                        lambda i: np.ones(size, bool)[i])   # no padding
    for i in range(0, len(x), size):
      xb, yb, mb = global_batch(fns, x, y, np.arange(i, min(i + size, len(x))), size)
      # Each batch's sums read before the next is queued: collectives over several
      # devices (XLA:CPU's) aborted or hung with many steps in flight, as `evaluate`'s
      # count per batch already waits.
      sums.append(jax.device_get(total(state.params, state.model_state, xb, yb,
                                       full if mb is None else mb)))
  else:
    mesh = getattr(fns.sharding, "mesh", None)
    multiple = int(mesh.devices.size) if mesh is not None else 1
    size = -(-min(batch_size, len(x)) // multiple) * multiple
    pad = lambda a, n: np.concatenate([a, np.zeros((size - n,) + a.shape[1:], a.dtype)])
    for i in range(0, len(x), size):
      xb, yb = np.asarray(x[i:i + size]), np.asarray(y[i:i + size])
      n = len(xb)
      if n < size:
        xb, yb = pad(xb, n), pad(yb, n)
      out = total(state.params, state.model_state, jnp.asarray(xb), jnp.asarray(yb),
                  jnp.arange(size) < n)
      sums.append(jax.device_get(out) if multiple > 1 else out)
  value, count = (sum(float(v[k]) for v in sums) for k in (0, 1))
  return value / max(count, 1.0)


@functools.lru_cache(maxsize=16)
def _loss_sum_fn(apply: Callable[..., Any], loss_fn: LossFn) -> Callable[..., Any]:
  def total(params, model_state, x, y, valid):
    outputs = apply(params, model_state, x, train=False)[0]
    v = per_example_losses(loss_fn, outputs, y)
    w = jnp.broadcast_to(_per_label(valid, v.ndim), v.shape).astype(jnp.float32)
    return jnp.sum(v * w), jnp.sum(w)
  return measure.jit(total)


@functools.lru_cache(maxsize=16)
def _count_correct_fn(apply: Callable[..., Any]) -> Callable[..., jax.Array]:
  def count(params, model_state, x, y, valid):
    logits = apply(params, model_state, x, train=False)[0]
    return jnp.sum((jnp.argmax(logits, -1) == y) & _per_label(valid, y.ndim))
  return measure.jit(count)


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
    wait_each_step: wait for each step to finish before dispatching the next (one step in
      flight, not JAX's asynchronous queue). ``None``: where the backend needs it, XLA:CPU
      with the step on several devices, whose collectives with many steps in flight
      aborted (exit 134) or hung a run; elsewhere (a GPU) steps stay asynchronous.
    stall_timeout: seconds after which a run whose steps have stopped finishing is ended
      (one line on stderr, exit status 1; the limit is at least 10x the longest step so
      far, checkpoint writes and evaluations not counted): a stalled collective, every
      process alive, would hold it for good. ``None``: 120 s where steps run on several
      devices of XLA:CPU or in several processes, else off; 0: off.
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
  wait_each_step: bool | None = None
  stall_timeout: float | None = None

  def validate(self, num_train: int | None) -> None:
    """Raises a ValueError for a bad setting; ``num_train``: the training examples, if
    known (None: batches from an iterable)."""
    if self.stall_timeout is not None and not (
        isinstance(self.stall_timeout, (int, float)) and 0 <= self.stall_timeout < math.inf):
      raise ValueError(f"stall_timeout must be a number of seconds >= 0 (0: off), got "
                       f"{self.stall_timeout!r}.")
    if not isinstance(self.steps, int) or self.steps < 0:
      raise ValueError(f"steps must be a non-negative integer, got {self.steps!r}.")
    if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not (
        0 <= self.seed < 2**32):
      raise ValueError(f"seed must be an integer from 0 to 2**32 - 1 (--seed), got "
                       f"{self.seed!r}.")
    if not 0 < self.batch_size <= (math.inf if num_train is None else num_train):
      raise ValueError(
          f"batch_size {self.batch_size} must be between 1 and the number of training "
          f"examples ({num_train}); lower --batch-size." if num_train is not None else
          f"batch_size must be at least 1, got {self.batch_size}.")
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
    test_accuracy: accuracy on the test set at the end, where the targets are class labels
      (always with the default loss; with a ``loss_fn``, integer labels and logits); None
      for other targets (a regression's) and without a test set (batches from an iterable
      and no ``eval_data``).
    history: one dict per evaluation: ``step``, ``loss`` (the training step's), with a
      ``loss_fn`` ``test_loss``, and where the targets are class labels ``train_accuracy``
      and ``test_accuracy``.
    resumed_from: step the run resumed from (0 for a fresh run).
    test_loss: with a ``loss_fn``, its mean on the test set at the end (`evaluate_loss`);
      else None.
  """

  state: TrainState
  test_accuracy: float | None
  history: list[dict[str, float]]
  resumed_from: int
  test_loss: float | None = None


def _collectives_need_waiting(state) -> bool:
  """Whether the step's collectives need one step in flight at a time: XLA:CPU's, on several
  devices (or processes), aborted or hung with JAX's queue of asynchronous steps (a plain
  JAX data-parallel loop too); waiting for each step let every run finish."""
  devices = {d for a in jax.tree.leaves(state) if isinstance(a, jax.Array)
             for d in a.sharding.device_set}
  return (jax.process_count() > 1 or len(devices) > 1) and all(
      d.platform == "cpu" for d in devices)


class Interrupted(KeyboardInterrupt):
  """`train` stopped on SIGINT (Ctrl-C) or SIGTERM, after any checkpoint it was writing (a
  KeyboardInterrupt, so code that catches Ctrl-C still does).

  Attributes:
    signal: the signal's name (``"SIGINT"`` or ``"SIGTERM"``).
    step: the steps done when it stopped.
    steps: the steps the run was for.
    checkpoint: the newest checkpoint step written, or None.
    checkpoint_dir: where the checkpoints are, or None.
  """

  def __init__(self, signal_name: str, step: int, steps: int, checkpoint: int | None,
               checkpoint_dir: str | None):
    self.signal, self.step, self.steps = signal_name, step, steps
    self.checkpoint, self.checkpoint_dir = checkpoint, checkpoint_dir
    if checkpoint_dir is None:
      then = "no checkpoint was written (no checkpoint_dir / --checkpoint-dir)"
    elif checkpoint is None:
      then = f"no checkpoint was written yet in {checkpoint_dir}"
    else:
      then = (f"the newest checkpoint is step {checkpoint} in {checkpoint_dir} (resume with "
              f"--resume --checkpoint-dir {checkpoint_dir})")
    super().__init__(f"interrupted by {signal_name} at step {step} of {steps}; {then}")


class _Stop:
  """SIGINT and SIGTERM for the training loop: either stops it at once (raising
  `Interrupted`), or, while a checkpoint is being written, once the write is done, so that
  no half-written step is left behind. Installed only in the main thread (where Python
  delivers signals); the previous handlers come back on exit."""

  _SIGNALS = tuple(s for s in ("SIGINT", "SIGTERM") if hasattr(signal, s))

  def __init__(self, status: Callable[[], tuple[int, int | None]], steps: int,
               directory: str | None):
    self._status, self._steps, self._directory = status, steps, directory
    self.requested: str | None = None
    self._deferring = False
    self._previous: dict[int, Any] = {}

  # A signal whose Python handler has not run after this long means the main thread is
  # blocked in native code (a collective waiting for a peer that is gone, say), where Python
  # runs no handler: the watchdog then ends the process as the signal's default would.
  GRACE_SECONDS = 10.0

  def __enter__(self) -> "_Stop":
    if threading.current_thread() is not threading.main_thread():
      return self
    for name in self._SIGNALS:
      num = getattr(signal, name)
      self._previous[num] = signal.signal(num, self._handle)
    self._read, write = os.pipe()
    os.set_blocking(write, False)
    self._wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    self._write = write
    threading.Thread(target=self._watch, name="jmem-signal-watchdog", daemon=True).start()
    return self

  def __exit__(self, *exc) -> None:
    if not self._previous:
      return
    signal.set_wakeup_fd(self._wakeup)
    previous, self._previous = self._previous, {}
    for num, handler in previous.items():
      signal.signal(num, handler)
    os.close(self._write)        # ends the watchdog's read

  def _watch(self) -> None:
    try:
      while data := os.read(self._read, 16):
        ours = [n for n in data if n in self._previous]   # set_wakeup_fd writes every
        if not ours:                                      # signal Python handles (a user's
          continue                                        # SIGUSR1 too): those are not ours
        signum = ours[0]
        deadline = time.monotonic() + self.GRACE_SECONDS
        while self.requested is None and time.monotonic() < deadline:
          time.sleep(0.1)
        if self.requested is None and self._previous:
          name = signal.Signals(signum).name
          os.write(2, (f"jmem: {name} received but the training loop has not answered in "
                       f"{self.GRACE_SECONDS:.0f} s (blocked in native code: compiling the "
                       "step, or a collective waiting for a process that is gone): exiting "
                       "now\n").encode())
          os._exit(128 + signum)
    finally:
      os.close(self._read)

  def _handle(self, signum, frame) -> None:
    del frame
    self.requested = signal.Signals(signum).name
    if not self._deferring:
      self.raise_()

  def raise_(self) -> None:
    step, checkpoint = self._status()
    raise Interrupted(self.requested, step, self._steps, checkpoint, self._directory)

  @contextlib.contextmanager
  def deferred(self) -> Iterator[None]:
    """A signal inside takes effect when the block is done."""
    self._deferring = True
    try:
      yield
    finally:
      self._deferring = False
    if self.requested:
      self.raise_()


class _StallWatch:
  """Ends a run whose steps have stopped finishing: a stalled collective (every process alive,
  none answering, so no heartbeat fires) would otherwise hold it for good. After the first
  step (compiling), a thread checks that a step finishes within ``max(floor, 10 x the
  longest step so far)``; checkpoint writes and evaluations are not counted. On a stall it
  writes one line and exits the process with status 1."""

  def __init__(self, floor: float | None, status: Callable[[], tuple[int, int | None]],
               directory: str | None):
    self._floor, self._status, self._directory = floor, status, directory
    self._last: float | None = None
    self._longest = 0.0
    self._paused = 0
    self._done = False

  def __enter__(self) -> "_StallWatch":
    if self._floor:
        threading.Thread(target=self._watch, name="jmem-stall-watch", daemon=True).start()
    return self

  def __exit__(self, *exc) -> None:
    self._done = True

  def beat(self) -> None:
    """A step finished."""
    now = time.monotonic()
    if self._last is not None:
      self._longest = max(self._longest, now - self._last)
    self._last = now

  @contextlib.contextmanager
  def paused(self) -> Iterator[None]:
    self._paused += 1
    try:
      yield
    finally:
      if self._last is not None:     # the wait restarts (before the watch looks again); the
        self._last = time.monotonic()  # pause is no step's time
      self._paused -= 1

  def limit(self) -> float:
    return max(self._floor, 10 * self._longest)

  def _watch(self) -> None:
    while not self._done:
      time.sleep(0.5)
      if self._done or self._paused or self._last is None:
        continue
      waited = time.monotonic() - self._last
      if waited > self.limit() and not self._paused:
        step, checkpoint = self._status()
        then = ("" if checkpoint is None else f"; the newest checkpoint is step {checkpoint} "
                f"in {self._directory} (restart every process with --resume)")
        os.write(2, (f"jmem: no training step finished in {waited:.0f} s after step {step} "
                     f"(the longest before took {self._longest:.1f} s): the run is stalled, "
                     "most likely in a collective waiting for a process that no longer "
                     f"answers; exiting{then}\n").encode())
        os._exit(1)


# ---------------------------------------------------------------- checkpointing (orbax)

def _to_savable(state: TrainState) -> list[Any]:
  leaves = jax.tree.leaves(state)
  return [jax.random.key_data(x) if _is_key(x) else x for x in leaves]


def _from_savable(saved: list[Any], like: TrainState) -> TrainState:
  leaves, treedef = jax.tree.flatten(like)
  out = []
  for new, old in zip(saved, leaves, strict=True):
    if _is_key(old):
      out.append(jax.random.wrap_key_data(jnp.asarray(new), impl=jax.random.key_impl(old)))
    else:
      out.append(jnp.asarray(new, dtype=old.dtype))
  return jax.tree.unflatten(treedef, out)


def _place(state: TrainState, sharding) -> TrainState:
  """``state`` with every leaf on ``sharding``, from host values (so that every process of a
  multi-process run can place the same values on a mesh spanning processes)."""
  def put(a):
    if isinstance(a, jax.Array) and a.sharding == sharding:
      return a
    if _is_key(a):
      data = jax.device_put(np.asarray(jax.random.key_data(a)), sharding)
      return jax.random.wrap_key_data(data, impl=jax.random.key_impl(a))
    return jax.device_put(np.asarray(a), sharding)
  return jax.tree.map(put, state)


def _host_value(a) -> np.ndarray:
  """The whole value of a savable leaf on this host (every process computes the same)."""
  if isinstance(a, jax.Array) and not a.is_fully_addressable:
    if a.is_fully_replicated:
      return np.asarray(a.addressable_data(0))
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    return np.asarray(multihost_utils.process_allgather(a, tiled=True))
  return np.asarray(a)


def _digests(values: list[np.ndarray]) -> list[str]:
  """A SHA-256 (first 16 hex digits) of each host array's dtype, shape and bytes."""
  out = []
  for v in values:
    v = np.ascontiguousarray(v)
    h = hashlib.sha256(f"{v.dtype.str}{v.shape}".encode())
    h.update(v.tobytes())
    out.append(h.hexdigest()[:16])
  return out


def _nonfinite(values: list[np.ndarray]) -> list[int]:
  """Indices of the floating host arrays that hold a NaN or an infinity."""
  bad = []
  for i, v in enumerate(values):
    if jnp.issubdtype(v.dtype, jnp.inexact) and not np.isfinite(v).all():
      bad.append(i)
  return bad


class CheckpointFallbackWarning(UserWarning):
  """A resume skipped the newest checkpoint(s), which did not verify, for an older one."""


class _Checkpoints:
  """The orbax checkpoints of one run in one directory.

  Each step holds two items: ``state`` (the `TrainState` leaves) and ``run`` (a JSON record
  of what the state means: model, technique, data, batch size, seed, optimiser settings, the
  state's size and a digest of its shapes and dtypes), and ``integrity`` (a SHA-256 of every
  saved array, computed from the values saved). A resume compares the record with the new
  run's and refuses any difference; it restores the newest step whose every array matches
  its digest and is finite, moving any newer step that does not aside (``<step>.unverified``)
  with a `CheckpointFallbackWarning`, and refuses to resume when no step verifies. A fresh
  run refuses a directory that already holds checkpoints (orbax would silently skip every
  step it already has).
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

  def check_record(self, record: dict[str, Any]) -> None:
    """Raises a ValueError unless the newest step with a readable record was written by a
    run with ``record`` (a step whose record cannot be read is left to `restore`, which
    falls back past it)."""
    ocp = self._ocp
    for step in reversed(self.steps):
      if not os.path.isdir(os.path.join(self.directory, str(step), "run")):
        continue
      try:
        saved = self._manager.restore(step, args=ocp.args.Composite(run=ocp.args.JsonRestore()))
        saved = dict(saved["run"])
      except Exception:  # pylint: disable=broad-except  (tensorstore raises Exception)
        continue
      break
    else:
      self.close()
      raise ValueError(
          f"Cannot resume from {self.directory!r}: none of its checkpoints (steps "
          f"{', '.join(map(str, self.steps))}) has a readable run record (written by an "
          "earlier jmem, or incomplete, or corrupted). Start fresh in an empty "
          "--checkpoint-dir without --resume.")
    show = lambda r, k: repr(r[k]) if k in r else "not recorded"
    diffs = [f"{k}: {show(saved, k)} there, {show(record, k)} now"
             for k in {**saved, **record} if saved.get(k) != record.get(k)]
    if diffs:
      self.close()
      raise ValueError(
          f"Cannot resume from checkpoint step {step} in {self.directory!r}: it was written by "
          f"a different run ({'; '.join(diffs)}). Resume with the settings it was written "
          "with, or start fresh in an empty --checkpoint-dir without --resume.")

  def restore(self, like: TrainState, sharding=None) -> TrainState:
    """The newest step's state that verifies, with the structure, shapes and dtypes of
    ``like``, on ``sharding`` (every leaf; None: the default device)."""
    # A target sharding always: orbax refuses to guess one for a checkpoint written by
    # another topology (a different number of processes or devices).
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = [jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)
              for x in _to_savable(like)]
    failed: dict[int, str] = {}
    for step in reversed(self.steps):
      saved, why = self._restore_verified(step, target)
      if saved is not None:
        break
      failed[step] = why
    else:
      listing = "; ".join(f"step {s}: {w}" for s, w in failed.items())
      self.close()
      raise ValueError(
          f"Cannot resume from {self.directory!r}: no checkpoint in it verifies ({listing}). "
          "Start fresh in an empty --checkpoint-dir without --resume.")
    if jax.process_count() > 1:     # every process must resume from the same step
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      chosen = np.asarray(multihost_utils.process_allgather(np.int64(step))).ravel()
      if len(set(chosen.tolist())) > 1:
        self.close()
        raise ValueError(
            f"Cannot resume from {self.directory!r}: the processes found different newest "
            f"checkpoints that verify (steps {chosen.tolist()} by process; this one's "
            f"failures: {failed or 'none'}). Check the storage every process reads, or "
            "start fresh in an empty --checkpoint-dir without --resume.")
    if failed:
      self._set_aside(failed)
      warnings.warn(
          f"Resuming from checkpoint step {step} in {self.directory!r}, not from the newer "
          + ", ".join(f"step {s} ({w})" for s, w in failed.items())
          + ", which did not verify; moved aside as "
          + ", ".join(f"{s}.unverified" for s in failed) + ".",
          CheckpointFallbackWarning, stacklevel=3)
    return _from_savable(saved, like)

  def _restore_verified(self, step: int, target) -> tuple[list[Any] | None, str]:
    """Step ``step``'s arrays if they match their digests and are finite, else the reason."""
    ocp = self._ocp
    if not os.path.isdir(os.path.join(self.directory, str(step), "integrity")):
      return None, ("it has no integrity record (written by a jmem before checksums, or "
                    "incomplete)")
    try:
      got = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(target), integrity=ocp.args.JsonRestore()))
      saved, integrity = list(got["state"]), dict(got["integrity"])
    except Exception as e:  # pylint: disable=broad-except  (tensorstore raises Exception)
      return None, f"unreadable, {_first_line(e)}"
    expected = integrity.get("sha256", [])
    values = [_host_value(a) for a in saved]      # one copy to the host, for both checks
    digests = _digests(values)
    if len(expected) != len(digests):
      return None, f"its integrity record lists {len(expected)} arrays, the state has {len(digests)}"
    changed = [i for i, (a, b) in enumerate(zip(digests, expected)) if a != b]
    if changed:
      return None, (f"{len(changed)} of {len(digests)} arrays differ from the checksums "
                    f"written with them (array {changed[0]} first): corrupted on disk")
    nonfinite = _nonfinite(values)
    if nonfinite:
      return None, (f"{len(nonfinite)} of {len(saved)} arrays hold NaN or inf (array "
                    f"{nonfinite[0]} first): the run had diverged when it was saved")
    return saved, ""

  def _set_aside(self, steps) -> None:
    """Renames the given steps' folders ``<step>.unverified`` (process 0), so that the run
    can write those steps again and a later resume does not meet them."""
    if jax.process_index() == 0:
      for step in steps:
        src = os.path.join(self.directory, str(step))
        dst, n = src + ".unverified", 1
        while os.path.exists(dst):
          n += 1
          dst = f"{src}.unverified{n}"
        os.rename(src, dst)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      multihost_utils.sync_global_devices("jmem checkpoint set aside")
    self._manager.reload()
    self.steps = sorted(self._manager.all_steps())

  def save(self, step: int, state: TrainState, record: dict[str, Any], *, force: bool) -> bool:
    ocp = self._ocp
    if not (force or self._manager.should_save(step)):
      return False
    leaves = _to_savable(state)
    integrity = {"sha256": _digests([_host_value(a) for a in leaves])}
    saved = self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(leaves), run=ocp.args.JsonSave(record),
        integrity=ocp.args.JsonSave(integrity)), force=force)
    if saved and jax.process_index() == 0:   # the path a restart needs, at every save
      _LOG.info("checkpoint: step %d saved in %s (resume with --resume --checkpoint-dir %s)",
                step, os.path.join(self.directory, str(step)), self.directory)
    return bool(saved)

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def _first_line(e: Exception) -> str:
  """The gist of an orbax / tensorstore error (their messages run to a page)."""
  text = str(e).strip().splitlines()
  text = text[0].split(" See full TensorStore details")[0] if text else type(e).__name__
  return f"perhaps truncated or corrupted: {text[:300]}"


def _run_record(state, data_record: dict[str, Any], config: TrainConfig, *,
                default_optimizer_used: bool, run_info: dict[str, Any] | None,
                loss_given: bool = False) -> dict[str, Any]:
  """What a checkpoint's state means, as JSON: compared field by field on resume.
  ``data_record``: what the data is (`_Batches.record`)."""
  record = dict(run_info or {})
  leaves = jax.tree.leaves(state)
  layout = json.dumps([[list(np.shape(x)), str(x.dtype)] for x in leaves])
  params = sum(int(np.prod(np.shape(p))) for p in jax.tree.leaves(state.params))
  record.update(**data_record, batch_size=config.batch_size, seed=config.seed,
                state=f"{len(leaves)} arrays, {params:,} parameters, shapes and dtypes "
                      f"#{hashlib.sha256(layout.encode()).hexdigest()[:12]}")
  if default_optimizer_used:       # the schedule depends on the number of steps
    record.update(optimizer="default_optimizer", learning_rate=config.learning_rate,
                  weight_decay=config.weight_decay, steps=config.steps)
  else:
    record.update(optimizer="given")
  if loss_given:         # the default loss is not recorded: earlier runs resume as they were
    record.update(loss="given")
  return json.loads(json.dumps(record))


class _Batches:
  """Where `train`'s batches come from: an in-memory `jmem.data.Dataset`, drawn by ``(seed,
  step)``, or an iterable of ``(x, y)`` batches, taken in order."""

  def __init__(self, dataset, config: TrainConfig):
    self._config = config
    if isinstance(dataset, data_lib.Dataset):
      config.validate(len(dataset.x_train))
      self._dataset, self._it, self._pending = dataset, None, None
      self.name, self.first_x = dataset.name, dataset.x_train[:1]
      self.test = (dataset.x_test, dataset.y_test)
      self.record = dict(dataset=dataset.name, example_shape=list(dataset.example_shape),
                         num_classes=dataset.num_classes, num_train=len(dataset.x_train))
      return
    config.validate(None)
    if isinstance(dataset, (tuple, list)) and len(dataset) == 2 and all(
        not isinstance(a, (tuple, list)) and np.ndim(a) >= 1 for a in dataset):
      raise TypeError(
          "train takes a jmem.data.Dataset or an iterable of (x, y) batches, one per step; "
          "got one (x, y) pair of arrays. Pass [(x, y)] for a single batch, an iterator that "
          "yields batches, or jmem.data.Dataset(name, x_train, y_train, x_test, y_test, "
          "num_classes) to draw batches from the arrays.")
    try:
      self._it = iter(dataset)
    except TypeError:
      raise TypeError(f"train takes a jmem.data.Dataset or an iterable of (x, y) batches, got "
                      f"{type(dataset).__name__}.") from None
    first = next(self._it, None)
    if first is None:
      raise ValueError("train: the iterable of batches yielded none.")
    x, _ = self._pair(first, 0)
    if len(x) != config.batch_size:
      raise ValueError(
          f"train: the first batch has {len(x)} examples, TrainConfig.batch_size is "
          f"{config.batch_size}. Set TrainConfig(batch_size={len(x)}): the batches of an "
          "iterable all have that many rows (on a mesh the last may have fewer).")
    self._dataset, self._pending = None, first
    self.name, self.first_x, self.test = "batches", x[:1], None
    self.record = dict(dataset="batches", example_shape=list(np.shape(x)[1:]))

  @staticmethod
  def _pair(batch, step: int):
    return _xy_pair(batch, f"batch {step}", "each batch of the iterable")

  def _next(self):
    if self._pending is not None:
      batch, self._pending = self._pending, None
      return batch
    return next(self._it, None)

  def skip(self, steps: int) -> None:
    """Passes over the batches of the first ``steps`` steps (a resumed run's)."""
    if self._dataset is not None:
      return
    for i in range(steps):
      if self._next() is None:
        raise ValueError(f"Cannot resume at step {steps}: the iterable of batches ended after "
                         f"{i} batches. Resume with the iterable the run was started with.")

  def get(self, step: int, fns: ModelFns, size: int):
    """Step ``step``'s ``(x, y, mask)`` (as `global_batch`), or None where batches ended."""
    if self._dataset is not None:
      d = self._dataset
      idx = data_lib.batch_indices(len(d.x_train), self._config.batch_size, step,
                                   seed=self._config.seed)
      return global_batch(fns, d.x_train, d.y_train, idx, size)
    batch = self._next()
    if batch is None:
      return None
    x, y = self._pair(batch, step)
    n, want = len(x), self._config.batch_size
    if tuple(np.shape(x)[1:]) != tuple(self.record["example_shape"]) or n > want or (
        n < want and fns.batch_sharding is None):
      raise ValueError(
          f"train: batch {step} has x of shape {np.shape(x)}; every batch must have "
          f"{want} examples of shape {tuple(self.record['example_shape'])}"
          + (" (a shorter last batch is padded and masked only on a mesh: drop the "
             "remainder)." if n < want else "."))
    if fns.batch_sharding is None:
      return jnp.asarray(x), jnp.asarray(y), None
    if n < size:                          # a short last batch: padded, so masked
      _check_takes_mask(fns)
    return global_batch(fns, np.asarray(x), np.asarray(y), np.arange(n), size)


def _xy_pair(value, name: str, what: str):
  """``value`` as ``(x, y)``: a pair of arrays with the same leading (batch) size, else a
  ValueError naming it (``name``, and ``what`` must be such a pair)."""
  if not (isinstance(value, (tuple, list)) and len(value) == 2):
    raise ValueError(f"train: {name} is a {type(value).__name__}; {what} must be an (x, y) "
                     "pair of arrays.")
  x, y = value
  if np.ndim(x) < 1 or np.ndim(y) < 1 or len(x) != len(y):
    raise ValueError(f"train: {name} has x of shape {np.shape(x)} and y of shape "
                     f"{np.shape(y)}; they must have the same leading (batch) size.")
  return x, y


def train(model: nn.Module | nnx.Module | ModelFns,
          dataset: data_lib.Dataset | Iterable[tuple[Any, Any]],
          config: TrainConfig = TrainConfig(), *,
          optimizer: optax.GradientTransformation | None = None,
          loss_fn: LossFn | None = None,
          initial_params: Any = None, stop_after: int | None = None,
          run_info: dict[str, Any] | None = None,
          eval_data: tuple[Any, Any] | None = None) -> TrainResult:
  """Trains ``model`` on ``dataset`` with one jit-compiled step (`jmem.step`'s).

  Args:
    model: a linen module (``__call__(x, train)``), an NNX module or `ModelFns`.
    dataset: the data: an in-memory `jmem.data.Dataset` (batches drawn by ``(seed,
      step)``, evaluated on its test split), or any iterable of ``(x, y)`` batches (numpy
      or JAX arrays; a tf.data / grain / PyTorch loader turned into numpy), one per step:
      the loop stops at ``config.steps`` or where the iterable ends (with a warning), and
      every batch must have ``config.batch_size`` rows, except that on a mesh a shorter
      one is padded and masked. On several processes every process must yield the same
      global batches. Resuming skips the first batches the checkpoint's steps took, so it
      is exact where the iterable yields the same batches again. With the default loss,
      integer class labels; with a ``loss_fn``, whatever targets it takes.
    config: a `TrainConfig`.
    optimizer: overrides `default_optimizer` (``config.learning_rate`` is then unused).
    loss_fn: ``loss_fn(outputs, targets) -> losses``, one per example (or per pixel), as
      optax's losses are (``lambda out, y: optax.l2_loss(out, y).sum(-1)``); the step
      minimises their mean (`jmem.step.make_loss`). Default: softmax cross-entropy with
      integer labels, with accuracy reported; with a ``loss_fn`` the loop reports the
      training loss and the test loss (`evaluate_loss`), and accuracy only on class labels
      (integer labels, logits).
    initial_params: a sub-tree of the parameters to start from instead of the fresh
      initialisation (e.g. ``{"spatial": pretrained_cnn_params}``); a checkpoint being
      resumed wins over it.
    stop_after: stop (as if killed) once this many total steps are done, without the final
      evaluation; used to test that resuming is exact.
    run_info: JSON-serialisable facts about the run that the state does not show, such as
      ``{"model": "resnet8", "technique": "remat"}``: recorded with every checkpoint, beside
      the data, batch size, seed, optimiser settings and the state's size, and compared on
      resume.
    eval_data: ``(x, y)`` arrays to evaluate on instead of ``dataset``'s test split (with an
      iterable of batches, the only test set: without it the result has no test figures).

  Returns:
    A `TrainResult`.

  Raises:
    ValueError: for a bad config; with ``config.resume``, if the checkpoint directory holds
      no checkpoint, its latest step is unreadable, or it was written by a run with another
      record; without it, if the directory already holds checkpoints.
  """
  source = _Batches(dataset, config)
  fns = model_fns(model)
  if jax.process_count() > 1 and fns.batch_sharding is None:
    raise ValueError(
        f"This is process {jax.process_index()} of {jax.process_count()}, but the model runs "
        "on one device, so every process would train its own copy. Run it on a mesh that "
        "spans the processes: jmem.parallel.data_parallel(model) (jmem train --mesh D), or "
        "jmem.parallel.spatial.spatial_model_fns(model, mesh) (--mesh DxHxW).")
  default_used = optimizer is None
  optimizer = optimizer or default_optimizer(config.learning_rate, config.steps,
                                             weight_decay=config.weight_decay)
  key = jax.random.fold_in(jax.random.key(config.seed), 1)
  x1 = jnp.asarray(source.first_x)
  checkpoints = record = None
  if config.checkpoint_dir is not None:   # directory and record checked before any work
    checkpoints = _Checkpoints(config.checkpoint_dir, config.checkpoint_every,
                               resume=config.resume)
    record = _run_record(jax.eval_shape(lambda k, x: init_state(fns, optimizer, k, x), key, x1),
                         source.record, config, default_optimizer_used=default_used,
                         run_info=run_info, loss_given=loss_fn is not None)
    if config.resume:
      checkpoints.check_record(record)
  # The step donates its state, so arrays the caller owns (an NNX model's parameters, the
  # initial_params given) are copied; a compiled initialisation's arrays are the loop's own.
  fresh = isinstance(fns.module, nn.Module)
  if fresh:
    # One compiled initialisation (on a mesh, leaving the state where the step wants it;
    # every process computes the same values): eager initialisation compiles op by op, the
    # larger cost in a fresh process (ConvNeXt on 8 devices: 12.8 s eager; ResNet-8 on one
    # device: 110 small compiles, 3.3 s of a 7.5 s two-step `jmem train` at -O0).
    init = jax.jit(lambda x: init_state(fns, optimizer, jax.random.fold_in(
        jax.random.key(config.seed), 1), x), out_shardings=fns.sharding)
    state = init(np.asarray(source.first_x))
  else:
    state = init_state(fns, optimizer, key, x1)
  if initial_params is not None:
    params = override_params(state.params, initial_params)
    state = state._replace(params=params, opt_state=optimizer.init(params))
    fresh = False
  start = 0
  if checkpoints is not None and config.resume:
    state = checkpoints.restore(state, fns.sharding)
    start = int(state.step)
    source.skip(start)
  if fns.sharding is not None:     # where the step leaves it: no second compile
    state = _place(state, fns.sharding)
  if not fresh:
    state = jax.tree.map(lambda a: a.copy(), state)
  step_fn = make_train_step(fns, optimizer, seed=config.seed, loss_fn=loss_fn)
  # On a mesh each process reads its own rows of a step's global batch, padded (and masked)
  # to a multiple of the data axis.
  size = padded_size(fns, config.batch_size)
  if size != config.batch_size:
    _check_takes_mask(fns)
  history: list[dict[str, float]] = []
  end = config.steps if stop_after is None else min(stop_after, config.steps)

  test = eval_data if eval_data is not None else source.test
  if test is not None:
    test = tuple(np.asarray(a) for a in _xy_pair(test, "eval_data", "eval_data"))

  def report(metrics) -> dict[str, float]:
    """The training step's ``metrics`` (None: no step run) and the test set's figures (if
    there is a test set): accuracy with the default loss, the loss with a ``loss_fn``."""
    out = {} if metrics is None else {"loss": float(metrics["loss"])}
    if metrics is not None and "accuracy" in metrics:       # class labels (make_train_step)
      out["train_accuracy"] = float(metrics["accuracy"])
    if test is None:
      return out
    if loss_fn is not None:
      out["test_loss"] = evaluate_loss(fns, state, *test, loss_fn)
      if "train_accuracy" not in out:       # a regression's targets, say: no accuracy
        return out
    return {**out, "test_accuracy": evaluate(fns, state, *test)}

  from rich.progress import Progress  # pylint: disable=g-import-not-at-top
  show = config.progress and jax.process_index() == 0
  wait = config.wait_each_step
  if wait is None:
    wait = _collectives_need_waiting(state)
  done, saved_step = start, (start if config.resume else None)
  stop = _Stop(lambda: (done, saved_step), config.steps, None if checkpoints is None
               else checkpoints.directory)
  floor = config.stall_timeout
  if floor is None:
    floor = 120.0 if (wait or jax.process_count() > 1) else 0.0
  watch = _StallWatch(floor, lambda: (done, saved_step), None if checkpoints is None
                      else checkpoints.directory)
  try:
    with stop, watch, Progress(disable=not show, transient=True) as bar:
      task = bar.add_task(f"train {source.name}", total=config.steps, completed=start)
      metrics = None
      for step in range(start, end):
        batch = source.get(step, fns, size)
        if batch is None:                              # an iterable of batches ended
          warnings.warn(f"The batches ended after {done} steps, before steps="
                        f"{config.steps}: training stops at step {done}.", stacklevel=2)
          if checkpoints is not None and saved_step != done and done > start:
            with stop.deferred(), watch.paused():
              if checkpoints.save(done, state, record, force=True):
                saved_step = done
          break
        x, y, mask = batch
        state, metrics = (step_fn(state, x, y) if mask is None else step_fn(state, x, y, mask))
        if wait:
          jax.block_until_ready(metrics)
        done = step + 1
        watch.beat()
        if checkpoints is not None and (done % config.checkpoint_every == 0
                                        or done == config.steps):
          # A signal meanwhile stops the run after the write.
          with stop.deferred(), watch.paused():
            if checkpoints.save(done, state, record, force=done == config.steps):
              saved_step = done
        if config.eval_every and done % config.eval_every == 0 and done != config.steps:
          with watch.paused():
            history.append({"step": done, **report(metrics)})
        bar.update(task, completed=done)
  finally:
    if checkpoints is not None:
      checkpoints.close()
  if stop_after is not None and end < config.steps:
    return TrainResult(state, None if loss_fn is not None else float("nan"), history, start,
                       float("nan") if loss_fn is not None else None)
  final = {"step": done, **report(metrics)}
  history.append(final)
  return TrainResult(state, final.get("test_accuracy"), history, start, final.get("test_loss"))
