"""The ``jmem`` command line: ``jmem bench`` (the main job) and ``jmem train``."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import signal
import sys
import warnings

from jmem import _extras

__all__ = ["main"]


def _int_list(text: str) -> tuple[int, ...]:
  try:
    return tuple(int(s) for s in text.split(",") if s.strip())
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def _budget_list(text: str) -> tuple[float, ...]:
  """``--budgets``: sizes as ``jmem plan --budget`` takes them (a bare number is GiB:
  ``16,80``; or with a unit: ``16GiB,800MiB``), in GiB."""
  from jmem import planner  # pylint: disable=g-import-not-at-top
  try:
    return tuple(planner.parse_bytes(s.strip()) / 2**30 for s in text.split(",") if s.strip())
  except ValueError as e:
    raise argparse.ArgumentTypeError(
        f"expected positive sizes, comma-separated, e.g. 16,80 (GiB) or 16GiB,800MiB (or '' "
        f"for none), got {text!r}: {e}") from None


def _str_list(text: str) -> tuple[str, ...]:
  return tuple(s.strip() for s in text.split(",") if s.strip())


def _mesh_shape(text: str) -> tuple[int, int, int]:
  """``D`` (data parallel) or ``DxHxW`` (data x height x width)."""
  try:
    sizes = tuple(int(s) for s in text.lower().split("x"))
  except ValueError:
    sizes = ()
  if len(sizes) not in (1, 3) or min(sizes) < 1:
    raise argparse.ArgumentTypeError(
        f"expected D (data parallel over D devices) or DxHxW (e.g. 2x2x2: batch over 2, image "
        f"height over 2, width over 2), with positive sizes; got {text!r}")
  return sizes + (1, 1) if len(sizes) == 1 else sizes


def _input_shape(text: str) -> tuple[int, int, int]:
  """``--input-shape H,W,C``: one image's height, width and channels."""
  try:
    shape = tuple(int(s) for s in text.split(","))
  except ValueError:
    shape = ()
  if len(shape) != 3 or min(shape) < 1:
    raise argparse.ArgumentTypeError(
        f"expected H,W,C (one image's height, width and channels, positive), e.g. 32,32,3; "
        f"got {text!r}")
  return shape


def _models_help() -> str:
  from jmem import models  # pylint: disable=g-import-not-at-top
  return (f"one of: {', '.join(models.MODEL_NAMES)}; or your own Flax model: "
          "pkg.module:factory or path/to/file.py:factory, a callable returning a linen or "
          "NNX module, called with num_classes=, dtype=, rngs= where its signature names "
          "them (docs/training.md)")


_INPUT_SHAPE_HELP = (
    "one image's height, width and channels for an image classifier (your factory's above "
    "all): the 8x8 gray digits resized to H x W, the gray repeated to C channels (default: "
    "--image-size square, 1 channel for a factory)")


def _comma_list(text: str) -> tuple[str, ...]:
  """``a,b`` -> ``("a", "b")``; `jmem.planner.site_ladder` checks --policies and --bits."""
  return tuple(t.strip() for t in text.split(","))


def _bits(text: str) -> tuple[int, ...]:
  try:
    return tuple(int(b) for b in _comma_list(text))
  except ValueError:
    raise argparse.ArgumentTypeError(
        f"give bit widths as integers separated by commas, e.g. 8,4; got {text!r}") from None


def _verify_size(args) -> int:
  """``--verify-image-size``, by default the plan's ``--image-size`` (224 by default; H of
  ``--input-shape H,W,C``) up to 32 (the embedded digits are 8x8, resized), or larger where
  the model or its clips need it (`jmem.bench.default_image_size`)."""
  from jmem import bench  # pylint: disable=g-import-not-at-top
  side = args.image_size or (args.input_shape[0] if args.input_shape else 224)
  return args.verify_image_size or bench.default_image_size(
      args.model, args.num_frames, min(side, 32))


def _techniques_help() -> str:
  """The registered techniques for a help text (argparse formats help with ``%``: the
  planner's ``plan-50%`` would break ``--help``)."""
  from jmem import bench  # pylint: disable=g-import-not-at-top
  return ", ".join(bench.technique_names()).replace("%", "%%")


