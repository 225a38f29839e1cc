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
