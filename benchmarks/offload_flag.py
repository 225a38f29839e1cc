"""Does XLA:GPU's host-memory-offloading pass free device memory for jmem's offload?

  python benchmarks/offload_flag.py [--group resnet50-f32] [--batch 64]

On an H100 (2026-11-27, `results/gpu/gpu_offload_*`), jmem's ``offload`` moved 7.5 GiB of
residuals to the host and back, yet its step's temp bytes were 0.97x exact's: the device
buffers outlived their copies. XLA:GPU has a pass behind
``--xla_gpu_enable_host_memory_offloading`` (off by default). This compiles ResNet-50's
train step for the H100 target (deviceless: XLA:GPU's own buffer assignment, on a CPU) at
batch 64 for ``exact``, ``offload`` and ``offload-2bit`` (residuals at 2 bits on the host),
each with the flag off and on, and writes the temp bytes, the host bytes and the host
transfers of each schedule (`gpu_offload.host_transfers`) to
``results/offload_flag.{json,md}``. The planner offers offload only where it cuts temp by
at least 20% (`MIN_CUT`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # pylint: disable=g-import-not-at-top,wrong-import-position
import gpu  # pylint: disable=g-import-not-at-top,wrong-import-position
import gpu_offload  # pylint: disable=g-import-not-at-top,wrong-import-position

TECHNIQUES = ("exact", "offload", "offload-2bit")
FLAG = "xla_gpu_enable_host_memory_offloading"
MIN_CUT = 0.20


def _same(row) -> str:
  if "module_as_without_flag" not in row:
    return "-"
  return "yes" if row["module_as_without_flag"] else "no"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--group", default="resnet50-f32",
                 choices=sorted(dict(gpu.GROUPS, **gpu.QUICK_GROUPS)))
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--target", default="h100")
  p.add_argument("--output-dir", default=_common.RESULTS)
  args = p.parse_args(argv)
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_platforms", "cpu")
  from jmem import measure  # pylint: disable=g-import-not-at-top
  on = measure.target(args.target)
  group = dict(gpu.GROUPS, **gpu.QUICK_GROUPS)[args.group]
  rows = []
  for technique in TECHNIQUES:
    step, abstract, x, y, _, _ = gpu._build(group, technique, args.batch)  # pylint: disable=protected-access
    lowered = on.lower(step, abstract, x, y)
    texts = {}
    for flag in (False, True):
      t0 = time.perf_counter()
      compiled = lowered.compile(compiler_options={FLAG: flag})
      m = compiled.memory_analysis()
      texts[flag] = compiled.as_text()
      tr = gpu_offload.host_transfers(texts[flag])
      rows.append(dict(technique=technique, flag=flag, temp_bytes=int(m.temp_size_in_bytes),
                       host_temp_bytes=int(getattr(m, "host_temp_size_in_bytes", 0) or 0),
                       to_host_bytes=tr["to_host_bytes"], to_device_bytes=tr["to_device_bytes"],
                       held_max_bytes=tr["held_max_bytes"],
                       compile_seconds=time.perf_counter() - t0))
      if flag:   # the flag's effect on the compiled module itself, not only on its bytes
        rows[-1]["module_as_without_flag"] = texts[True] == texts[False]
      print(rows[-1], flush=True)
  exact = {r["flag"]: r["temp_bytes"] for r in rows if r["technique"] == "exact"}
  for r in rows:
    r["temp_vs_exact"] = r["temp_bytes"] / exact[r["flag"]]
    r["cuts_enough"] = r["technique"] != "exact" and 1 - r["temp_vs_exact"] >= MIN_CUT
  gib = lambda b: f"{b / 2**30:.3f}"
  lines = [f"# XLA:GPU's host offloading pass and jmem's offload: {args.group}, batch "
           f"{args.batch}, {on.short}", "",
           f"Written by `python benchmarks/offload_flag.py --group {args.group} --batch "
           f"{args.batch}`. Each step compiled for {on.label}, with `{FLAG}` off and on. "
           "temp: the step's temp bytes on the device; host: XLA's host temp bytes; to host / "
           "back: bytes the schedule copies; held: the most device bytes unfinished copies "
           f"to the host hold at once. Offload is worth planning where it cuts temp by >= "
           f"{MIN_CUT:.0%}.", "",
           "| technique | flag | temp GiB | temp / exact | host GiB | to host GiB | "
           "back GiB | held GiB | module as without the flag |",
           "|---|---|---:|---:|---:|---:|---:|---:|---|"]
  for r in rows:
    lines.append(f"| {r['technique']} | {'on' if r['flag'] else 'off'} | "
                 f"{gib(r['temp_bytes'])} | {r['temp_vs_exact']:.3f} | "
                 f"{gib(r['host_temp_bytes'])} | {gib(r['to_host_bytes'])} | "
                 f"{gib(r['to_device_bytes'])} | {gib(r['held_max_bytes'])} | "
                 f"{_same(r)} |")
  _common.write_report("offload_flag", dict(group=args.group, batch=args.batch, rows=rows),
                       lines, target=on.name, results=args.output_dir)
  return 0


if __name__ == "__main__":
  sys.exit(main())
