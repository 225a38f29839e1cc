"""What is live at the peak of a train step on the H100 target, and where it comes from.

  python benchmarks/gpu_peak.py [--rows flaxmodels-resnet50-f32/actnn-L3,...] [--batch 64]

Each row (``<gpu.py group>/<technique>``) is compiled for the H100 target (XLA:GPU's buffer
assignment, deviceless) at ``--batch``, and `jmem.measure.peak_buffers` reads the buffers
live at the peak of its heap: forward values still held (residuals, compressed or not),
the backward pass's working set, arguments. The forward part is summed by the layer that
made it (its module path), so a residual outside every site stands out. Writes
``results/gpu_peak.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # pylint: disable=g-import-not-at-top,wrong-import-position
import gpu  # pylint: disable=g-import-not-at-top,wrong-import-position

ROWS = ("resnet50-f32/actnn-L3:xla", "flaxmodels-resnet50-f32/actnn-L3")
MIB = 2**20


def peak_row(group: str, technique: str, batch: int, target: str, top: int) -> dict:
  from jmem import measure  # pylint: disable=g-import-not-at-top
  on = measure.target(target)
  step, abstract, x, y, _, _ = gpu._build(gpu.GROUPS[group], technique, batch)  # pylint: disable=protected-access
  with on.lowering():
    report = measure.peak_buffers(step, *on.place((abstract, x, y)))
  by_kind, forward_by_scope = {}, {}
  for b in report.buffers:
    by_kind[b.kind] = by_kind.get(b.kind, 0) + b.bytes
    if b.kind == "forward":
      forward_by_scope[b.scope] = forward_by_scope.get(b.scope, 0) + b.bytes
  largest = sorted((b for b in report.buffers if b.kind != "argument"),
                   key=lambda b: -b.bytes)[:top]
  return dict(
      group=group, technique=technique, batch=batch,
      temp_bytes=report.memory.temp_bytes if report.memory else None,
      live_temp_bytes=report.live_temp_bytes, by_kind=by_kind,
      forward_by_scope=dict(sorted(forward_by_scope.items(), key=lambda kv: -kv[1])),
      largest=[dict(bytes=b.bytes, shape=b.shape[:60], kind=b.kind, scope=b.scope, op=b.op)
               for b in largest])


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--rows", default=",".join(ROWS))
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--target", default="h100")
  p.add_argument("--top", type=int, default=12)
  args = p.parse_args(argv)
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_platforms", "cpu")
  rows = []
  for row in filter(None, args.rows.split(",")):
    group, technique = row.split("/", 1)
    print(f"{row}: compiling for the {args.target} target", flush=True)
    rows.append(peak_row(group, technique, args.batch, args.target, args.top))
  lines = [f"# What is live at the peak, batch {args.batch}, {args.target} target", "",
           f"Written by `python benchmarks/gpu_peak.py --rows {args.rows} --batch "
           f"{args.batch}`: `jmem.measure.peak_buffers` of each step compiled for the "
           "target. forward: values made in the forward pass and still live (what is saved "
           "for the backward, compressed or not); backward: the backward pass's working "
           "set and gradients; per example: bytes / batch.", ""]
  for r in rows:
    per = lambda b: f"{b / MIB:.1f} MiB ({b / r['batch'] / MIB:.2f} per example)"
    lines += [f"## {r['group']} / {r['technique']}", "",
              f"- temp {per(r['temp_bytes'])}; live at the peak, not arguments: "
              f"{per(r['live_temp_bytes'])}",
              "- by kind: " + ", ".join(f"{k} {per(v)}" for k, v in r["by_kind"].items()
                                        if k != "argument"), "",
              "| forward values live at the peak, by layer | MiB | per example |",
              "|---|---:|---:|"]
    for scope, b in list(r["forward_by_scope"].items())[:10]:
      lines.append(f"| `{scope}` | {b / MIB:.1f} | {b / r['batch'] / MIB:.2f} |")
    lines += ["", "| largest buffers live at the peak | MiB | kind | op |", "|---|---:|---|---|"]
    for b in r["largest"]:
      lines.append(f"| `{b['scope']}` {b['shape']} | {b['bytes'] / MIB:.1f} | {b['kind']} | "
                   f"{b['op']} |")
    lines.append("")
  _common.write_report("gpu_peak", dict(rows=rows), lines, target=args.target)
  return 0


if __name__ == "__main__":
  sys.exit(main())