def _targets_help() -> str:
  from jmem import measure  # pylint: disable=g-import-not-at-top
  return (", ".join(t for t in measure.TARGETS if t != "default") + " (an NVIDIA H100 80GB "
          "compiled for from this machine: pip install 'jmem[gpu-target]'), or the path of "
          "an XLA GPU spec file (.txtpb)")


def _parser() -> argparse.ArgumentParser:
  from jmem import bench  # pylint: disable=g-import-not-at-top
  p = argparse.ArgumentParser(prog="jmem", description="Memory-saving training for JAX/Flax.")
  sub = p.add_subparsers(dest="command", required=True)

  b = sub.add_parser("bench", help="train and measure every technique against exact",
                     allow_abbrev=False,
                     description="Measures saved activation bytes, compiled temp bytes, "
                     "step time and test accuracy of each technique against exact backprop, "
                     "on the digits data embedded in scikit-learn. With none of the options "
                     "below but --output-dir, --no-progress and --json: the tour, one row per "
                     "technique family, each on a model it fits (jmem.tour).")
  d = bench.BenchConfig()
  b.add_argument("--model", default=d.model, help=_models_help())
  b.add_argument("--techniques", type=_str_list, default=d.techniques,
                 help=f"comma-separated, from: {_techniques_help()} "
                 f"(default: {','.join(d.techniques)}); ':xla' or ':pallas' after a technique "
                 "with kernels (actnn-*, inplace-abn, sync-bn) picks its implementation")
  b.add_argument("--batch-size", type=int, default=d.batch_size)
  b.add_argument("--image-size", type=int, default=None,
                 help=f"image side, or frame side for video models (default: {d.image_size} "
                 "rounded up to the model's unit, or for a video model the frame its clips "
                 "need: 32 for ConvNeXt-T to -XL, 22 for stt-resnet8 and 24 for video-vit "
                 "with 16 frames)")
  b.add_argument("--input-shape", type=_input_shape, default=None, metavar="H,W,C",
                 help=_INPUT_SHAPE_HELP)
  b.add_argument("--num-frames", type=int, default=d.num_frames, help="frames per clip (video)")
  b.add_argument("--train-clips", type=int, default=d.train_clips,
                 help="training clips rendered (video)")
  b.add_argument("--steps", type=int, default=d.steps)
  b.add_argument("--seeds", type=_int_list, default=d.seeds, help="comma-separated, e.g. 0,1,2")
  b.add_argument("--learning-rate", type=float, default=d.learning_rate)
  b.add_argument("--memory-only", action="store_true", help="compile and measure; no training")
  b.add_argument("--dtype", default=d.dtype, choices=bench.DTYPES,
                 help="compute dtype of every row, exact's included (bfloat16: mixed "
                 "precision, float32 parameters)")
  b.add_argument("--budgets", type=_budget_list, default=d.budgets_gib,
                 help="device memory budgets in GiB for the largest batch of each technique, "
                 "comma-separated (default: the --target's memory limit, or 16,80 where it "
                 "has none; '' for none: two compiles fewer each)")
  b.add_argument("--no-calibration", action="store_true",
                 help="ActNN L3-L5 at their bits everywhere, as jmem.technique(name) gives "
                 "them (default: per-site bits calibrated on a training batch first)")
  b.add_argument("--target", default=None, metavar="NAME|SPEC",
                 help=f"the device the memory figures are for: {_targets_help()} (default: "
                 "this machine's default backend); training and timing stay on this machine "
                 "and are labelled so")
  b.add_argument("--json", action="store_true", help="print rows as JSON on stdout")
  b.add_argument("--output-dir", default="jmem_results",
                 help="where bench.json, bench.md and bench_memory.png go")
  b.add_argument("--no-progress", action="store_true")

  pl = sub.add_parser(
      "plan", help="per-site memory policies that fit a model's train step into a budget",
      description="Chooses a jmem.Policy per block site (save, compress at 8/4/2/1 bits, "
      "recompute from a 2-bit input; --exact-only: save or recompute; --policies: some of "
      "them; --bits: some of the bit widths) so that the compiled "
      "train step fits --budget at --batch-size with the fewest extra FLOPs (jmem.plan).")
  pl.add_argument("--model", default="resnet50",
                  help=_models_help() + " (default: %(default)s)")
  pl.add_argument("--image-size", type=int, default=None, help="(default: 224)")
  pl.add_argument("--input-shape", type=_input_shape, default=None, metavar="H,W,C",
                  help=_INPUT_SHAPE_HELP.replace("--image-size square, 1 channel for a "
                                                 "factory", "--image-size square, 3 channels; "
                                                 "1 for a factory"))
  pl.add_argument("--num-frames", type=int, default=16, help="frames per clip (video)")
  pl.add_argument("--batch-size", type=int, default=256, help="(default: %(default)s)")
  pl.add_argument("--budget", default="16GiB",
                  help="device memory, e.g. 16GiB, 800MiB, 1.5 (GiB), or a share of exact's: 50%% "
                  "(default: %(default)s)")
  pl.add_argument("--dtype", default="float32", choices=bench.DTYPES)
  pl.add_argument("--target", default=None, metavar="NAME|SPEC",
                  help=f"the device the budget is for: {_targets_help()} (default: this "
                  "machine's default backend); one device: not with --mesh, --devices or "
                  "--verify-steps")
  pl.add_argument("--exact-only", action="store_true",
                  help="accuracy-safe: no compression, the gradients stay exact")
  pl.add_argument("--policies", type=_comma_list, default=None, metavar="KIND[,KIND]",
                  help="the site policies allowed besides save: compress, recompute, "
                  "recompute_compressed (default: compress,recompute_compressed; with "
                  "--exact-only: recompute)")
  pl.add_argument("--bits", type=_bits, default=None, metavar="B[,B]",
                  help="the bit widths a compressed value may have (default: 8,4,2,1; not with "
                  "--exact-only; "
                  "8,4 keeps at least 4 bits; recomputation is from a 2-bit input, or the "
                  "fewest bits allowed above 1)")
  pl.add_argument("--where", default=None, metavar="REGEX",
                  help="the block sites to plan: a regular expression over module paths "
                  "(default: jmem.convert's default block sites)")
  pl.add_argument("--no-inplace-abn", action="store_true",
                  help="do not try InPlace-ABN alone where the exact step does not fit")
  pl.add_argument("--max-compiles", type=int, default=8,
                  help="the most steps compiled for the plan (not counting the largest "
                  "batch's, nor, with --devices, the exact steps that choose the layout; "
                  "default: %(default)s)")
  layout = pl.add_mutually_exclusive_group()
  layout.add_argument("--mesh", type=_mesh_shape, default=None, metavar="D|DxHxW",
                      help="plan for D x H x W devices: the batch split over D (data "
                      "parallel), the image's H and W over H x W (jmem.Spatial under every "
                      "plan); the budget is per device; on CPU, D*H*W devices are simulated")
  layout.add_argument("--devices", type=int, default=None, metavar="N",
                      help="plan for N devices laid out by the planner: the batch over as "
                      "many as divide it, the image's H x W over the rest; the budget is per "
                      "device; on CPU, N devices are simulated")
  pl.add_argument("--verify-steps", type=int, default=0, metavar="N",
                  help="train the planned model next to exact for N steps on the embedded "
                  "data (at --verify-image-size) and report both accuracies")
  pl.add_argument("--verify-image-size", type=int, default=None, metavar="S",
                  help="image size of --verify-steps (default: --image-size, at most 32: the "
                  "embedded digits are 8x8, resized; rounded up to the model's unit, or the "
                  "frame a video model's clips need)")
  pl.add_argument("--json", action="store_true", help="print the plan as JSON on stdout")
  pl.add_argument("--output-dir", default="jmem_results",
                  help="where plan.json, plan.md and plan_front.png go")

  t = sub.add_parser("train", help="train one model (with checkpoints and --resume)")
  t.add_argument("--model", default="resnet8", help=_models_help())
  t.add_argument("--technique", default="exact",
                 help=f"one of: {_techniques_help()}")
  t.add_argument("--image-size", type=int, default=None,
                 help="image side, or frame side for video models (default: 16 rounded up "
                 "to the model's unit, or for a video model the frame its clips need: 32 for "
                 "ConvNeXt-T to -XL, 22 for stt-resnet8 and 24 for video-vit with 16 "
                 "frames)")
  t.add_argument("--input-shape", type=_input_shape, default=None, metavar="H,W,C",
                 help=_INPUT_SHAPE_HELP)
  t.add_argument("--num-frames", type=int, default=16, help="frames per clip (video)")
  t.add_argument("--train-clips", type=int, default=1024, help="training clips rendered (video)")
  t.add_argument("--batch-size", type=int, default=128)
  t.add_argument("--steps", type=int, default=300)
  t.add_argument("--learning-rate", type=float, default=3e-3)
  t.add_argument("--seed", type=int, default=0)
  t.add_argument("--dtype", default=d.dtype, choices=bench.DTYPES,
                 help="compute dtype (bfloat16: mixed precision, float32 parameters)")
  t.add_argument("--eval-every", type=int, default=100)
  t.add_argument("--checkpoint-dir", default=None)
  t.add_argument("--checkpoint-every", type=int, default=None,
                 help="steps between checkpoints (with --checkpoint-dir; default 100)")
  t.add_argument("--resume", action="store_true")
  t.add_argument("--no-progress", action="store_true")
  m = t.add_argument_group(
      "devices and processes", "A mesh over all devices of all processes; several processes "
      "each run the same command with their own --process-id (or JMEM_COORDINATOR, "
      "JMEM_NUM_PROCESSES, JMEM_PROCESS_ID).")
  m.add_argument("--mesh", type=_mesh_shape, default=None, metavar="D|DxHxW",
                 help="D: data parallel over D devices (batch sharded, parameters "
                 "replicated); DxHxW: also the image's height and width (ConvNeXt models, "
                 "halo exchange). Default: one device")
  m.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                 help="process 0's address, the same in every process")
  m.add_argument("--num-processes", type=int, default=None)
  m.add_argument("--process-id", type=int, default=None)
  m.add_argument("--heartbeat-timeout", type=int, default=100, metavar="SECONDS",
                 help="stop the others this long after a process goes silent, or every "
                 "process this long after steps stop finishing (default 100)")
  m.add_argument("--local-devices", type=int, default=None, metavar="N",
                 help="CPU only: simulate N devices in this process")
  return p


