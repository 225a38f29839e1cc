"""Why full-precision offload did not lower the device peak on an H100: the figures that
could tell, in one command for the next GPU lease.

Run 4 (`results/gpu_nvidia_h100_80gb_hbm3_run4.md`): ResNet-50 224² at batch 64,
``Policy("offload")`` at every site compiled to 0.97x exact's temp bytes and stepped 11.5x as
long (as if the transfers happened) while the peak stayed. This compiles the same step
(``--group resnet50-f32``, its batch 64 by default) several ways:

* ``exact``;
* ``offload``: jmem's (`jmem.ops.actnn.quantize.offload_residuals`: a ``custom_vjp`` whose
  forward puts every floating residual of at least 1024 values, and every bit-packed mask,
  in ``pinned_host`` after an optimization barrier, and whose backward brings them back
  after the cotangent exists); the site's own inputs are among its residuals;
* ``offload-no-barrier``: the same without its two barriers;
* ``offload-remat``: JAX's own mechanism instead, the one ``save_and_offload_only_these_names``
  uses: each site under ``jax.checkpoint`` with a policy that marks every residual
  ``jax.ad_checkpoint.Offloadable("device", "pinned_host")``. It moves another set of
  arrays: not the site's inputs (inputs of the checkpoint, not residuals), but masks
  unpacked and arrays of any size (on ResNet-8, 54 arrays under 1024 values), so a
  difference from ``offload`` is not the mechanism's alone.

For each: the compiled memory (``temp_size_in_bytes``, and the host figures XLA reports); the
FLOPs of the compiled and of the lowered step (`jmem.measure.step_flops`'s two counts, which
have not yet been compared on a GPU: the compiled count should leave out the cuDNN
convolutions, and the lowered one, divided by the batch, come near XLA:CPU's 23.9 GFLOP per
example for exact); and from the compiled (scheduled) module, `host_transfers`: the bytes
copied to the host and back, the most device bytes that copies to the host still hold at
one point of the schedule (a copy's source stays allocated until its ``copy-done``: if the
scheduler puts the ``copy-done`` s late, the device copies stay through the forward pass),
the bytes whose copy to the host ends only in the backward pass, and those whose copy back
starts already in the forward pass (device copies back before they are needed). Then, in
one process, in ascending order of compiled temp bytes, ``peak_bytes_in_use`` (the
process's running maximum: recorded with whether the run raised it), the step time (median
of 5 steps after 2) and the loss after the 7 steps (the variants are exact: the same loss as
exact's, to rounding).

  python benchmarks/gpu_offload.py [--group resnet50-f32] [--batch N]
  JAX_PLATFORMS=cpu python benchmarks/gpu_offload.py --allow-cpu --group resnet8-f32

On a CPU, XLA drops the memory placements (one memory for host and device), so the CPU run
only checks the script: the variants compile to nearly the same bytes and no transfers. On a
GPU it writes ``gpu_offload_<device>.json`` and ``.md`` into ``--output-dir`` after every
compile and every run, so a run cut short keeps what it measured; a variant that fails to
compile (or whose module this script cannot read) or to run is written with its error, and
the others go on. ResNet-50 steps compiled in 26-44 s each on an H100 (run 4): about 3
minutes for the four, then seconds to run them. The reader of the schedule knows the print
format of JAX 0.10.2's XLA (the tests' synthetic modules); where it finds host copy-starts
without their copy-done it says so (``unpaired``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # pylint: disable=g-import-not-at-top,wrong-import-position
import gpu  # pylint: disable=g-import-not-at-top,wrong-import-position

VARIANTS = ("exact", "offload", "offload-no-barrier", "offload-remat")

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\](\{[^}]*\})?")
_LINE = re.compile(r"^(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
# "TYPE opcode(": the type (an array, or a tuple of arrays whose layouts may hold "S(5)")
# up to the first word right after a space and right before a parenthesis.
_INSTRUCTION = re.compile(r"\s*(.*?)\s([\w\-]+)\(")


def _array_bytes(dtype: str, dims: str) -> int:
  n = 1
  for d in filter(None, dims.split(",")):
    n *= int(d)
  return n * _DTYPE_BYTES.get(dtype, 4)


def _operands(text: str) -> list[str]:
  """The operand names of ``opcode(...)...`` given the text after its ``(``: each top-level
  operand's last token without ``%`` (XLA prints ``%x``, ``x``, or ``f32[8]{0} %x``)."""
  depth, part, parts = 0, "", []
  for ch in text:
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      if depth == 0:
        break
      depth -= 1
    if ch == "," and depth == 0:
      parts.append(part)
      part = ""
    else:
      part += ch
  parts.append(part)
  return [p.split()[-1].lstrip("%") for p in parts if p.strip()]


def host_transfers(hlo_text: str) -> dict:
  """The host transfers of a compiled (scheduled) module's entry computation, in schedule
  order: a ``copy-start`` whose destination (the first array of its result) is in host
  memory (layout memory space ``S(5)``) starts a copy to the host, one whose source (the
  second) is, a copy back; its ``copy-done`` ends it.

  The backward pass starts at the first instruction JAX named ``transpose(...)`` (else at
  the first copy back; ``backward_from`` says which). Returns the count and bytes each way;
  ``held_max_bytes``, the most bytes of copies to the host started and not yet done at one
  point (a copy's device source stays allocated until its ``copy-done``); of the copies to
  the host, the bytes done only in the backward pass (their device copies held through the
  forward); of the copies back, the bytes started in the forward pass (device copies
  brought back before the backward needs them); the synchronous ``copy`` s into or out of
  host memory; ``unpaired_copy_starts`` (host copies whose ``copy-done`` was not found: a
  print format this reader does not know), ``host_arrays`` (entry instructions with a
  host-memory result) and ``module_copy_starts_to_host`` (in every computation: copies
  inside called computations are not in the other figures).
  """
  from jmem.measure import _hlo_traffic  # pylint: disable=g-import-not-at-top
  entry = [m.groups() for m in map(_LINE.match, map(str.strip,
                                                    _hlo_traffic.entry_lines(hlo_text) or ()))
           if m]
  starts, to_host, to_device, sync = {}, [], [], {"to_host": 0, "to_device": 0}
  on_host, backward = {}, None
  for i, (name, rhs) in enumerate(entry):
    m = _INSTRUCTION.match(rhs)
    if m is None:
      continue
    arrays, opcode = _ARRAY.findall(m.group(1)), m.group(2)
    operands = _operands(rhs[m.end():])
    on_host[name] = bool(arrays) and "S(5)" in (arrays[0][2] or "")
    if backward is None and re.search(r'op_name="[^"]*transpose\(', rhs):
      backward = i
    if opcode == "copy-start" and len(arrays) >= 2:    # (destination, source, context)
      host_dest, host_src = ("S(5)" in (a[2] or "") for a in arrays[:2])
      if host_dest or host_src:
        starts[name] = (i, _array_bytes(*arrays[0][:2]), host_dest)
    elif opcode == "copy-done" and operands and operands[0] in starts:
      begin, size, host_dest = starts.pop(operands[0])
      (to_host if host_dest else to_device).append((begin, i, size))
    elif opcode == "copy" and arrays and operands:
      if on_host[name]:
        sync["to_host"] += _array_bytes(*arrays[0][:2])
      elif on_host.get(operands[0]):
        sync["to_device"] += _array_bytes(*arrays[0][:2])
  backward_from = "transpose" if backward is not None else None
  if backward is None and to_device:
    backward, backward_from = min(b for b, _, _ in to_device), "first copy back"
  held = held_max = 0
  events = [e for b, d, s in to_host for e in ((b, s), (d, -s))]
  for _, delta in sorted(events, key=lambda e: (e[0], e[1] < 0)):
    held += delta
    held_max = max(held_max, held)
  spans = [(e - b) / max(len(entry), 1) for b, e, _ in to_host]
  return {"to_host": len(to_host), "to_host_bytes": sum(s for *_, s in to_host),
          "to_device": len(to_device), "to_device_bytes": sum(s for *_, s in to_device),
          "held_max_bytes": held_max, "backward_from": backward_from,
          "to_host_done_in_backward_bytes": sum(
              s for _, e, s in to_host if backward is not None and e > backward),
          "to_device_started_in_forward_bytes": sum(
              s for b, _, s in to_device if backward is not None and b < backward),
          "to_host_span_median": statistics.median(spans) if spans else None,
          "sync_copy_bytes": sync, "unpaired_copy_starts": len(starts),
          "host_arrays": sum(on_host.values()),
          "module_copy_starts_to_host": len(re.findall(
              r"=\s*\(\s*(?:pred|[suf]\d+|bf16)\[[\d,]*\]\{[^}]*S\(5\)[^}]*\}[^=]*?\scopy-start\(",
              hlo_text)),
          "instructions": len(entry)}


def _offload_by_remat(f, *, min_size=1024, param_argnums=(0,)):
  """`offload_residuals`'s signature, by JAX's remat offloading: every residual of ``f``
  marked offloadable (the arguments, its variables among them, are inputs, not residuals)."""
  del min_size, param_argnums
  import jax  # pylint: disable=g-import-not-at-top
  from jax.ad_checkpoint import Offloadable  # pylint: disable=g-import-not-at-top
  g = jax.checkpoint(f, policy=lambda *a, **k: Offloadable("device", "pinned_host"),
                     prevent_cse=True)
  return lambda *args, key=None: g(*args)


@contextlib.contextmanager
def _variant(name: str):
  """Lowering inside this gives ``name``'s step (of the ``offload`` technique but exact)."""
  from jmem.ops.actnn import quantize as q  # pylint: disable=g-import-not-at-top
  saved = {k: getattr(q, k) for k in ("offload_residuals", "barrier")}
  if name == "offload-remat":
    q.offload_residuals = _offload_by_remat
  elif name == "offload-no-barrier":
    q.barrier = lambda tree: tree
  try:
    yield "exact" if name == "exact" else "offload"
  finally:
    for k, v in saved.items():
      setattr(q, k, v)


def _memory_figures(compiled) -> dict:
  m = compiled.memory_analysis()
  return {k: int(getattr(m, k)) for k in dir(m)
          if k.endswith("_in_bytes") and isinstance(getattr(m, k), int)}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--group", default="resnet50-f32",
                      choices=sorted(dict(gpu.GROUPS, **gpu.QUICK_GROUPS)))
  parser.add_argument("--batch", type=int, default=None,
                      help="default: the group's (64 for resnet50-f32, run 4's step)")
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument("--output-dir", default=gpu.RESULTS)
  parser.add_argument("--allow-cpu", action="store_true",
                      help="run on a CPU (checks the script; writes nothing)")
  args = parser.parse_args(argv)
  import jax  # pylint: disable=g-import-not-at-top
  platform = jax.devices()[0].platform
  if platform == "cpu" and not args.allow_cpu:
    print("no GPU here: gpu_offload.py measures host offloading on a GPU (--allow-cpu checks "
          "the script on a CPU, where XLA drops the memory placements)")
    return 0
  variants = [v for v in args.variants.split(",") if v]
  unknown = sorted(set(variants) - set(VARIANTS))
  if unknown:
    parser.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
  from jmem import measure  # pylint: disable=g-import-not-at-top
  group = dict(gpu.GROUPS, **gpu.QUICK_GROUPS)[args.group]
  args.batch = args.batch or group["batches"][0]
  t0 = time.time()
  log = lambda m: print(f"[{time.time() - t0:6.1f}s] {m}", flush=True)
  device = jax.devices()[0].device_kind
  out = {"meta": _common.stamp(device, device=device), "group": args.group,
         "batch": args.batch, "device": device, "jax": jax.__version__, "rows": {}}
  rows, steps = out["rows"], {}
  # Written after every compile and run on a GPU: a run cut short keeps what it measured.
  save = (lambda: None) if platform == "cpu" else (lambda: _write(out, args, t0))
  for v in variants:
    t = time.perf_counter()
    try:
      with _variant(v) as technique:
        step, abstract, x_spec, y_spec, make_state, make_batch = gpu._build(  # pylint: disable=protected-access
            group, technique, args.batch)
        lowered = step.lower(abstract, x_spec, y_spec)
      compiled = lowered.compile()
      rows[v] = {"compile_s": time.perf_counter() - t, "memory": _memory_figures(compiled),
                 "transfers": host_transfers(compiled.as_text()),
                 # jmem.measure.step_flops's two counts (first taken on a GPU here): the
                 # compiled module's leaves out cuDNN/cuBLAS calls, the lowered one's should
                 # not.
                 "flops": {"compiled": measure._compiled._flops_of(compiled),  # pylint: disable=protected-access
                           "lowered": measure.lowered_flops(lowered),
                           "step_flops": measure.step_flops(compiled, lowered)}}
    except Exception as e:  # pylint: disable=broad-except
      rows[v] = {"compile_error": f"{type(e).__name__}: {str(e)[:500]}"}
      log(f"{v}: {rows[v]['compile_error']}")
      save()
      continue
    if rows[v]["transfers"]["unpaired_copy_starts"]:
      log(f"{v}: WARNING {rows[v]['transfers']['unpaired_copy_starts']} host copy-starts "
          "without a copy-done this reader found: the transfer figures are incomplete")
    steps[v] = (compiled, make_state, make_batch)
    log(f"{v}: {json.dumps(rows[v])}")
    save()
  exact = rows.get("exact", {}).get("memory", {}).get("temp_size_in_bytes")
  for v in sorted(steps, key=lambda v: rows[v]["memory"].get("temp_size_in_bytes", 0)):
    if exact and v != "exact":
      rows[v]["temp_vs_exact"] = rows[v]["memory"].get("temp_size_in_bytes", 0) / exact
    compiled, make_state, make_batch = steps.pop(v)
    times = []
    try:
      state, (x, y) = make_state(), make_batch()
      before = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
      for i in range(7):
        t = time.perf_counter()
        state, metrics = compiled(state, x, y)
        jax.block_until_ready(metrics)
        if i >= 2:
          times.append(time.perf_counter() - t)
      stats = jax.devices()[0].memory_stats() or {}
      peak = stats.get("peak_bytes_in_use")
      # The process's running maximum: its own only if this run raised it.
      rows[v]["run"] = {"step_s": statistics.median(times), "peak_bytes_in_use": peak,
                        "peak_is_own": None if peak is None or before is None else peak > before,
                        "loss": float(metrics["loss"])}
      del state
    except Exception as e:  # pylint: disable=broad-except
      rows[v]["run"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    del compiled
    log(f"{v}: {json.dumps(rows[v]['run'])}")
    save()
  out["wall_s"] = time.time() - t0
  print(json.dumps(out, indent=1))
  save()
  return 0


def _write(out: dict, args, t0: float) -> None:
  """``gpu_offload_<device>.json`` and ``.md`` in ``args.output_dir``, as measured so far."""
  out = dict(out, wall_s=time.time() - t0)
  os.makedirs(args.output_dir, exist_ok=True)
  stem = os.path.join(args.output_dir, "gpu_offload_" +
                      re.sub(r"[^a-z0-9]+", "_", out["device"].lower()).strip("_"))
  with open(stem + ".json", "w") as f:
    json.dump(out, f, indent=1)
  gib = lambda b: "-" if b is None else f"{b / 2**30:.2f}"
  per = lambda f: "-" if f is None else f"{f / args.batch / 1e9:.2f}"
  lines = [f"# Host offload on {out['device']}: {args.group}, batch {args.batch}", "",
           "Written by `benchmarks/gpu_offload.py` (JAX " + out["jax"] + f", {out['wall_s']:.0f}"
           f" s; commit {out['meta']['commit']}, {out['meta']['date']}). temp: the compiled "
           "step's temp bytes; to host, back: bytes its schedule "
           "copies to host memory and back; held: the most device bytes that unfinished "
           "copies to the host hold at once; done in bwd: bytes whose copy to the host ends "
           "only in the backward pass; back in fwd: bytes whose copy back starts in the "
           "forward pass (the backward starting at the first `transpose(` op, else at the "
           "first copy back: the JSON's backward_from); unpaired: host copy-starts whose "
           "copy-done was not found (the figures are then incomplete); peak: "
           "peak_bytes_in_use after its 7 steps, variants run in ascending temp (own: whether "
           "the run raised the process's running maximum; if not, the figure is an earlier "
           "one's); loss after 7 steps.", "",
           "| variant | temp GiB | vs exact | to host GiB | back GiB | held GiB | done in bwd "
           "GiB | back in fwd GiB | unpaired | peak GiB (own) | step ms | loss | "
           "GFLOP/example compiled, lowered |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for v, r in out["rows"].items():
    if "compile_error" in r:
      lines.append(f"| {v} | compile failed: {r['compile_error'][:200]} ||||||||||||")
      continue
    tr, run = r["transfers"], r.get("run", {})
    step = f"{run['step_s'] * 1e3:.1f}" if "step_s" in run else run.get("error", "-")
    loss = f"{run['loss']:.6f}" if "loss" in run else "-"
    ratio = "1.00x" if v == "exact" else (
        f"{r['temp_vs_exact']:.2f}x" if "temp_vs_exact" in r else "-")
    own = {True: "yes", False: "no", None: "?"}[run.get("peak_is_own")]
    lines.append(f"| {v} | {gib(r['memory'].get('temp_size_in_bytes'))} | {ratio} | "
                 f"{gib(tr['to_host_bytes'])} | {gib(tr['to_device_bytes'])} | "
                 f"{gib(tr['held_max_bytes'])} | {gib(tr['to_host_done_in_backward_bytes'])} | "
                 f"{gib(tr['to_device_started_in_forward_bytes'])} | "
                 f"{tr['unpaired_copy_starts']} | {gib(run.get('peak_bytes_in_use'))} ({own}) | "
                 f"{step} | {loss} | "
                 f"{per(r['flops']['compiled'])}, {per(r['flops']['lowered'])} |")
  with open(stem + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  sys.exit(main())
