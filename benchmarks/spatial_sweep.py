"""Random sweep of `jmem.parallel.spatial.sharded_conv` against ``lax.conv_general_dilated``.

Writes benchmarks/results/spatial_sweep.{json,md}. Runs on 8 simulated CPU devices:

  python benchmarks/spatial_sweep.py [--cases 300] [--seed 0]

Each case draws a mesh (2x4, 1x8, 2x2, 1x3, 1x7), an image of 1-20 x 1-24 pixels, a kernel
(1-7), stride (1-3), dilation (1-2), padding (SAME, VALID or explicit 0-4 per side), groups
(1, 2 or depthwise) and 4 or 8 output channels, and compares the output and both gradients
(input and kernel, for one random cotangent) with the unsharded convolution. Cases are
counted by how each sharded dim was split: even, padded up to equal blocks, with a halo wider
than a block (from several neighbours), or gathered (a SpatialFallbackWarning); a case whose
output is empty must give the same empty shape. The pass line is a relative deviation
(max |diff| / max |reference|) under 1e-5 in every case.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

from _common import RESULTS  # noqa: E402
from jmem import _window  # noqa: E402
from jmem.parallel.spatial import SpatialFallbackWarning, sharded, sharded_conv  # noqa: E402

MESHES = ((2, 4), (1, 8), (2, 2), (1, 3), (1, 7))
DN = ("NHWC", "HWIO", "NHWC")


def _draw(rnd):
  pad = rnd.choice(["SAME", "VALID", "SAME", "explicit"])
  if pad == "explicit":
    pad = tuple((rnd.randint(0, 4), rnd.randint(0, 4)) for _ in range(2))
  return dict(mesh=rnd.choice(MESHES), size=(rnd.randint(1, 20), rnd.randint(1, 24)),
              kernel=(rnd.choice([1, 2, 3, 5, 7]), rnd.choice([1, 2, 3, 5, 7])),
              strides=(rnd.choice([1, 1, 2, 3]), rnd.choice([1, 1, 2, 3])),
              dilation=(rnd.choice([1, 1, 2]), rnd.choice([1, 1, 2])), padding=pad,
              groups=rnd.choice([1, 2, 4]), features=rnd.choice([4, 8]))


def _kinds(case, x, k, size):
  """How each sharded dim splits: "even", "padded", "multi-hop", "gathered"."""
  names = [a if size[a] > 1 else None for a in ("h", "w")]
  plans, unsplit = sharded._split_plans(x, k, case["strides"], case["padding"],  # pylint: disable=protected-access
                                        case["dilation"], names, size)
  pads = _window.padding_pairs(case["padding"], case["kernel"], case["strides"],
                               case["dilation"], case["size"])
  kinds = []
  for dim, name in enumerate(names):
    if name is None:
      continue
    if dim in unsplit:
      kinds.append("gathered")
      continue
    length, (lo, _) = case["size"][dim], pads[dim]
    padded, (_, right), _ = plans.get(dim, (length, (lo, None), None))
    if right is None:
      extent = case["dilation"][dim] * (case["kernel"][dim] - 1) + 1
      right = extent - case["strides"][dim] - lo
    block = padded // size[name]
    kinds.append("padded" if dim in plans else "even")
    if max(lo, right) > block:
      kinds.append("multi-hop")
  return kinds


def main():
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--cases", type=int, default=300)
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args()
  meshes = {s: jax.make_mesh(s, ("h", "w"), axis_types=(AxisType.Auto,) * 2,
                             devices=jax.devices()[:s[0] * s[1]]) for s in MESHES}
  rnd = random.Random(args.seed)
  counts, worst, failures, ran, drawn = collections.Counter(), 0.0, [], 0, 0
  while ran < args.cases:
    drawn += 1
    case = _draw(rnd)
    x = jax.random.normal(jax.random.key(drawn), (2, *case["size"], 4))
    k = jax.random.normal(jax.random.key(drawn + 10**6),
                          (*case["kernel"], 4 // case["groups"], case["features"]))
    kw = dict(rhs_dilation=case["dilation"], dimension_numbers=DN,
              feature_group_count=case["groups"])

    def ref(x, k, case=case, kw=kw):
      return jax.lax.conv_general_dilated(x, k, case["strides"], case["padding"], **kw)
    try:
      y0, vjp0 = jax.vjp(ref, x, k)
    except (TypeError, ValueError):
      continue                                  # not a valid convolution (kernel too large)
    mesh = meshes[case["mesh"]]
    size = dict(zip(mesh.axis_names, mesh.devices.shape))
    conv = sharded_conv(mesh, ("h", "w"))
    mine = jax.jit(lambda x, k, case=case, kw=kw, conv=conv: conv(
        x, k, case["strides"], case["padding"], **kw))
    kinds = _kinds(case, x, k, size) if y0.size else ["empty output"]
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", SpatialFallbackWarning)
      y1, vjp1 = jax.vjp(mine, x, k)
    ct = jax.random.normal(jax.random.key(7), y0.shape)
    if y1.shape != y0.shape:
      dev = float("inf")
    else:
      dev = max(float(jnp.max(jnp.abs(a - b)) / max(float(jnp.max(jnp.abs(b))), 1e-30))
                for a, b in zip((y1, *vjp1(ct)), (y0, *vjp0(ct))) if b.size)
    ran += 1
    if ran % 25 == 0:
      print(f"{ran} cases, worst {max(worst, dev):.1e}", flush=True)
    counts.update(set(kinds) | ({"depthwise"} if case["groups"] == 4 else set()))
    worst = max(worst, dev)
    if dev > 1e-5:
      failures.append(dict(case=case, deviation=dev))
      print("FAIL", case, dev, flush=True)
  res = dict(cases=ran, seed=args.seed, worst_relative_deviation=worst,
             failures=failures, counts=dict(sorted(counts.items())),
             jax=jax.__version__, backend=jax.default_backend())
  os.makedirs(RESULTS, exist_ok=True)
  with open(os.path.join(RESULTS, "spatial_sweep.json"), "w") as f:
    json.dump(res, f, indent=1)
  md = ["# sharded_conv against lax.conv_general_dilated: a random sweep", "",
        "Written by `benchmarks/spatial_sweep.py` (8 simulated CPU devices, float32, "
        f"JAX {jax.__version__}). Output, input gradient and kernel gradient for one random "
        "cotangent; deviation = max |diff| / max |reference|.", "",
        f"- cases: {ran} (seed {args.seed})",
        f"- worst deviation: {worst:.1e}; cases over 1e-5: {len(failures)}",
        "- cases with a sharded dim that was: " + ", ".join(
            f"{k} {v}" for k, v in sorted(counts.items()) if k != "depthwise"),
        f"- depthwise cases: {counts['depthwise']}", ""]
  with open(os.path.join(RESULTS, "spatial_sweep.md"), "w") as f:
    f.write("\n".join(md))
  print("\n".join(md))


if __name__ == "__main__":
  main()
