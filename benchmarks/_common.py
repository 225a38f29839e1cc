"""What every benchmark script shares: where results go and the seeds/steps flags."""

import argparse
import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def seeds_and_steps(description, argv=None):
  """Parses ``--seeds 0,1,2 --steps 300``; returns ``(seeds tuple, steps)``."""
  p = argparse.ArgumentParser(description=description)
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--steps", type=int, default=300)
  args = p.parse_args(argv)
  return tuple(int(s) for s in args.seeds.split(",")), args.steps
