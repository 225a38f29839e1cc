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