# `jmem bench` options that keep the tour (any other option runs the classic bench).
_TOUR_OPTIONS = ("--output-dir", "--no-progress", "--json", "--target")


def _is_tour(argv) -> bool:
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] != "bench":
    return False
  return all(a.split("=")[0] in _TOUR_OPTIONS for a in argv[1:] if a.startswith("-"))


def _tour(args) -> int:
  from jmem import bench, tour  # pylint: disable=g-import-not-at-top
  output_dir = bench.check_output_dir(args.output_dir)
  rows = tour.run_tour(quiet=args.json, progress=not args.no_progress, target=args.target)
  paths = tour.write_tour(rows, output_dir)
  if args.json:
    json.dump(rows, sys.stdout, indent=2, default=str)
    print()
  else:
    print(tour.format_tour(rows))
    print(f"\nwrote {paths['json']}, {paths['md']}, {paths['png']}")
  return 0


def _default_image_size(args, at_least: int) -> None:
  """``--image-size`` left out: `jmem.bench.default_image_size` of the model, or with
  ``--input-shape H,W,C`` (not with it) H."""
  from jmem import bench  # pylint: disable=g-import-not-at-top
  if args.input_shape is not None:
    bench.check_input_shape(args.model, args.input_shape)
    if args.image_size is not None:
      raise ValueError(f"--image-size {args.image_size} and --input-shape "
                       f"{','.join(map(str, args.input_shape))} both give the image's size: "
                       "give one.")
    args.image_size = args.input_shape[0]
  if args.image_size is None:
    args.image_size = bench.default_image_size(args.model, args.num_frames, at_least)


