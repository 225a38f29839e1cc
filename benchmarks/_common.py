"""What every benchmark script shares: where results go and the seeds/steps flags."""

import argparse
import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def parser(description):
  """An argument parser with ``--seeds 0,1,2 --steps 300``."""
  p = argparse.ArgumentParser(description=description)
  p.add_argument("--seeds", default="0,1,2", type=lambda s: tuple(int(v) for v in s.split(",")))
  p.add_argument("--steps", type=int, default=300)
  return p


def seeds_and_steps(description, argv=None):
  """Parses ``--seeds 0,1,2 --steps 300``; returns ``(seeds tuple, steps)``."""
  args = parser(description).parse_args(argv)
  return args.seeds, args.steps


def sharded_step_cost(model, optimizer, x, y, mesh=None, specs=None):
  """``(device bytes, FLOPs)`` of ``model``'s train step (`jmem.planner.step_cost`) with the
  batch sharded ``specs`` (x's, y's PartitionSpecs) over ``mesh`` and the train state
  replicated, per device, as `jmem.plan(mesh=...)` compiles it; on one device for ``mesh``
  None."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top
  from jmem import planner, train  # pylint: disable=g-import-not-at-top
  if mesh is None:
    return planner.step_cost(model, optimizer, x, y)
  put = lambda a, spec: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec))
  fns = train.model_fns(model)
  abstract = jax.eval_shape(lambda k, v: train.init_state(fns, optimizer, k, v),
                            jax.random.key(0), jax.ShapeDtypeStruct((1,) + x.shape[1:], x.dtype))
  return planner.step_cost(model, optimizer, put(x, specs[0]), put(y, specs[1]),
                           abstract=jax.tree.map(lambda a: put(a, PartitionSpec()), abstract))


def write_report(stem, data, lines):
  """Writes ``results/<stem>.json`` (``data``) and ``results/<stem>.md`` (``lines``), and
  prints the Markdown: for reports that are not `jmem.bench` rows (`bench.write_results`)."""
  import json  # pylint: disable=g-import-not-at-top
  os.makedirs(RESULTS, exist_ok=True)
  with open(os.path.join(RESULTS, f"{stem}.json"), "w") as f:
    json.dump(data, f, indent=1)
  with open(os.path.join(RESULTS, f"{stem}.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))
