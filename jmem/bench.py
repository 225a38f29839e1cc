"""`jmem bench`: every registered technique against the exact baseline, in one run.

Each row reports what the technique saves (saved activation bytes, compiled temp bytes),
what it costs (step-time ratio to exact, measured interleaved in the same process) and
whether the model still learns (test accuracy, mean over seeds).

Every technique is built as a user builds it: ``jmem.convert(model, *techniques)`` on the
plain model (`build_model`). A technique registers itself once with `register_technique`
(a name and its `jmem.convert` technique); the bench, the CLI and the benchmark scripts
pick it up from the registry.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import json
import os
import re
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flax import linen as nn
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jmem import data as data_lib
from jmem import measure
from jmem import models as models_lib
from jmem import surgery
from jmem import step as step_lib
from jmem._technique import IMPLEMENTATIONS as IMPLEMENTATIONS
from jmem._technique import BenchTechnique
from jmem.ops.actnn.technique import calibration_problem as calibration_problem
from jmem.techniques import get_technique, register_technique, technique_names

__all__ = [
    "Technique", "IMPLEMENTATIONS", "BenchConfig", "register_technique", "get_technique", "technique_names",
    "run_bench", "write_results", "format_table", "step_memory", "saved_bytes", "batch_fit",
    "calibration_problem", "make_dataset", "min_frame_size", "default_image_size",
    "techniques_for", "build_model", "caption", "source_commit", "is_factory",
    "load_factory", "check_classifier", "check_input_shape", "digits_at",
]


# The bench's record of a technique (``jmem.bench.Technique``: register your own with
# `register_technique`); the registry is `jmem.techniques`, shared with `jmem.convert`.
Technique = BenchTechnique


DTYPES = ("float32", "bfloat16")


def check_dtype(model: str, dtype: str) -> None:
  """Raises unless ``model`` (a registered name) can compute in ``dtype`` (`DTYPES`). A
  factory (`is_factory`) is only imported here: whether its model takes ``dtype`` is seen
  when `create_model` builds it."""
  if dtype not in DTYPES:
    raise ValueError(f"Unknown compute dtype {dtype!r}; use one of {', '.join(DTYPES)}.")
  if is_factory(model):
    load_factory(model)
    return
  _check_model_name(model)
  if dtype != "float32" and not hasattr(models_lib.create_model(model, 10), "dtype"):
    raise ValueError(f"Model {model!r} has no compute dtype field, so it trains in float32 "
                     f"only; drop --dtype {dtype}.")


def create_model(name: str, num_classes: int, dtype: str = "float32", *, seed: int = 0,
                 example_shape: Sequence[int] | None = None):
  """The registered model ``name`` computing in ``dtype`` (mixed precision: its parameters
  stay float32), or the model of the factory ``name`` names (`is_factory`, `load_factory`).

  A factory is called with those of ``num_classes=``, ``dtype=`` (the compute dtype; float32
  only where the parameter has no default) and ``rngs=`` (``flax.nnx.Rngs(seed)``, for an
  NNX module) that its signature names, and nothing else; it returns a ``flax.linen.Module`` or a
  ``flax.nnx.Module``. A linen module whose factory takes no ``dtype=`` but which has a
  ``dtype`` field gets it by ``clone``. With ``example_shape`` (one example, e.g. ``(16, 16,
  1)``), the factory's model is checked to give ``[batch, num_classes]`` logits for it
  (`check_classifier`); a registered model is not checked.

  Raises:
    ValueError: for an unknown name, a factory that cannot be imported or called as above
      or returns no Flax module, or (with ``example_shape``) a model that fails on such a
      batch or returns other than ``[batch, num_classes]`` logits.
  """
  check_dtype(name, dtype)
  if not is_factory(name):
    overrides = {} if dtype == "float32" else {"dtype": jnp.dtype(dtype)}
    return models_lib.create_model(name, num_classes, **overrides)
  model = _call_factory(name, num_classes, dtype, seed)
  if example_shape is not None:
    check_classifier(model, example_shape, num_classes, name=name)
  return model


# --- Models from the user's code: --model pkg.module:factory or path/to/file.py:factory ---

def _check_model_name(model: str) -> None:
  if model not in models_lib.MODEL_NAMES and not is_factory(model):
    raise ValueError(f"Unknown model {model!r}; valid models: "
                     f"{', '.join(models_lib.MODEL_NAMES)}, or your own as "
                     "module:factory or path/to/file.py:factory.")


# What a factory may be called with: keywords its signature names (`create_model`).
FACTORY_KEYWORDS = ("num_classes", "dtype", "rngs")


def is_factory(model: str) -> bool:
  """Whether ``model`` names a factory in the user's code (``pkg.module:factory`` or
  ``path/to/file.py:factory``) rather than a registered model (`jmem.models.MODEL_NAMES`)."""
  return ":" in model and model not in models_lib.MODEL_NAMES


def _one_line(e: BaseException, limit: int = 300) -> str:
  """``Type: message`` of an exception on one line, cut to ``limit`` characters."""
  text = " ".join(str(e).split())
  text = text if len(text) <= limit else text[:limit - 3] + "..."
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _import_file(path: str, spec: str):
  """The module of the Python file ``path``, imported once per process (under a name made
  from its absolute path, so its classes keep one identity however often it is asked for)."""
  full = os.path.abspath(path)
  if not os.path.isfile(full):
    looked = "" if full == path else f" (looked for {full})"
    raise ValueError(f"Model factory {spec!r}: there is no file {path!r}{looked}; give an "
                     "existing path/to/file.py:factory.")
  name = "_jmem_factory_" + re.sub(r"\W", "_", full)
  if name in sys.modules:
    return sys.modules[name]
  loader_spec = importlib.util.spec_from_file_location(name, full)
  if loader_spec is None or loader_spec.loader is None:
    raise ValueError(f"Model factory {spec!r}: {path!r} cannot be imported as Python (is it "
                     "a .py file?).")
  module = importlib.util.module_from_spec(loader_spec)
  sys.modules[name] = module      # dataclasses (every linen module) look their module up
  try:
    loader_spec.loader.exec_module(module)
  except Exception as e:  # pylint: disable=broad-except  (the user's code: any error)
    del sys.modules[name]
    raise ValueError(f"Model factory {spec!r}: importing {path!r} raised {_one_line(e)}") from e
  return module


def _import_module(dotted: str, spec: str):
  """The module ``dotted``, searched on ``sys.path`` and then in the current directory."""
  if os.getcwd() not in sys.path and "" not in sys.path:
    sys.path.append(os.getcwd())      # as `python -m` finds a module of the working directory
  try:
    return importlib.import_module(dotted)
  except ModuleNotFoundError as e:
    parts = dotted.split(".")
    if e.name in {".".join(parts[:i]) for i in range(1, len(parts) + 1)}:
      raise ValueError(
          f"Model factory {spec!r}: no module named {e.name!r} on the Python path or in the "
          f"current directory ({os.getcwd()}); add its directory to PYTHONPATH, or give the "
          "file: path/to/file.py:factory.") from e
    raise ValueError(f"Model factory {spec!r}: importing {dotted!r} raised "
                     f"{_one_line(e)}") from e
  except Exception as e:  # pylint: disable=broad-except  (the user's code: any error)
    raise ValueError(f"Model factory {spec!r}: importing {dotted!r} raised "
                     f"{_one_line(e)}") from e


def _callables(module) -> list[str]:
  """The public callables ``module`` defines (all its public callables if it defines none)."""
  public = {n: v for n, v in vars(module).items()
            if not n.startswith("_") and callable(v) and not inspect.ismodule(v)}
  own = [n for n, v in public.items() if getattr(v, "__module__", None) == module.__name__]
  return sorted(own or public)


def load_factory(spec: str) -> Callable[..., Any]:
  """The callable ``spec`` names: ``pkg.module:factory`` (imported as Python imports it, the
  current directory searched last) or ``path/to/file.py:factory``; ``factory`` may be
  dotted (``module:Zoo.small``).

  Raises:
    ValueError: naming what is wrong: a spec not of that form, a module that does not
      import (and why), an attribute it does not have (with the callables it has), or one
      that is not callable.
  """
  where, _, attr = spec.rpartition(":")
  if not where or not attr:
    raise ValueError(f"Model factory {spec!r}: give it as module:factory (e.g. "
                     "mypkg.models:make_cnn) or path/to/file.py:factory.")
  is_file = where.endswith(".py") or "/" in where or os.sep in where
  module = _import_file(where, spec) if is_file else _import_module(where, spec)
  obj = module
  for part in attr.split("."):
    if not hasattr(obj, part):
      names = _callables(module)
      shown = ", ".join(names[:20]) + (", ..." if len(names) > 20 else "")
      raise ValueError(f"Model factory {spec!r}: {where!r} has no attribute {attr!r}; its "
                       f"callables: {shown or 'none'}.")
    obj = getattr(obj, part)
  if not callable(obj):
    raise ValueError(f"Model factory {spec!r}: {attr!r} is not callable (type "
                     f"{type(obj).__name__}); name a function or class that returns a Flax "
                     "module.")
  return obj


def _call_factory(spec: str, num_classes: int, dtype: str, seed: int):
  """`create_model` of a factory: called as its docstring says, the result checked to be a
  Flax module computing in ``dtype``."""
  factory = load_factory(spec)
  try:
    params = inspect.signature(factory).parameters
  except (TypeError, ValueError):
    params = {}
  named = {n for n, p in params.items()
           if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
  offered = {"num_classes": lambda: num_classes, "rngs": lambda: nnx.Rngs(seed)}
  if dtype != "float32" or ("dtype" in params
                            and params["dtype"].default is inspect.Parameter.empty):
    offered["dtype"] = lambda: jnp.dtype(dtype)
  kwargs = {k: make() for k, make in offered.items() if k in named}
  missing = [n for n, p in params.items() if p.default is p.empty and n not in kwargs
             and n not in FACTORY_KEYWORDS
             and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
  if missing:
    raise ValueError(
        f"Model factory {spec!r} needs {', '.join(missing)}, which jmem cannot give: it "
        f"passes only {', '.join(f'{k}=' for k in FACTORY_KEYWORDS)} (those the signature "
        "names); give the others defaults.")
  shown = {"num_classes": str(num_classes), "dtype": f"jnp.{dtype}", "rngs": f"nnx.Rngs({seed})"}
  call = f"{spec.rpartition(':')[2]}({', '.join(f'{k}={shown[k]}' for k in kwargs)})"
  try:
    model = factory(**kwargs)
  except Exception as e:  # pylint: disable=broad-except  (the user's code: any error)
    raise ValueError(f"Model factory {spec!r}: {call} raised {_one_line(e)}") from e
  if isinstance(model, type) and issubclass(model, (nn.Module, nnx.Module)):
    raise ValueError(f"Model factory {spec!r}: {call} returned the class {model.__name__}, "
                     f"not a module; return an instance, e.g. {model.__name__}(...).")
  if not isinstance(model, (nn.Module, nnx.Module)):
    raise ValueError(f"Model factory {spec!r}: {call} returned a {type(model).__name__}; "
                     "expected a flax.linen.Module or a flax.nnx.Module.")
  if dtype != "float32" and "dtype" not in kwargs:
    if isinstance(model, nn.Module) and "dtype" in {f.name for f in dataclasses.fields(model)}:
      return model.clone(dtype=jnp.dtype(dtype))
    raise ValueError(f"Model factory {spec!r} takes no dtype= and its model has no dtype "
                     f"field, so it computes in float32 only; drop --dtype {dtype} or add a "
                     "dtype parameter to the factory.")
  return model


def check_classifier(model, example_shape: Sequence[int], num_classes: int, *,
                     name: str = "model") -> None:
  """Raises unless ``model`` (linen or NNX) maps a float32 batch of ``example_shape``
  examples to logits ``[batch, num_classes]`` (traced with `jax.eval_shape`: nothing is
  computed), as `jmem.train.train` on a `jmem.data` classification set needs.

  Raises:
    ValueError: saying what the model did on such a batch and what was expected.
  """
  fns = step_lib.model_fns(model)
  x = jax.ShapeDtypeStruct((2,) + tuple(example_shape), jnp.float32)

  def logits(key, x):
    params, state = fns.init(key, x)
    return fns.apply(params, state, x, train=False)[0]
  try:
    out = jax.eval_shape(logits, jax.random.key(0), x)
  except Exception as e:  # pylint: disable=broad-except  (the user's model: any error)
    raise ValueError(
        f"Model {name!r} fails on a float32 batch of shape {x.shape} ([batch, H, W, C]): "
        f"{_one_line(e)}. Give the input shape it takes with --input-shape H,W,C.") from e
  want = (2, num_classes)
  if not (isinstance(out, jax.ShapeDtypeStruct) and out.shape == want
          and jnp.issubdtype(out.dtype, jnp.floating)):
    got = (f"{out.dtype}{list(out.shape)}" if isinstance(out, jax.ShapeDtypeStruct)
           else f"a {type(out).__name__}")
    raise ValueError(
        f"Model {name!r} returns {got} for a batch of shape {x.shape}; expected float logits "
        f"of shape [batch, {num_classes}]: the digits are {num_classes} classes, one label "
        "per image (a factory must be an image classifier; video and per-pixel models are "
        "the registered ones only).")


def digits_at(x: np.ndarray, input_shape: Sequence[int]) -> np.ndarray:
  """``float32[N, h, w, 1]`` gray images (`jmem.data.digits`) at ``input_shape = (H, W,
  C)``: bilinearly resized to ``H x W`` where they are another size, the gray channel
  repeated ``C`` times."""
  h, w, c = input_shape
  if x.shape[1:3] != (h, w):
    from jmem import _extras  # pylint: disable=g-import-not-at-top
    ndimage = _extras.require("scipy.ndimage", "Resizing the digits")
    zoom = (1.0, h / x.shape[1], w / x.shape[2], 1.0)
    x = ndimage.zoom(x, zoom, order=1, mode="nearest", grid_mode=True)
  return np.repeat(x, c, axis=-1).astype(np.float32) if c != 1 else x.astype(np.float32)


def check_input_shape(model: str, input_shape: Sequence[int] | None) -> None:
  """Raises unless ``input_shape`` is None or three positive sizes ``(H, W, C)`` for an image
  classifier ``model`` (a factory, or a registered image model)."""
  if input_shape is None:
    return
  if (len(input_shape) != 3 or
      not all(isinstance(v, (int, np.integer)) and v > 0 for v in input_shape)):
    raise ValueError(f"input_shape must be three positive integers (H, W, C), got "
                     f"{input_shape!r}.")
  task = models_lib.model_task(model)
  if task != "image":
    raise ValueError(f"--input-shape is for image classifiers; {model!r} is a {task} model, "
                     "which takes --image-size (and 1-channel digits).")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  """Options of `run_bench` (the CLI flags of ``jmem bench``).

  Attributes:
    model: a name from `jmem.models.MODEL_NAMES`, or a factory in the user's code:
      ``pkg.module:factory`` or ``path/to/file.py:factory`` (`create_model`).
    techniques: technique names; ``exact`` is always measured first as the baseline.
    batch_size: examples per step.
    image_size: side of the (resized) digit images, or of the frames of the moving-digit
      clips for video models (digits of a third of it; at least 22 for 16 frames:
      `min_frame_size`). The CLI's default: `default_image_size`.
    num_frames: frames per clip (video models only).
    train_clips: training clips rendered for video models (more clips: less overfitting).
    steps: training steps per technique and seed.
    seeds: one training run per seed; accuracy is their mean.
    memory_only: compile and measure memory only, no training or timing.
    learning_rate: peak AdamW learning rate.
    timing_repeats: timed steps per technique (after two warm-up steps).
    budgets_gib: device memory budgets (GiB) for the largest batch of each technique
      (`jmem.measure.fit_batch`: the step compiled at ``batch_size`` and twice that gives
      the bytes per example; the batch the line predicts is compiled to confirm it).
      Empty: no largest batch, two compiles fewer per technique. None (the default): the
      target's memory limit where it has one (``"h100"``: 76,516,687,872 bytes), else 16
      and 80 GiB.
    target: the device the memory figures are for (`jmem.measure.target`: None for JAX's
      default backend, ``"h100"`` for an H100 compiled for from this machine). Training
      and timing run on this machine; with a GPU target, the table says so.
    input_shape: ``(H, W, C)`` of one image, for an image classifier that needs it (a
      factory's above all): the digits resized to ``H x W``, their gray channel repeated
      ``C`` times (`make_dataset`); None: ``image_size`` square, 1 channel.
    calibrate: ActNN L3-L5 calibrate their per-site bits on a training batch first
      (`jmem.surgery.calibrate`); False: the level's bits everywhere, as
      ``jmem.technique(name)`` gives them.
    dtype: the compute dtype, ``"float32"`` or ``"bfloat16"`` (mixed precision: parameters
      and optimiser state stay float32; activations, and so the residuals every technique
      stores, are bfloat16). Every row, exact's included, uses it. Models with a ``dtype``
      field only (every registered model has one).
  """

  model: str = "resnet20"
  techniques: tuple[str, ...] = ("exact", "remat")
  batch_size: int = 128
  image_size: int = 16
  steps: int = 300
  seeds: tuple[int, ...] = (0,)
  num_frames: int = 16
  train_clips: int = 1024
  memory_only: bool = False
  learning_rate: float = 3e-3
  timing_repeats: int = 10
  budgets_gib: tuple[float, ...] | None = None
  dtype: str = "float32"
  target: str | None = None
  input_shape: tuple[int, int, int] | None = None
  calibrate: bool = True

  def validate(self) -> None:
    _check_model_name(self.model)
    check_input_shape(self.model, self.input_shape)
    for t in self.techniques:
      get_technique(t)
    if not isinstance(self.steps, int) or self.steps < 0:
      raise ValueError(f"steps must be a non-negative integer, got {self.steps!r}.")
    if self.batch_size < 1:
      raise ValueError(f"batch_size must be >= 1, got {self.batch_size}.")
    if self.image_size < 1:
      raise ValueError(f"image_size must be >= 1, got {self.image_size}.")
    step_lib.check_learning_rate(self.learning_rate)
    if not self.seeds:
      raise ValueError("Give at least one seed.")
    if self.timing_repeats < 1:
      raise ValueError(f"timing_repeats must be >= 1, got {self.timing_repeats}.")
    if self.budgets_gib is not None and not isinstance(self.budgets_gib, (tuple, list)):
      raise ValueError(f"budgets_gib must be a tuple of GiB, e.g. (16, 80), got "
                       f"{self.budgets_gib!r}.")
    for b in self.budgets_gib or ():
      if (not isinstance(b, (int, float)) or isinstance(b, bool) or not b > 0
          or b == float("inf")):
        raise ValueError(f"Memory budgets must be positive, finite numbers of GiB, got {b!r}.")
    check_dtype(self.model, self.dtype)
    measure.target(self.target)

  def budgets(self) -> tuple[int, ...]:
    """The budgets in bytes: `budgets_gib`'s, or by default the target's memory limit
    (16 and 80 GiB where it has none)."""
    if self.budgets_gib is not None:
      return tuple(int(g * measure.GIB) for g in self.budgets_gib)
    limit = measure.target(self.target).memory_limit
    return (limit,) if limit is not None else (16 * measure.GIB, 80 * measure.GIB)


def min_frame_size(num_frames: int) -> int:
  """The smallest frame side of `make_dataset`'s moving-digit clips of ``num_frames``
  frames: a digit a third of the frame moving one pixel per frame needs ``num_frames - 1``
  pixels of room (22 for 16 frames)."""
  need = 3
  while need - need // 3 < num_frames - 1:    # frame minus digit >= travel
    need += 1
  return need


def default_image_size(model: str, num_frames: int = 16, at_least: int = 16) -> int:
  """An image side for the registered model ``model`` when none is given: ``at_least``, or
  the smallest frame its moving-digit clips of ``num_frames`` frames need if larger (video
  models: `min_frame_size`), rounded up to a multiple of the model's unit
  (`jmem.models.image_size_unit`): 16 for the ResNets and the U-Net, 32 for ConvNeXt-T to
  -XL, 22 for stt-resnet8 and 24 for the video ViT (patches of 8) with 16 frames. An unknown
  name gets ``at_least`` (and is refused where it is built)."""
  if model not in models_lib.MODEL_NAMES:
    return at_least
  side = at_least
  if models_lib.model_task(model) == "video":
    side = max(side, min_frame_size(num_frames))
  unit = models_lib.image_size_unit(model)
  return -(-side // unit) * unit


def make_dataset(model: str, image_size: int, *, num_frames: int = 16,
                 train_clips: int = 1024, test_clips: int = 256,
                 input_shape: Sequence[int] | None = None) -> data_lib.Dataset:
  """The data ``jmem bench`` and ``jmem train`` use for the model named ``model``.

  Image models (a factory's too) get the digits resized to ``image_size``, or with
  ``input_shape = (H, W, C)`` to ``H x W`` with their gray channel repeated ``C`` times
  (`digits_at`; image models only), segmentation models the same digits
  with a label per pixel (`jmem.data.digit_segmentation`); video models get moving-digit clips
  of ``num_frames`` frames of side ``image_size``, the digits a third of it, moving one pixel
  per frame (so the frame must leave ``num_frames - 1`` pixels of room).

  Raises:
    ValueError: if ``image_size`` is too small for clips of ``num_frames`` frames.
  """
  check_input_shape(model, input_shape)
  if input_shape is not None:
    h, w, c = input_shape
    ds = data_lib.digits(h if h == w else 8)
    if (w, c) == (h, 1):
      return ds
    data_lib.check_fits_in_memory(f"The digits at {h}x{w}x{c}",
                                  2 * (len(ds.x_train) + len(ds.x_test)) * h * w * c,
                                  flag="--input-shape")
    return data_lib.Dataset(f"digits{h}x{w}x{c}", digits_at(ds.x_train, input_shape),
                            ds.y_train, digits_at(ds.x_test, input_shape), ds.y_test,
                            ds.num_classes)
  task = models_lib.model_task(model)
  if task == "segmentation":
    return data_lib.digit_segmentation(image_size)
  if task != "video":
    return data_lib.digits(image_size)
  need = min_frame_size(num_frames)
  if image_size < need:
    raise ValueError(
        f"Image size {image_size} is too small for video clips of {num_frames} frames: a "
        f"digit a third of the frame moving 1 px per frame needs frames of at least "
        f"{need}x{need}; use --image-size {need} or more, or fewer --num-frames.")
  return data_lib.moving_digits(num_frames, frame_size=image_size, digit_size=image_size // 3,
                                num_train=train_clips, num_test=test_clips)


def techniques_for(name: str, model, dataset: data_lib.Dataset, batch_size: int, *,
                   target=None, calibrate: bool = True) -> tuple:
  """The `jmem.convert` techniques the registered name ``name`` (``"actnn-L3:xla"``)
  applies to ``model``: its technique at the suffix's implementation; for ActNN L3-L5 with
  per-site bits from gradient sensitivity on `calibration_problem` (`jmem.surgery.
  calibrate`; ``calibrate=False``: at the level's bits everywhere); then its data-dependent
  set-up (`jmem.bench.Technique.prepare`: the model's SBP sites, InPlace-ABN's pairs, a
  plan for ``target``). Empty: exact."""
  record = get_technique(name)
  techniques = record.techniques()
  if record.calibrate and calibrate:
    params, loss_fn, batch = calibration_problem(model, dataset, batch_size)
    techniques = tuple(surgery.calibrate(model, loss_fn, params, batch, t)
                       if isinstance(t, surgery.ActNN) else t for t in techniques)
  if record.prepare is not None:
    techniques = tuple(record.prepare(model, dataset, batch_size, techniques, target=target))
  return techniques


def build_model(name: str, model, dataset: data_lib.Dataset, batch_size: int, *,
                target=None, calibrate: bool = True):
  """``model`` with the registered technique ``name`` on, as a user builds it:
  ``jmem.convert(model, *techniques_for(...))`` (``model`` itself for exact). With
  ``jmem.Spatial`` it is the converted model's `jmem.step.ModelFns` with the train state
  replicated over the mesh and each batch sharded over H and W (what `jmem.train` and the
  compiled step need)."""
  techniques = techniques_for(name, model, dataset, batch_size, target=target,
                              calibrate=calibrate)
  converted = surgery.convert(model, *techniques) if techniques else model
  spatial = next((t for t in techniques if isinstance(t, surgery.Spatial)), None)
  if spatial is None:
    return converted
  spec = P(spatial.data_axis, *spatial.axes)
  return step_lib.model_fns(converted)._replace(
      sharding=NamedSharding(spatial.mesh, P()),
      batch_sharding=NamedSharding(spatial.mesh, spec))


def _log(msg: str, quiet: bool) -> None:
  if not quiet:
    print(msg, file=sys.stderr, flush=True)


def step_memory(fns, optimizer, x_spec, y_spec, *, step=None, target=None) -> tuple[int, int]:
  """``(saved activation bytes, compiled temp bytes)`` of a whole train step, compile-only,
  for ``target`` (`jmem.measure.target`; default: JAX's default backend).

  ``step`` is the jitted step to compile (default: a fresh non-donating one).
  """
  on = measure.target(target)
  abstract, xs, ys = _placed(fns, step_lib.abstract_state(fns, optimizer, x_spec), x_spec,
                             y_spec)
  step = step or step_lib.make_train_step(fns, optimizer, donate=False)
  temp = on.memory(step, abstract, xs, ys).temp_bytes
  return saved_bytes(fns, optimizer, x_spec, y_spec, abstract=abstract, target=on), temp


def _placed(fns, abstract, x_spec, y_spec):
  """The step's abstract arguments placed as `jmem.train` places them: on ``fns``' mesh
  where it has one (``sharding`` for the state, ``batch_sharding`` for x and the rows of
  y), else as they are."""
  if fns.batch_sharding is None:
    return abstract, x_spec, y_spec
  on = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
  rows = step_lib._rows_sharding(  # pylint: disable=protected-access
      fns.batch_sharding, len(y_spec.shape))
  return (jax.tree.map(lambda a: on(a, fns.sharding), abstract),
          on(x_spec, fns.batch_sharding), on(y_spec, rows))


def saved_bytes(fns, optimizer, x_spec, y_spec, *, abstract=None, target=None) -> int:
  """Activation bytes the train step's loss saves for its backward pass (traced only, with
  the kernels ``target`` would choose)."""
  abstract = abstract or step_lib.abstract_state(fns, optimizer, x_spec)
  loss = step_lib.make_loss(fns)
  rng = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
  with measure.target(target).lowering():
    report = measure.saved_residuals(lambda *a: loss(*a)[0], abstract.params,
                                     abstract.model_state, x_spec, y_spec, rng, argnums=0)
  return report.activation_bytes


def batch_fit(fns, optimizer, x_spec, y_spec, budgets_gib=(16.0, 80.0), *, target=None,
              budgets: Sequence[int] | None = None, on_compile=None) -> measure.BatchFit:
  """`jmem.measure.fit_step` of the (donating) train step on ``target``: device bytes at
  the batch of ``x_spec`` and at twice it, and the largest batch under each budget
  (``budgets`` in bytes, else ``budgets_gib`` in GiB). ``on_compile(batch, compiled,
  lowered)``: called with each compile."""
  abstract = step_lib.abstract_state(fns, optimizer, x_spec)
  step = step_lib.make_train_step(fns, optimizer, donate=True)
  on = measure.target(target)
  spec = lambda a, b: jax.ShapeDtypeStruct((b,) + a.shape[1:], a.dtype)

  def compile_at(b):
    lowered = on.lower(step, *_placed(fns, abstract, spec(x_spec, b), spec(y_spec, b)))
    compiled = on.compile_lowered(lowered)
    if on_compile is not None:
      on_compile(b, compiled, lowered)
    return compiled, lowered
  b = x_spec.shape[0]
  budgets = ([int(g * measure.GIB) for g in budgets_gib] if budgets is None
             else [int(v) for v in budgets])
  fit = measure.fit_batch(compile_at, (b, 2 * b), budgets)
  return dataclasses.replace(fit, target=on.name)


def _budget_key(budget: int) -> str:
  """A budget in bytes as a row's key: ``"16GiB"``, ``"71.26GiB"``."""
  return f"{budget / measure.GIB:.4g}GiB"


def run_bench(config: BenchConfig = BenchConfig(), *, quiet: bool = False,
              progress: bool = True) -> list[dict[str, Any]]:
  """Runs the bench and returns one row per technique (baseline ``exact`` first).

  Row keys: technique, model, dataset, batch_size, image_size (and input_shape where the
  config gives one), steps, seeds, saved_bytes,
  temp_bytes, baseline_saved_bytes, baseline_temp_bytes, saved_ratio, temp_ratio,
  step_time_s, step_time_ratio, accuracy, accuracy_per_seed (time and accuracy are None
  with ``memory_only``); from `batch_fit`: per_example_bytes (device bytes one more example
  costs), per_example_temp_bytes, fixed_bytes, max_batch (``{"16GiB": n, ...}``, each
  seen to fit by a compile: a lower bound), over_budget (the smallest batch seen not to),
  max_batch_ratio (exact's per-example temp bytes over the
  technique's: the max-batch multiplier), flops and flops_ratio (`jmem.measure.step_flops` of
  the step), estimated_step_s and estimated_step_ratio (on a GPU target with fitted
  constants, `jmem.measure.estimate_step_time` of the step compiled at the batch size, and
  its ratio to exact's: an estimate, not a measurement; else None), collectives (op ->
  count in the compiled step, those it has), target and
  target_label (the device every memory figure is for: `BenchConfig.target`), measured_on
  (where step time and accuracy were measured: this machine; absent with ``memory_only``),
  calibrated (ActNN L3-L5's per-site bits calibrated on a training batch).
  """
  config.validate()
  on, budgets = measure.target(config.target), config.budgets()
  names = ["exact"] + [t for t in config.techniques if t != "exact"]
  dataset = make_dataset(config.model, config.image_size, num_frames=config.num_frames,
                         train_clips=config.train_clips, input_shape=config.input_shape)
  if not config.memory_only and config.batch_size > len(dataset.x_train):
    raise ValueError(
        f"batch_size {config.batch_size} is larger than the {len(dataset.x_train)} training "
        f"examples of {dataset.name}; lower --batch-size.")
  base_model = create_model(config.model, dataset.num_classes, config.dtype,
                            seed=config.seeds[0], example_shape=dataset.example_shape)
  x_spec = jax.ShapeDtypeStruct((config.batch_size,) + dataset.example_shape, jnp.float32)
  y_spec = jax.ShapeDtypeStruct((config.batch_size,) + dataset.y_train.shape[1:], jnp.int32)
  rows: list[dict[str, Any]] = []
  timing_steps: dict[str, Callable[[], Any]] = {}
  # Built before anything compiles: a technique the model cannot take fails at once (those
  # that compute first, calibrating bits or planning, are built in turn).
  costly = lambda r: (r.calibrate and config.calibrate) or r.convert is None
  build = lambda name: build_model(name, base_model, dataset, config.batch_size, target=on,
                                   calibrate=config.calibrate)
  built = {name: build(name) for name in names if not costly(get_technique(name))}
  for name in names:
    if name not in built:
      _log(f"[{name}] preparing (calibration or planning on a training batch)", quiet)
    model = built[name] if name in built else build(name)
    fns = step_lib.model_fns(model)
    optimizer = step_lib.default_optimizer(config.learning_rate, max(config.steps, 1))
    size = ("x".join(map(str, config.input_shape)) if config.input_shape
            else f"{config.image_size}x{config.image_size}")
    _log(f"[{name}] compiling {config.model} step (batch {config.batch_size}, {size}) for "
         f"{on.short}", quiet)
    # The donating step (as `jmem train` runs it) at the batch size gives the temp bytes.
    estimated = {}
    constants = measure.constants_for(on.name) if on.deviceless else None

    def estimate(b, compiled, lowered, constants=constants, estimated=estimated):
      # The target's step time, estimated from the module compiled at the bench's batch.
      if constants is not None and b == config.batch_size and not estimated:
        estimated["s"] = measure.estimate_step_time(
            compiled, measure.lowered_flops(lowered), dtype=config.dtype,
            constants=constants).seconds
    fit = batch_fit(fns, optimizer, x_spec, y_spec, target=on, budgets=budgets,
                    on_compile=estimate)
    saved = saved_bytes(fns, optimizer, x_spec, y_spec, target=on)
    temp = fit.temp_bytes[0]
    row: dict[str, Any] = dict(
        technique=name, model=config.model, dataset=dataset.name, dtype=config.dtype,
        batch_size=config.batch_size, image_size=config.image_size, steps=config.steps,
        seeds=list(config.seeds), target=on.name, target_label=on.label,
        calibrated=bool(get_technique(name).calibrate and config.calibrate),
        saved_bytes=saved, temp_bytes=temp,
        per_example_bytes=fit.per_example_bytes,
        per_example_temp_bytes=fit.per_example_temp_bytes, fixed_bytes=fit.fixed_bytes,
        max_batch={_budget_key(g): fit.max_batch[g] for g in budgets},
        over_budget={_budget_key(g): fit.over_budget[g] for g in budgets},
        flops=fit.flops, collectives=fit.collectives, step_time_s=None, step_time_ratio=None,
        estimated_step_s=estimated.get("s"), accuracy=None,
        accuracy_per_seed=None)
    if config.input_shape:
      row["input_shape"] = list(config.input_shape)
    if not config.memory_only:
      from jmem import train as train_lib  # pylint: disable=g-import-not-at-top
      accs = []
      state = None
      for seed in config.seeds:
        _log(f"[{name}] training seed {seed} for {config.steps} steps", quiet)
        result = train_lib.train(
            model, dataset,
            train_lib.TrainConfig(steps=config.steps, batch_size=config.batch_size,
                                  learning_rate=config.learning_rate, seed=seed,
                                  progress=progress and not quiet))
        accs.append(result.test_accuracy)
        if state is None:
          state = result.state
      row["accuracy_per_seed"] = accs
      row["accuracy"] = float(statistics.mean(accs))
      idx = data_lib.batch_indices(len(dataset.x_train), config.batch_size, 0, seed=0)
      xb, yb = jnp.asarray(dataset.x_train[idx]), jnp.asarray(dataset.y_train[idx])
      step = step_lib.make_train_step(fns, optimizer, donate=False)   # timed repeatedly
      timing_steps[name] = (lambda s=step, st=state: s(st, xb, yb))
      row["measured_on"] = _this_machine()
    rows.append(row)
  if timing_steps:
    _log(f"timing {len(timing_steps)} step functions, interleaved", quiet)
    times = measure.time_steps(timing_steps, repeats=config.timing_repeats, baseline="exact")
    for row in rows:
      row["step_time_s"] = times[row["technique"]]["median_s"]
      row["step_time_ratio"] = times[row["technique"]]["ratio"]
  base = rows[0]
  for row in rows:
    row["baseline_saved_bytes"] = base["saved_bytes"]
    row["baseline_temp_bytes"] = base["temp_bytes"]
    row["saved_ratio"] = row["saved_bytes"] / max(base["saved_bytes"], 1)
    row["temp_ratio"] = row["temp_bytes"] / max(base["temp_bytes"], 1)
    row["max_batch_ratio"] = (base["per_example_temp_bytes"] / row["per_example_temp_bytes"]
                              if row["per_example_temp_bytes"] > 0 else None)
    row["flops_ratio"] = row["flops"] / base["flops"] if base["flops"] else None
    row["estimated_step_ratio"] = (row["estimated_step_s"] / base["estimated_step_s"]
                                   if row.get("estimated_step_s") and
                                   base.get("estimated_step_s") else None)
  return rows


def _this_machine() -> str:
  """Where training and timing ran: this machine's default device."""
  device = jax.devices()[0]
  return f"{device.platform} ({device.device_kind})"


def _mib(n: int | None) -> str:
  return "-" if n is None else f"{n / 2**20:,.1f}"


def _ratio(v, fmt=".2f", suffix="") -> str:
  return "-" if v is None else f"{v:{fmt}}{suffix}"


def _max_batch_cell(row, budget) -> str:
  """The largest batch seen to fit; "≥" where the line's guess went over (temp is not
  linear in the batch there) and the search stopped before the bracket closed."""
  best, over = row["max_batch"][budget], row.get("over_budget", {}).get(budget)
  if best is None:
    return "- | "
  return f"{'≥' if over is not None and over - best > 1 else ''}{best:,} | "


def format_table(rows: Sequence[dict[str, Any]]) -> str:
  """A Markdown table of bench rows: the largest batch first, saved bytes after. A "≥" on
  a largest batch: a lower bound (a larger batch compiled went over the budget, and the
  true largest lies below it)."""
  budgets = list(rows[0].get("max_batch", {})) if rows else []
  where = caption(rows)
  short = f" ({where[0]})" if where[0] else ""
  on = f" ({where[1]})" if where[1] else ""
  estimated = any(r.get("estimated_step_ratio") is not None for r in rows)
  lines = [f"| technique | model | MiB / example{short} | " + "".join(
               f"max batch {b} | " for b in budgets) + "max-batch x | FLOPs / exact | "
           f"temp MiB{short} | temp / exact | saved MiB | saved / exact | "
           + (f"step / exact (estimated for the {where[0]}) | " if estimated else "") +
           f"step time / exact{on} | test accuracy{on} |",
           "|---|---|" + "---:|" * (len(budgets) + 9 + estimated)]
  for r in rows:
    a = "-" if r["accuracy"] is None else f"{100 * r['accuracy']:.2f}%"
    mb = "".join(_max_batch_cell(r, b) for b in budgets)
    model = r["model"] if r.get("dtype", "float32") == "float32" else f"{r['model']} ({r['dtype']})"
    name = r["technique"] + (" (calibrated)" if r.get("calibrated") else "")
    lines.append(f"| {name} | {model} | {r['per_example_temp_bytes'] / 2**20:.3g} | "
                 f"{mb}{_ratio(r['max_batch_ratio'], suffix='x')} | "
                 f"{_ratio(r['flops_ratio'], '.3f')} | {_mib(r['temp_bytes'])} | "
                 f"{r['temp_ratio']:.3f} | {_mib(r['saved_bytes'])} | {r['saved_ratio']:.3f} | "
                 + (f"{_ratio(r.get('estimated_step_ratio'), '.3f')} | " if estimated else "")
                 + f"{_ratio(r['step_time_ratio'])} | {a} |")
  return "\n".join(lines)


def caption(rows: Sequence[dict[str, Any]]) -> tuple[str, str]:
  """``(target, measured on)``: the short name of the target the rows' memory figures are
  for (``"H100 target"``; for this machine's default backend its compiler's, ``"XLA:CPU"``,
  since XLA:CPU's buffer assignment is not a GPU's) and where their step times and
  accuracies were measured where that is another device (``"host cpu"``; "" otherwise)."""
  label = next((r.get("target_label", "") for r in rows), "")
  name = next((r.get("target", "default") for r in rows), "default")
  short = label.split(" (")[0]
  if name == "default":
    return short, ""
  timed = any(r.get("measured_on") for r in rows)
  return short, ("host " + jax.devices()[0].platform) if timed else ""


def check_output_dir(path: str) -> str:
  """Creates ``path`` if needed and checks it is writable; returns its absolute path."""
  path = os.path.abspath(path)
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise ValueError(f"Cannot create output directory {path!r}: {e.strerror}. "
                     "Choose another with --output-dir.") from e
  if not os.access(path, os.W_OK):
    raise ValueError(f"Output directory {path!r} is not writable; choose another with "
                     "--output-dir.")
  return path


def source_commit() -> str | None:
  """The git commit of jmem's source checkout (``+changes`` when its tracked files differ
  from it), or None for an installed copy: every result file names what produced it.

  ``JMEM_SOURCE_COMMIT``, where set, is returned as it is: a checkout's files copied to
  another machine (a GPU's) name the commit they were copied from, whatever git there says.
  """
  import subprocess  # pylint: disable=g-import-not-at-top
  here = os.path.dirname(os.path.abspath(__file__))
  named = os.environ.get("JMEM_SOURCE_COMMIT") or None
  if named:
    return named
  try:
    head = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, timeout=10)
    if head.returncode != 0:
      return None
    dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, timeout=10)
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")
  except (OSError, subprocess.SubprocessError):
    return None


def write_results(rows: Sequence[dict[str, Any]], output_dir: str, *, stem: str = "bench",
                  meta: dict[str, Any] | None = None) -> dict[str, str]:
  """Writes ``<stem>.json``, ``<stem>.md`` and ``<stem>_memory.png``; returns their paths."""
  output_dir = check_output_dir(output_dir)
  meta = dict(meta or {})
  meta.setdefault("commit", source_commit())
  meta.setdefault("jax_version", jax.__version__)
  meta.setdefault("backend", jax.default_backend())
  meta.setdefault("device", str(jax.devices()[0].device_kind))
  paths = {k: os.path.join(output_dir, f"{stem}{suffix}") for k, suffix in
           (("json", ".json"), ("md", ".md"), ("png", "_memory.png"))}
  with open(paths["json"], "w") as f:
    json.dump({"meta": meta, "rows": list(rows)}, f, indent=2)
  with open(paths["md"], "w") as f:
    f.write(f"# jmem bench: {stem}\n\n")
    if rows and rows[0].get("target_label"):
      f.write(f"Memory figures for: {rows[0]['target_label']}.\n")
      if any(r.get("measured_on") for r in rows):
        f.write(f"Step time and accuracy measured on: {rows[0].get('measured_on')}.\n")
      f.write("\n")
    f.write("".join(f"- {k}: {v}\n" for k, v in meta.items()) + "\n")
    f.write(format_table(rows) + "\n")
  _plot(rows, paths["png"])
  return paths


def _plot(rows, path):
  """Left: the largest batch per technique at each budget (what a user buys); right: the
  saved activation and compiled temp bytes at the bench's batch."""
  from jmem import _extras  # pylint: disable=g-import-not-at-top
  matplotlib = _extras.require("matplotlib", "The bench's figures")
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  names = [r["technique"] for r in rows]
  x = np.arange(len(rows))
  budgets = list(rows[0].get("max_batch", {}))
  width = max(4, 1.2 * len(rows) + 2)
  fig, axes = plt.subplots(1, 2 if budgets else 1, figsize=(2 * width if budgets else width, 3.5),
                           squeeze=False)
  target, _ = caption(rows)
  title = (f"{rows[0]['model']}, {rows[0]['image_size']}x{rows[0]['image_size']}"
           + (f", memory for {target}" if target else ""))
  if budgets:
    ax = axes[0, 0]
    w = 0.8 / len(budgets)
    for k, b in enumerate(budgets):
      ax.bar(x - 0.4 + w * (k + 0.5), [r["max_batch"][b] or 0 for r in rows], w, label=b)
    for i, r in enumerate(rows):
      if r.get("max_batch_ratio"):
        ax.annotate(f"{r['max_batch_ratio']:.1f}x", (i, 0), textcoords="offset points",
                    xytext=(0, 3), ha="center", fontsize=8)
    ax.set_xticks(x, names)
    ax.set_ylabel("largest batch")
    ax.set_title(f"largest batch that fits: {title}")
    ax.legend()
  ax = axes[0, -1]
  ax.bar(x - 0.2, [r["saved_bytes"] / 2**20 for r in rows], 0.4, label="saved activations")
  ax.bar(x + 0.2, [r["temp_bytes"] / 2**20 for r in rows], 0.4, label="compiled temp")
  ax.set_xticks(x, names)
  ax.set_ylabel("MiB")
  ax.set_title(f"{title}, batch {rows[0]['batch_size']}")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