def _bench(args) -> int:
  if args.tour:
    return _tour(args)
  from jmem import bench  # pylint: disable=g-import-not-at-top
  _default_image_size(args, bench.BenchConfig().image_size)
  config = bench.BenchConfig(
      model=args.model, techniques=args.techniques, batch_size=args.batch_size,
      image_size=args.image_size, num_frames=args.num_frames, train_clips=args.train_clips,
      steps=args.steps, seeds=args.seeds,
      memory_only=args.memory_only, learning_rate=args.learning_rate,
      budgets_gib=args.budgets, dtype=args.dtype, target=args.target,
      input_shape=args.input_shape, calibrate=not args.no_calibration)
  config.validate()
  output_dir = bench.check_output_dir(args.output_dir)
  rows = bench.run_bench(config, quiet=args.json, progress=not args.no_progress)
  paths = bench.write_results(rows, output_dir, meta={"config": vars(args)})
  if args.json:
    json.dump(rows, sys.stdout, indent=2)
    print()
  else:
    print(bench.format_table(rows))
    print(f"\nwrote {paths['json']}, {paths['md']}, {paths['png']}")
  return 0


def _plan(args) -> int:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jmem import bench, models, planner as plan_lib, train  # pylint: disable=g-import-not-at-top
  from jmem import data as data_lib  # pylint: disable=g-import-not-at-top
  # Bad input fails before any work: a size, or a share of exact's bytes ("50%").
  budget = (args.budget if plan_lib.budget_share(args.budget) is not None
            else plan_lib.parse_bytes(args.budget))
  plan_lib.site_ladder(args.policies, not args.exact_only, args.bits)   # kinds and bits
  _default_image_size(args, 224)
  bench.check_dtype(args.model, args.dtype)     # a factory that does not import: now
  if args.verify_image_size is not None and args.verify_image_size < 1:
    raise ValueError(f"--verify-image-size must be positive, got {args.verify_image_size}.")
  if args.devices is not None and args.devices < 1:
    raise ValueError(f"--devices must be at least 1, got {args.devices}.")
  if args.verify_steps < 0:
    raise ValueError(f"--verify-steps must be 0 (no verification) or more, got "
                     f"{args.verify_steps}.")
  if args.batch_size < 1 or args.image_size < 1:
    raise ValueError(f"--batch-size and --image-size must be positive, got "
                     f"{args.batch_size} and {args.image_size}.")
  from jmem import measure  # pylint: disable=g-import-not-at-top
  on = measure.target(args.target)
  if on.deviceless:
    # One device (--mesh 1, --devices 1) is what the target compiles for: no layout to refuse.
    layout = lambda v: v is not None and (math.prod(v) if isinstance(v, tuple) else v) > 1
    given = [flag for flag, value in (("--mesh", layout(args.mesh)),
                                      ("--devices", layout(args.devices)),
                                      ("--verify-steps", args.verify_steps)) if value]
    if given:
      raise ValueError(
          f"--target {args.target} compiles for one {on.device_kind} from this machine, so "
          f"{' and '.join(given)} cannot go with it: a multi-device layout is planned on "
          "the devices themselves, and --verify-steps trains, which needs the device (plan "
          "with --target, then verify the plan's techniques on this machine without it).")
  verify_size, need = _verify_size(args), bench.min_frame_size(args.num_frames)
  if args.verify_steps and models.model_task(args.model) == "video" and verify_size < need:
    raise ValueError(f"--verify-image-size {verify_size} is too small for the "
                     f"verification's clips of {args.num_frames} frames: use "
                     f"--verify-image-size {need} or more.")
  output_dir = bench.check_output_dir(args.output_dir)
  mesh, axes = None, {}
  if args.devices is not None:                 # the planner checks it
    axes = dict(devices=args.devices)
  elif args.mesh and math.prod(args.mesh) > 1:
    from jax.sharding import AxisType  # pylint: disable=g-import-not-at-top
    d, h, w = args.mesh
    if d * h * w > jax.device_count():
      raise ValueError(f"--mesh {'x'.join(map(str, args.mesh))} needs {d * h * w} devices; "
                       f"there are {jax.device_count()}.")
    mesh = jax.make_mesh(args.mesh, ("data", "h", "w"), axis_types=(AxisType.Auto,) * 3,
                         devices=jax.devices()[:d * h * w])
    axes = dict(data_axis="data" if d > 1 else None,
                spatial_axes=("h", "w") if h * w > 1 else None)
  task = models.model_task(args.model)
  video = task == "video"
  channels = 1 if video or args.model.endswith("digits") or bench.is_factory(args.model) else 3
  example = args.input_shape or (args.image_size, args.image_size, channels)
  shape = ((args.batch_size, args.num_frames) if video else (args.batch_size,)) + example
  x = jax.ShapeDtypeStruct(shape, jnp.float32)
  # Segmentation: a label per pixel.
  y = jax.ShapeDtypeStruct((args.batch_size,) + (
      (args.image_size, args.image_size) if task == "segmentation" else ()), jnp.int32)
  # 16 examples of the embedded data at the plan's shapes: their gradient sensitivities
  # order the bit reductions (and they give the number of classes).
  calibration = None
  classes = data_lib.BACKGROUND + 1 if task == "segmentation" else 10
  if not args.exact_only and "compress" in (args.policies or ("compress",)):
    if video:
      clips = bench.make_dataset(args.model, args.image_size, num_frames=args.num_frames,
                                 train_clips=16, test_clips=1)
      (cx, cy), classes = (clips.x_train, clips.y_train), clips.num_classes
    else:
      h, w, _ = example
      cx, cy = data_lib.digits_sample(16, h if h == w else 8)
      if task == "segmentation":
        cy = data_lib.pixel_labels(cx, cy)
      cx = bench.digits_at(cx, example)
    calibration = (cx, cy)
  model = bench.create_model(args.model, classes, args.dtype, example_shape=shape[1:])
  with warnings.catch_warnings():      # the table printed below says "does NOT fit"
    warnings.simplefilter("ignore", plan_lib.BudgetNotMetWarning)
    result = plan_lib.plan(model, (x, y), budget, approximate=not args.exact_only,
                           max_compiles=args.max_compiles, calibration_batch=calibration,
                           mesh=mesh, policies=args.policies, bits=args.bits,
                           inplace_abn=not args.no_inplace_abn, target=args.target,
                           where=args.where, **axes)
  paths = plan_lib.write(result, output_dir)
  out = result.to_json()
  if args.verify_steps:
    size, verify_shape = verify_size, None
    if args.input_shape:      # verified at it, unless --verify-image-size gives a side
      verify_shape = (args.input_shape if args.verify_image_size is None
                      else (size, size, args.input_shape[2]))
      size = verify_shape[0]
    dataset = bench.make_dataset(args.model, size, num_frames=args.num_frames,
                                 input_shape=verify_shape)
    config = train.TrainConfig(steps=args.verify_steps, batch_size=min(128, len(
        dataset.x_train)), progress=False)
    base = bench.create_model(args.model, dataset.num_classes, args.dtype,
                              example_shape=dataset.example_shape)
    from jmem import surgery  # pylint: disable=g-import-not-at-top
    # On one device: Spatial is exact, the verification is of the approximate policies.
    techniques = [t for t in result.techniques if not isinstance(t, surgery.Spatial)]
    accuracy = {name: train.train(m, dataset, config).test_accuracy
                for name, m in (("exact", base),
                                ("plan", surgery.convert(base, *techniques)))}
    out["verify"] = dict(steps=args.verify_steps, image_size=size,
                         accuracy=accuracy)
    if verify_shape:
      out["verify"]["input_shape"] = list(dataset.example_shape)
    with open(paths[0], "w") as f:           # plan.json, with what was verified
      json.dump(out, f, indent=1)
  if args.json:
    json.dump(out, sys.stdout, indent=2)
    print()
  else:
    print(result.table())
    if args.verify_steps:
      acc = out["verify"]["accuracy"]
      size = out["verify"]["image_size"]
      at = "x".join(map(str, out["verify"].get("input_shape", (size, size))))
      print(f"\nverify ({args.verify_steps} steps at {at}): exact "
            f"{100 * acc['exact']:.2f}%, plan {100 * acc['plan']:.2f}%")
    print(f"\nwrote {', '.join(paths)}")
  return 0 if result.fits else 1


