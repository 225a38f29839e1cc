"""What every benchmark script shares: where results go, the seeds/steps flags, and the one
writer of results, which stamps each with what produced it (commit, JAX version, device and
the target its memory figures are for)."""

import argparse
import datetime
import json
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


def stamp(target=None, *, device=None, **extra):
  """What every result names: ``commit`` (`jmem.bench.source_commit`), ``date``,
  ``jax_version``, ``jaxlib``, ``device`` (the device the script ran on) and ``target`` (what
  its memory figures are for: by default the device's own compiler, e.g. ``"XLA:CPU"``;
  ``"h100"`` for the H100 target, XLA:GPU's buffer assignment computed on a CPU), then
  ``extra``. Give ``device=`` where the script must not touch a backend itself (gpu.py's
  parent process leaves the GPU to its workers)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jaxlib  # pylint: disable=g-import-not-at-top
  from jmem import bench  # pylint: disable=g-import-not-at-top
  backend = None
  if device is None:
    backend = jax.default_backend()
    device = jax.devices()[0].device_kind
    if backend == "cpu" and jax.device_count() > 1:
      device = f"{device} ({jax.device_count()} devices)"
  meta = {"commit": bench.source_commit(), "date": datetime.date.today().isoformat(),
          "jax_version": jax.__version__, "jaxlib": jaxlib.__version__, "device": device,
          "target": target or (f"XLA:{backend.upper()}" if backend else device)}
  meta.update(extra)
  return meta


def _md_with_meta(lines, meta):
  """``lines`` with the stamp as a bullet list under the title (the first line)."""
  bullets = [f"- {k}: {v}" for k, v in meta.items()
             if k in ("commit", "date", "jax_version", "device", "target")]
  if not lines or not lines[0].startswith("#"):
    return bullets + [""] + lines
  rest = lines[2:] if lines[1:2] == [""] else lines[1:]
  return [lines[0], ""] + bullets + [""] + rest


def write_report(stem, data, lines, *, target=None, meta=None, results=RESULTS):
  """Writes ``<results>/<stem>.json`` and ``<stem>.md`` and prints the Markdown.

  The JSON is ``data`` (a list goes under ``"rows"``) with ``"meta"``: `stamp` (``target``)
  updated by ``meta`` and by any ``"meta"`` ``data`` holds; the Markdown is ``lines`` with
  the stamp under its title. Returns the JSON's path."""
  data = dict(rows=data) if isinstance(data, list) else dict(data)
  full = stamp(target)
  full.update(meta or {})
  full.update(data.pop("meta", None) or {})
  os.makedirs(results, exist_ok=True)
  path = os.path.join(results, f"{stem}.json")
  with open(path, "w") as f:
    json.dump({"meta": full, **data}, f, indent=1, default=str)
  md = _md_with_meta(list(lines), full)
  with open(os.path.join(results, f"{stem}.md"), "w") as f:
    f.write("\n".join(md) + "\n")
  print("\n".join(md))
  return path


def write_bench(rows, stem, *, target=None, meta=None, results=RESULTS):
  """`jmem.bench` rows: ``bench.write_results`` (``<stem>.json``, ``.md``,
  ``_memory.png``) with the same stamp as `write_report`. Returns its paths."""
  from jmem import bench  # pylint: disable=g-import-not-at-top
  full = stamp(target)
  full.update(meta or {})
  return bench.write_results(rows, results, stem=stem, meta=full)
