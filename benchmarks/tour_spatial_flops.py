"""Why the tour's spatial row has a FLOPs ratio below an eighth.

The tour compares jmem's ConvNeXt (`convnext-digits`, batch 16, 32x32) on 8 devices
(`spatial-8`, per device) with the same step on one. XLA:CPU takes the weight gradient of
a depthwise convolution (autodiff's convolution with ``batch_group_count``) as a dense
C x C convolution over every channel pair, where `halo_conv` computes it with feature
groups. This compiles both train steps as `jmem bench` does, and each depthwise
convolution's weight gradient alone, both ways (XLA's cost analysis):

  python benchmarks/tour_spatial_flops.py

Writes results/tour_spatial_flops.{json,md}. Compile-only, seconds on 2 CPU cores.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from _common import write_report  # noqa: E402
from jmem import bench, measure, models, train  # noqa: E402
from jmem.models.convnext import CONVNEXT_CONFIGS  # noqa: E402

BATCH, SIZE, MODEL = 16, 32, "convnext-digits"


def _flops(f, *args):
  f = f if hasattr(f, "lower") else jax.jit(f)
  return measure.device_bytes_and_flops(f.lower(*args).compile())[1]


def _step_flops(name, dataset, base):
  model = bench.build_model(name, base, dataset, BATCH)
  fns = train.model_fns(model)
  optimizer = train.default_optimizer(1e-3, 10)
  x = jax.ShapeDtypeStruct((BATCH, SIZE, SIZE, 1), jnp.float32)
  y = jax.ShapeDtypeStruct((BATCH,), jnp.int32)
  abstract = train.abstract_state(fns, optimizer, x)
  return _flops(train.make_train_step(fns, optimizer, donate=True), abstract, x, y)


def _depthwise(width, channels):
  """FLOPs of one 7x7 depthwise convolution's weight gradient at the step's shape: as
  autodiff writes it (batch-grouped), and as one convolution with feature groups (the
  forward's count: the same multiply-adds)."""
  x = jnp.zeros((BATCH, width, width, channels))
  w = jnp.zeros((7, 7, 1, channels))
  conv = lambda w, x: lax.conv_general_dilated(
      x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
      feature_group_count=channels)
  return (_flops(jax.grad(lambda w, x: conv(w, x).sum()), w, x), _flops(conv, w, x))


def main():
  dataset = bench.make_dataset(MODEL, SIZE)
  base = models.create_model(MODEL, dataset.num_classes)
  exact, spatial = (_step_flops(n, dataset, base) for n in ("exact", "spatial-8"))
  depths, dims, patch = CONVNEXT_CONFIGS[MODEL]
  rows = []
  for stage, (depth, channels) in enumerate(zip(depths, dims)):
    width = SIZE // patch // 2**stage
    dense, grouped = _depthwise(width, channels)
    rows.append(dict(stage=stage + 1, blocks=depth, width=width, channels=channels,
                     dense_flops=dense, grouped_flops=grouped))
  dense = sum(r["blocks"] * r["dense_flops"] for r in rows)
  grouped = sum(r["blocks"] * r["grouped_flops"] for r in rows)
  exact_grouped = exact - dense + grouped
  data = dict(model=MODEL, batch=BATCH, image_size=SIZE, backend=jax.default_backend(),
              jax=jax.__version__, exact_flops=exact, spatial8_flops_per_device=spatial,
              depthwise=rows, depthwise_dense_flops=dense, depthwise_grouped_flops=grouped,
              exact_flops_grouped=exact_grouped)
  g = lambda f: f"{f / 1e9:.3f}"
  lines = [
      f"# The tour's spatial FLOPs ratio ({MODEL}, batch {BATCH}, {SIZE}x{SIZE}, "
      f"{jax.default_backend()}, JAX {jax.__version__})", "",
      "| step | GFLOPs | / exact | / exact with grouped depthwise gradients |",
      "|---|---:|---:|---:|",
      f"| exact, one device | {g(exact)} | 1.000 | {exact / exact_grouped:.3f} |",
      f"| spatial-8, per device | {g(spatial)} | {spatial / exact:.3f} | "
      f"{spatial / exact_grouped:.3f} |", "",
      "Each 7x7 depthwise convolution's weight gradient, compiled alone (GFLOPs):", "",
      "| stage | blocks | H = W | channels | batch-grouped (autodiff, XLA:CPU) | "
      "feature-grouped |", "|---:|---:|---:|---:|---:|---:|"]
  lines += [f"| {r['stage']} | {r['blocks']} | {r['width']} | {r['channels']} | "
            f"{g(r['dense_flops'])} | {g(r['grouped_flops'])} |" for r in rows]
  lines += ["", f"The exact step's {sum(r['blocks'] for r in rows)} depthwise weight "
            f"gradients count {g(dense)} of its {g(exact)} GFLOPs "
            f"({100 * dense / exact:.0f}%); with feature groups they would be {g(grouped)}. "
            f"Against the exact step with them so ({g(exact_grouped)} GFLOPs), the spatial "
            f"step's per-device FLOPs are {spatial / exact_grouped:.3f}x (an even split over "
            "8 devices: 0.125x)."]
  write_report("tour_spatial_flops", data, lines)


if __name__ == "__main__":
  main()