def _on_mesh(model, shape: tuple[int, int, int], technique: str):
  """``model`` run on a ``data x h x w`` mesh of the first devices of all processes."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh  # pylint: disable=g-import-not-at-top
  from jmem import parallel, train  # pylint: disable=g-import-not-at-top
  from jmem.parallel.spatial import spatial_mesh, spatial_model_fns  # pylint: disable=g-import-not-at-top
  d, h, w = shape
  n, have = d * h * w, jax.device_count()
  text = "x".join(map(str, shape)) if h * w > 1 else str(d)
  if n > have or (jax.process_count() > 1 and n != have):
    raise ValueError(
        f"--mesh {text} needs {n} devices; there are {have} ({jax.process_count()} "
        f"process(es) x {jax.local_device_count()}){' and every one must be in the mesh' if jax.process_count() > 1 else ''}. "
        "On CPU, --local-devices N simulates N devices per process.")
  if isinstance(model, train.ModelFns):
    raise ValueError(f"Technique {technique!r} runs on a mesh of its own; run it without "
                     "--mesh (or use --technique exact with --mesh DxHxW for a spatial mesh).")
  devices = jax.devices()[:n]
  if hasattr(model, "axis_names") and hasattr(model, "data_axis"):   # jmem's ConvNeXt
    return spatial_model_fns(model, spatial_mesh(d, h, w, devices=devices))
  if h * w > 1:
    raise ValueError(f"--mesh {text} shards the image, which needs a model with halo "
                     f"convolutions (jmem's ConvNeXt models); {type(model).__name__} takes "
                     f"a data axis only: --mesh {n}.")
  return parallel.data_parallel(model, Mesh(np.asarray(devices), ("data",)))


class _StderrHandler(logging.Handler):
  """``jmem: message`` lines on whatever ``sys.stderr`` is when a record comes (a handler
  that kept the stream of its first call would write to a closed one after a redirect)."""

  def emit(self, record):
    try:
      sys.stderr.write(f"jmem: {self.format(record)}\n")
    except Exception:  # pylint: disable=broad-except  (logging must never raise)
      self.handleError(record)


def _train(args) -> int:
  from jmem import distributed  # pylint: disable=g-import-not-at-top
  distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                         heartbeat_timeout_seconds=args.heartbeat_timeout)
  from jmem import bench, train  # pylint: disable=g-import-not-at-top
  _default_image_size(args, 16)
  primary = distributed.is_primary()
  if primary:            # checkpoint saves (with the path a restart needs) on stderr
    log = logging.getLogger("jmem")
    if not any(isinstance(h, _StderrHandler) for h in log.handlers):   # once per process
      log.addHandler(_StderrHandler())
    log.setLevel(logging.INFO)
    log.propagate = False     # printed once, by this handler
  import jax  # pylint: disable=g-import-not-at-top
  if (args.local_devices is not None and jax.default_backend() == "cpu"
      and jax.local_device_count() != args.local_devices):
    raise ValueError(
        f"--local-devices {args.local_devices} cannot take effect: JAX already runs with "
        f"{jax.local_device_count()} CPU devices in this process (the count is read once, "
        "when the backend starts). Start a fresh process.")
  if args.checkpoint_every is not None and args.checkpoint_dir is None:
    raise ValueError(f"--checkpoint-every {args.checkpoint_every} saves nothing without "
                     "--checkpoint-dir: give the directory to write checkpoints to.")
  config = train.TrainConfig(
      steps=args.steps, batch_size=args.batch_size, learning_rate=args.learning_rate,
      seed=args.seed, eval_every=args.eval_every, checkpoint_dir=args.checkpoint_dir,
      checkpoint_every=100 if args.checkpoint_every is None else args.checkpoint_every,
      resume=args.resume, progress=not args.no_progress,
      # A stalled collective (every process alive) ends within the heartbeat's time too.
      stall_timeout=float(args.heartbeat_timeout) if jax.process_count() > 1 else None)
  bench.get_technique(args.technique)    # bad names fail before any work
  bench.check_dtype(args.model, args.dtype)
  dataset = bench.make_dataset(args.model, args.image_size, num_frames=args.num_frames,
                               train_clips=args.train_clips, input_shape=args.input_shape)
  config.validate(len(dataset.x_train))
  base = bench.create_model(args.model, dataset.num_classes, args.dtype, seed=args.seed,
                            example_shape=dataset.example_shape)
  model = bench.build_model(args.technique, base, dataset, args.batch_size)
  if args.mesh is not None:
    model = _on_mesh(model, args.mesh, args.technique)
  run_info = {"model": args.model, "technique": args.technique,
              "image_size": args.image_size, "dtype": args.dtype}
  if args.input_shape is not None:
    run_info["input_shape"] = list(args.input_shape)
  result = train.train(model, dataset, config, run_info=run_info)
  if not primary:
    return 0
  if result.resumed_from:
    print(f"resumed from step {result.resumed_from}")
  for h in result.history:
    print(json.dumps(h))
  print(f"test accuracy: {100 * result.test_accuracy:.2f}%")
  return 0


def _simulate_host_devices(argv, local_devices: int | None = None,
                           plan_devices: int | None = None) -> None:
  """Spatial techniques need 8 devices (``jmem plan --mesh DxHxW``: D*H*W, ``--devices N``:
  N): on a CPU-only machine, simulate them; and ``--local-devices N`` simulates N (read when
  the backend starts, so before any work)."""
  flags = os.environ.get("XLA_FLAGS", "")
  if local_devices is not None:
    if local_devices < 1:
      raise ValueError(f"--local-devices must be >= 1, got {local_devices}.")
    flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", flags)
    os.environ["XLA_FLAGS"] = (
        f"{flags} --xla_force_host_platform_device_count={local_devices}".strip())
    return
  wanted = 8 if (_is_tour(argv) or any(
      "spatial-" in a for a in (sys.argv[1:] if argv is None else argv))) else 0
  if plan_devices:                          # jmem plan --mesh DxHxW / --devices N
    wanted = max(wanted, plan_devices)
  if wanted and "host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (
        f"{flags} --xla_force_host_platform_device_count={wanted}".strip())


def _plan_devices(args) -> int | None:
  """The devices ``jmem plan`` needs (None: one, or not ``plan``)."""
  if args.command != "plan":
    return None
  return args.devices or (math.prod(args.mesh) if args.mesh else None)


def _target_platforms(args) -> None:
  """A GPU ``--target`` is compiled for with JAX's CUDA plugin loaded for compiling only,
  which needs JAX's platforms to be ``cpu`` before JAX starts: set here unless the
  environment names platforms (then `jmem.measure.target` says what is wrong)."""
  name = getattr(args, "target", None)
  if name in (None, "default") or os.environ.get("JAX_PLATFORMS"):
    return
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_platforms", "cpu")


def main(argv: list[str] | None = None) -> int:
  parser = _parser()
  args = parser.parse_args(argv)
  args.tour = _is_tour(argv)
  try:
    _target_platforms(args)
    _simulate_host_devices(argv, getattr(args, "local_devices", None), _plan_devices(args))
    return {"bench": _bench, "train": _train, "plan": _plan}[args.command](args)
  except (ValueError, _extras.MissingExtra) as e:
    parser.exit(2, f"jmem {args.command}: error: {e}\n")
  except KeyboardInterrupt as e:
    from jmem import train  # pylint: disable=g-import-not-at-top
    if not isinstance(e, train.Interrupted):
      raise                       # Ctrl-C outside the training loop: Python's own
    sys.stderr.write(f"jmem {args.command}: {e}\n")
    return 128 + int(getattr(signal, e.signal))


def run() -> int:
  """The ``jmem`` command: `main`, where a Ctrl-C outside the training loop (making the
  data, restoring a checkpoint, the final evaluation, a plan or a bench) ends with one line
  and exit status 130 instead of a traceback (the loop's own stop is `main`'s). `main`
  itself lets such a KeyboardInterrupt through, for callers that handle it."""
  try:
    return main()
  except KeyboardInterrupt:               # main answers the loop's own (train.Interrupted)
    sys.stderr.write("jmem: interrupted (Ctrl-C) outside the training loop, where no "
                     "checkpoint is being written.\n")
    return 130


if __name__ == "__main__":
  sys.exit(run())
