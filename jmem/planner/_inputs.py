"""What the planner's search is given: the budget and the ladder of policies it may use,
each site's estimates from one trace of the exact step (residual bytes, input bytes,
forward FLOPs) and what a policy keeps and adds there, the sites themselves, the gradient
sensitivities, and the compiled step it measures. No search here: `jmem.planner._search`
walks these."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import re
from collections.abc import Sequence
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jmem import measure
from jmem import surgery
from jmem import step as step_lib
from jmem.ops.actnn import technique as actnn_technique
from jmem.ops.policy import Policy

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
# A site's ladder (`site_ladder`) has rungs (policy kind, bits); approximate policies first
# climb these bit widths (`plan(bits=...)` allows some of them).
_COMPRESS_BITS = (8, 4, 2, 1)
# The site policies `plan(policies=...)` may allow (``save`` is always allowed).
POLICY_KINDS = ("compress", "recompute", "recompute_compressed")


# XLA FLOPs per quantized value, compress and decompress (a measured order of magnitude:
# ActNN L3 on ResNet-50 costs 1.03x exact's FLOPs); the plan's reported FLOPs are XLA's.
_QUANTIZE_FLOPS = 12.0
# Input values of the sensitivity batch, at most (16 examples of 128x128x1; 2 of 224x224x3).
_CALIBRATION_VALUES = 2**18


def budget_share(budget) -> float | None:
  """``"50%"`` -> 0.5 (a share of the exact step's device bytes); None for anything that
  is not a percentage. Raises ValueError for a share outside (0%, 100%]."""
  if isinstance(budget, str) and budget.strip().endswith("%"):
    try:
      value = float(budget.strip()[:-1])
    except ValueError:
      value = float("nan")
    if not 0 < value <= 100:
      raise ValueError(f"budget {budget!r}: a share of the exact step's bytes must be in "
                       "(0%, 100%].")
    return value / 100
  return None


def parse_bytes(budget: int | str) -> int:
  """A device memory size in bytes (int), one meaning everywhere:

  * an int: bytes (``16 * 2**30``), at least 1 KiB (``16`` is refused: 16 GiB is
    ``"16GiB"``);
  * a string with a unit: ``"16GiB"``, ``"12.5 GB"``, ``"800MiB"``, ``"1000B"``;
  * a string of a bare number: GiB (``"1.5"``), as ``jmem plan --budget 1.5`` and ``jmem
    bench --budgets 16,80`` take it.

  A float is refused (bytes or GiB? say which), as is a size of zero or less.
  """
  if isinstance(budget, (bool, np.bool_)):
    raise ValueError(f"budget must be a size, got {budget!r}.")
  if isinstance(budget, numbers.Integral):
    if budget < 1:
      raise ValueError(f"budget must be more than 0 bytes, got {budget!r}.")
    if budget < 1024:      # no train step fits: a number of GiB meant as one, surely
      raise ValueError(f"budget {budget!r} is {budget} bytes (an int is bytes), which no train "
                       f"step fits in: for {budget} GiB give '{budget}GiB' or "
                       f"{budget} * 2**30.")
    return int(budget)
  if isinstance(budget, numbers.Real):
    raise ValueError(f"budget {budget!r}: a bare float is ambiguous (bytes or GiB?): give "
                     "bytes as an int (e.g. 16 * 2**30) or a string with a unit ('1.5GiB').")
  if isinstance(budget, str):
    m = re.fullmatch(r"\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", budget)
    if m and (not m.group(2) or m.group(2).lower() in _UNITS):
      unit = _UNITS[m.group(2).lower()] if m.group(2) else 2**30    # bare: GiB
      value = float(m.group(1)) * unit
      if not value >= 1:
        raise ValueError(f"budget {budget!r} must be more than 0 bytes (at least 1 byte).")
      return int(value)
  raise ValueError(f"budget {budget!r} is not a size: give bytes (an int) or a string such as "
                   "'16GiB', '800MiB', '12GB' or '1.5' (GiB).")


def compile_step(model, optimizer, x, y, *, abstract=None, mesh=None, specs=None,
                 loss_fn=None):
  """``model``'s donating train step (`jmem.step`'s, with ``optimizer`` and ``loss_fn``,
  default: cross-entropy with integer labels) compiled for the batch ``x``, ``y`` (arrays
  or ShapeDtypeStructs); ``abstract``: the train state's shapes, if already known. With
  ``mesh`` (a `jax.sharding.Mesh`), the batch is sharded over it by ``specs`` (x's and
  y's `PartitionSpec`) and the train state replicated, as `jmem.plan(mesh=...)` compiles
  it: its figures are then per device."""
  return _lowered_step(model, optimizer, x, y, abstract=abstract, mesh=mesh,
                       specs=specs, loss_fn=loss_fn).compile()


def _lowered_step(model, optimizer, x, y, **kwargs):
  """`compile_step`'s step lowered (the ``jax.stages.Lowered`` it compiles)."""
  step, args = _train_step(model, optimizer, x, y, **kwargs)
  return step.lower(*args)


def _train_step(model, optimizer, x, y, *, abstract=None, mesh=None, specs=None,
                loss_fn=None):
  """``(step, args)``: `compile_step`'s jitted step and the abstract arguments it is
  compiled for (the same arguments)."""
  fns = step_lib.model_fns(model)
  if abstract is None:
    abstract = step_lib.abstract_state(fns, optimizer, x)
  if (mesh is None) != (specs is None) or specs is not None and (
      isinstance(specs, P) or len(specs) != 2 or not all(isinstance(s, P) for s in specs)):
    raise ValueError(f"compile_step takes mesh= and specs=(x's PartitionSpec, y's) together "
                     f"(or neither: one device), got mesh={mesh!r}, specs={specs!r}.")
  if mesh is not None:
    on = lambda a, spec: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                              sharding=NamedSharding(mesh, spec))
    x, y = on(x, specs[0]), on(y, specs[1])
    abstract = jax.tree.map(lambda a: on(a, P()), abstract)
  return step_lib.make_train_step(fns, optimizer, donate=True, loss_fn=loss_fn), (abstract, x, y)


def step_cost(model, optimizer, x, y, *, abstract=None, mesh=None,
              specs=None, loss_fn=None) -> tuple[int, float]:
  """``(device bytes, FLOPs)`` of `compile_step` (the same arguments): per device with
  ``mesh``; FLOPs by `jmem.measure.step_flops` (off the CPU, the lowered module's)."""
  lowered = _lowered_step(model, optimizer, x, y, abstract=abstract, mesh=mesh, specs=specs,
                          loss_fn=loss_fn)
  return measure.device_bytes_and_flops(lowered.compile(), lowered)


# ------------------------------------------------------------------ per-site estimates

@dataclasses.dataclass
class _Site:
  path: str
  residual_bytes: float = 0.0       # per example, exact
  input_bytes: float = 0.0          # per example
  input_values: float = 0.0         # per example (in whatever dtype the site takes)
  forward_flops: float = 0.0        # per example
  values: float = 0.0               # residual values per example (quantizer work)
  residuals: int = 0                # residual arrays (kernels a policy adds run per array)


def _flops_of(eqn) -> float:
  name = eqn.primitive.name
  if name == "dot_general":
    (lc, _), _ = eqn.params["dimension_numbers"]
    k = math.prod(eqn.invars[0].aval.shape[i] for i in lc)
    return 2.0 * math.prod(eqn.outvars[0].aval.shape) * k
  if name == "conv_general_dilated":
    rhs = eqn.invars[1].aval.shape
    dn = eqn.params["dimension_numbers"]
    spatial = math.prod(rhs[i] for i in dn.rhs_spec[2:])
    in_features = rhs[dn.rhs_spec[1]]
    return 2.0 * math.prod(eqn.outvars[0].aval.shape) * spatial * in_features
  return 0.0


def _walk(jaxpr, visit):
  for eqn in jaxpr.eqns:
    visit(eqn)
    for v in eqn.params.values():
      inner = getattr(v, "jaxpr", v)
      if hasattr(inner, "eqns"):
        _walk(inner, visit)


def _owner(scope: str, paths: Sequence[str]) -> str | None:
  for p in paths:
    if scope == p or scope.startswith(p + "/"):
      return p
  return None


def _nnx_probe(model, paths, record):
  """A copy of the NNX ``model`` whose calls of the sites ``paths`` give their arguments to
  ``record(path, args)`` and run in a ``jax.named_scope`` of their path (under one of the top
  module's class name, as linen's name stack is), so `jmem.measure.module_path` finds them."""
  probe = nnx.clone(model)

  def scoped(base, name, path):
    def __call__(self, *args, **kwargs):  # pylint: disable=invalid-name
      if path is not None:
        record(path, args)
      with jax.named_scope(name):
        return base.__call__(self, *args, **kwargs)
    return type(base.__name__, (base,), {"__call__": __call__, "__module__": base.__module__,
                                         "__qualname__": base.__qualname__})

  for p, m in list(nnx.iter_graph(probe)):
    path = "/".join(str(k) for k in p)
    if path in paths:
      m.__class__ = scoped(type(m), path, path)
  probe.__class__ = scoped(type(probe), type(probe).__name__, None)
  return probe


def _estimate_sites(model, optimizer, x, y, paths, loss_fn=None) -> tuple[list[_Site], float]:
  """Per-example residual bytes, input bytes and forward FLOPs of each site, and the
  residual bytes no site holds; traced at the example batch."""
  batch = x.shape[0]
  sites = {p: _Site(p) for p in paths}

  def record(path, args):
    if path in sites and not sites[path].input_bytes:
      arrays = [a for a in jax.tree.leaves(args) if hasattr(a, "dtype")]
      sites[path].input_bytes = float(sum(a.size * a.dtype.itemsize for a in arrays))
      sites[path].input_values = float(sum(a.size for a in arrays))

  if isinstance(model, nnx.Module):
    fns = step_lib.model_fns(_nnx_probe(model, set(paths), record))
    calls = contextlib.nullcontext
  else:
    fns = step_lib.model_fns(model)

    def intercept(next_fun, args, kwargs, context):    # linen: method interception
      if context.method_name == "__call__" and context.module.scope:
        record("/".join(context.module.scope.path), args)
      return next_fun(*args, **kwargs)
    calls = lambda: nn.intercept_methods(intercept)
  abstract = step_lib.abstract_state(fns, optimizer, x)
  loss = step_lib.make_loss(fns, loss_fn)
  rng = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
  report = measure.saved_residuals(lambda *a: loss(*a)[0], abstract.params,
                                   abstract.model_state, x, y, rng, argnums=0)
  outside = 0.0
  for r in report.residuals:
    if r.source != "activation":
      continue
    owner = _owner(r.scope, paths)
    if owner is None:
      outside += r.nbytes
    else:
      sites[owner].residual_bytes += r.nbytes
      sites[owner].values += math.prod(r.shape)
      sites[owner].residuals += 1

  def forward(params, model_state, xb):
    with calls():
      return fns.apply(params, model_state, xb, train=True, rng=jax.random.key(0))
  closed = jax.make_jaxpr(forward)(abstract.params, abstract.model_state, x)

  def visit(eqn):
    owner = _owner(measure.module_path(eqn), paths)
    if owner is not None:
      sites[owner].forward_flops += _flops_of(eqn)
  _walk(closed.jaxpr, visit)
  out = list(sites.values())
  for s in out:
    for f in ("residual_bytes", "input_bytes", "input_values", "forward_flops", "values"):
      setattr(s, f, getattr(s, f) / batch)
  return out, outside / batch


def _kept(site: _Site, rung) -> tuple[float, float]:
  """(bytes per example the site keeps, FLOPs per example it adds) on ``rung``."""
  kind, bits = rung
  if kind == "save":
    return site.residual_bytes, 0.0
  meta = 8.0 / 256                        # a scale and a zero per 256-value group
  if kind == "compress":
    return site.values * (bits / 8 + meta), _QUANTIZE_FLOPS * site.values
  if kind == "recompute":
    return site.input_bytes, site.forward_flops
  if kind == "recompute_compressed":
    inputs = site.input_values
    masks = site.values / 8 / 4           # some of the values are masks, at 1 bit
    return inputs * (bits / 8 + meta) + masks, site.forward_flops + _QUANTIZE_FLOPS * inputs
  raise ValueError(kind)


class Measured(NamedTuple):
  """What compiling one step gave: its device bytes, its lowered FLOPs and, where the
  target has a fitted step-time model, its estimated step time in seconds (else None)."""

  bytes: float
  flops: float
  seconds: float | None = None


@dataclasses.dataclass(frozen=True)
class Objective:
  """The cost the walk steers by and compares plans on: FLOPs (``constants`` None: no
  step-time model for the target), or the step time estimated from the compiled module
  (`jmem.measure.estimate_step_time` with the target's fitted ``constants``).

  ``added(site, rung, batch)`` is a site's cost on a rung over ``save``, for one step of
  ``batch`` examples, in the objective's unit: FLOPs (`_kept`), or seconds by the same
  three terms the step estimate charges, from the site's trace (a GPU runs the quantizer
  as a pass over memory, not arithmetic, so the FLOPs count misses what it costs). The
  terms follow what the H100 target's compiled ResNet-50 steps at batch 128 cost over
  exact's in that estimate (benchmarks/results/plan_h100.md): XLA fuses the quantizer into
  the op that made the value and the dequantizer into the one that reads it, so a value
  compressed at ``b`` bits costs its codes written and read again (``b / 4`` bytes) and
  its group's metadata, and each residual array a quantize and a dequantize kernel; a
  recomputation costs the site's forward FLOPs at the matrix rate of its dtype, its input
  read and its residuals written and read once more, and a kernel per residual array;
  recomputing from a ``b``-bit input adds that input compressed. A ranking of the sites,
  not a prediction: the walk's compiles are estimated from their modules.
  """

  constants: tuple[float, float, float] | None = None

  @property
  def time(self) -> bool:
    return self.constants is not None

  @property
  def name(self) -> str:
    return "estimated step time" if self.time else "FLOPs"

  @property
  def fewer(self) -> str:
    """``"fewer FLOPs"``, or ``"a shorter estimated step time"``: less of the objective."""
    return "a shorter estimated step time" if self.time else "fewer FLOPs"

  def of(self, m: Measured) -> float:
    """``m``'s cost (FLOPs, or estimated seconds)."""
    return m.seconds if self.time else m.flops

  def added(self, site: _Site, rung, batch: int) -> float:
    kind, bits = rung
    if not self.time:
      return batch * _kept(site, rung)[1]
    if kind == "save":
      return 0.0
    a, b, c = self.constants
    itemsize = site.residual_bytes / site.values if site.values else 4.0
    rate = measure.MATMUL_RATE["bf16" if itemsize <= 2 else "f32"]

    def compressed(values, arrays):
      moved = values * (bits / 4 + 2 * 8.0 / 256)
      return a * batch * moved / measure.COPY_RATE + c * 1e-6 * 2 * arrays

    seconds = 0.0
    if kind.startswith("recompute"):
      moved = site.input_bytes + 2 * site.residual_bytes
      seconds += (b * batch * site.forward_flops / rate + a * batch * moved / measure.COPY_RATE
                  + c * 1e-6 * site.residuals)
    if kind == "compress":
      seconds += compressed(site.values, site.residuals)
    elif kind == "recompute_compressed":
      seconds += compressed(site.input_values, 1)
    return seconds


def objective_for(target) -> Objective:
  """The `Objective` of a `jmem.measure.Target`: its estimated step time where a step-time
  model was fitted for it (`jmem.measure.constants_for`: the H100), else FLOPs."""
  return Objective(measure.constants_for(target.name))


def site_ladder(policies: Sequence[str] | str | None = None, approximate: bool = True,
                bits: Sequence[int] | int | None = None) -> tuple:
  """The rungs ``(policy kind, bits)`` of every site's ladder for `plan`'s ``policies``,
  ``approximate`` and ``bits``, from ``("save", None)`` up; raises ValueError for a
  combination `plan` refuses."""
  if policies is None:
    kinds = ("compress", "recompute_compressed") if approximate else ("recompute",)
  else:
    kinds = (policies,) if isinstance(policies, str) else tuple(policies)
  bad = [k for k in kinds if k not in POLICY_KINDS]
  if "offload" in bad:
    raise ValueError(
        "policies= (--policies): the planner does not search 'offload' (the module docstring "
        "says why: on CPU it saves nothing, and on an H100 full-precision offload at every "
        "site of ResNet-50 kept 0.96x exact's peak at 11.5x the step time). Plan without it; "
        "to offload sites yourself, add jmem.Policy('offload', where=...) to the plan's "
        f"techniques. Searchable: {list(POLICY_KINDS)}.")
  if not kinds or bad:
    raise ValueError(f"policies= (--policies) takes site policies of {list(POLICY_KINDS)} "
                     f"(save is always allowed), at least one; got {list(kinds)!r}.")
  quantized = [k for k in kinds if k != "recompute"]
  if not approximate and quantized:
    raise ValueError(f"approximate=False keeps the gradients exact, but policies allows "
                     f"{quantized}, which quantize: allow only 'recompute', or drop "
                     "approximate=False (--exact-only).")
  widths = _COMPRESS_BITS if bits is None else _bit_widths(bits)
  if bits is not None and not quantized:
    raise ValueError(
        "bits= (--bits) sets the widths of quantized values, but "
        + ("approximate=False (--exact-only) quantizes nothing: drop bits or approximate=False."
           if not approximate else
           f"the policies allowed ({', '.join(kinds)}) quantize nothing: allow compress or "
           "recompute_compressed, or drop bits."))
  ladder = [("save", None)]
  if "compress" in kinds:
    ladder += [("compress", b) for b in widths]
  if "recompute_compressed" in kinds:   # from a 2-bit input, or the fewest bits above 1
    ladder.append(("recompute_compressed", min([b for b in widths if b > 1] or [1])))
  elif "recompute" in kinds:
    ladder.append(("recompute", None))
  return tuple(ladder)


def _bit_widths(bits) -> tuple[int, ...]:
  """``bits`` (an int or ints, of `_COMPRESS_BITS`, each once) as Python ints, most first."""
  scalar = isinstance(bits, (numbers.Number, str, bytes, np.ndarray)) and np.ndim(bits) == 0
  try:
    items = [bits] if scalar else list(bits)
  except TypeError:
    items = []
  integral = all(isinstance(b, numbers.Integral) and not isinstance(b, (bool, np.bool_))
                 for b in items)
  widths = [int(b) for b in items] if integral else []
  if not widths or any(b not in _COMPRESS_BITS for b in widths) or \
      len(set(widths)) != len(widths):
    raise ValueError(f"bits= (--bits) takes the bit widths a quantized value may have, some "
                     f"of {list(_COMPRESS_BITS)} (integers), each once; got {bits!r}.")
  return tuple(sorted(widths, reverse=True))


def _rung_text(rung) -> str:
  kind, bits = rung
  return {"save": "save", "compress": f"compressed at {bits} bit{'s' * (bits != 1)}",
          "recompute": "recomputed",
          "recompute_compressed": f"recomputed from a {bits}-bit input"}[kind]


def _variance(sensitivity: float, rung) -> float:
  """The gradient variance a site of GACT sensitivity ``sensitivity`` adds on ``rung``."""
  kind, bits = rung
  return sensitivity / float(2**bits - 1) ** 2 if kind == "compress" else 0.0


def _converted(model, techniques):
  """``jmem.convert(model, *techniques)``; of a copy for an NNX model (convert changes an
  NNX model in place, and the planner converts it many times)."""
  if isinstance(model, nnx.Module):
    model = nnx.clone(model)
  return surgery.convert(model, *techniques)


def _default_sites(model, x, where: str | None = None) -> list[str]:
  """`jmem.convert`'s block sites of ``model`` (``where``: those its regex matches)."""
  probe = Policy("save", where=where)
  if isinstance(model, nnx.Module):
    return list(surgery.sites(_converted(model, [probe])).get("save", []))
  kw = step_lib.mode_kwargs(model, True)
  return list(surgery.sites(surgery.convert(model, probe), x, **kw).get(repr(probe), []))


# A site holding more than this share of the saved activations is planned per module inside
# it, where its children hold at least _COVERED of its bytes (and there are two or more).
_DOMINANT, _COVERED, _MAX_DEPTH = 0.5, 0.9, 3


def _split_dominant(model, optimizer, xs, ys, paths, sites, outside, loss_fn=None):
  """``(paths, sites, outside, notes)`` with a site that holds most of the saved activations
  (a per-frame CNN applied as one submodule, an encoder) replaced by the module calls
  directly inside it (inside the one module it wraps, where it wraps one), repeatedly: one
  site would leave the walk one choice (compress it all, or recompute it all, which keeps
  its whole forward live in the backward: no smaller peak)."""
  notes = []
  x0 = jnp.zeros(xs.shape, xs.dtype)
  for _ in range(_MAX_DEPTH):
    total = sum(s.residual_bytes for s in sites) + outside
    big = max(sites, key=lambda s: s.residual_bytes)
    if big.residual_bytes <= _DOMINANT * total:
      break
    try:
      inner = _default_sites(model, x0, where=re.escape(big.path) + "/[^/]+")
      while len(inner) == 1:                # a wrapper around one module: look inside that
        inner = _default_sites(model, x0, where=re.escape(inner[0]) + "/[^/]+")
    except surgery.NothingMatched:          # no module call inside: a leaf site
      break
    if len(inner) < 2:
      break
    at = paths.index(big.path)
    new_paths = paths[:at] + inner + paths[at + 1:]
    new_sites, new_outside = _estimate_sites(model, optimizer, xs, ys, new_paths, loss_fn)
    covered = sum(s.residual_bytes for s in new_sites if s.path in inner)
    if covered < _COVERED * big.residual_bytes:
      notes.append(f"the site {big.path!r} holds {big.residual_bytes / total:.0%} of the saved "
                   f"activations, but the modules inside it only {covered / total:.0%} (the "
                   "rest is inline code): planned as one site")
      break
    notes.append(f"the site {big.path!r} held {big.residual_bytes / total:.0%} of the saved "
                 f"activations: planned per module inside it ({len(inner)} sites)")
    paths, sites, outside = new_paths, new_sites, new_outside
  return paths, sites, outside, notes


def _block_techniques(model) -> list:
  """The block techniques (`Remat`, `ActNN`, `Policy`, `SBP`) the linen ``model`` was
  converted with."""
  return [t for t in getattr(model, "techniques", ())
          if not isinstance(t, (surgery.SyncBN, surgery.InPlaceABN, surgery.Spatial))]


def _reach(share: float, outside: float, paths, needed: bool) -> list[str]:
  """Where the exact step does not fit (``needed``), raises if the sites hold under 10% of
  its saved activations (``share``: the policies could change next to nothing); a note if
  they hold under half. Checked after the exact compiles: a refusal costs those two."""
  where = (f"the rest, {outside / 2**20:.2f} MiB per example on one device, is made outside "
           "them: by code inline in the top module, or by modules applied detached (e.g. "
           "Module(parent=None).apply inside __call__), which jmem.convert's policies do not "
           "reach")
  if share < 0.1 and needed:
    raise ValueError(
        f"jmem.plan: the block sites {paths} hold {share:.1%} of the train step's saved "
        f"activations; {where}. Make the blocks submodules of the model (self.block = "
        "Block(...) in setup, or Block(name=...)(x)), or use the model's own memory "
        "technique.")
  if share < 0.5:
    return [f"the block sites hold {share:.0%} of the saved activations; {where}"]
  return []


def _inplace_abn(model, x, allowed: bool, max_compiles: int):
  """``(InPlaceABN over every BatchNorm it can take, or None, a note or None)``."""
  if not allowed:
    return None, None
  if max_compiles < 4:
    return None, (f"InPlace-ABN not tried: max_compiles={max_compiles} (it needs 4: the exact "
                  "step twice, InPlace-ABN's, the walk's)")
  if any(isinstance(t, (surgery.SyncBN, surgery.InPlaceABN))
         for t in getattr(model, "techniques", ())):
    return None, ("InPlace-ABN not tried: the model's BatchNorms were converted already "
                  "(SyncBN or InPlaceABN)")
  kw = step_lib.mode_kwargs(model, True) if isinstance(model, nn.Module) else {}
  paths = surgery.inplace_abn_sites(model, jnp.zeros(x.shape, x.dtype), **kw)
  if not paths:
    return None, ("InPlace-ABN not applicable: no BatchNorm followed by leaky_relu or elu in "
                  "a Sequential (what jmem.InPlaceABN converts)")
  return surgery.InPlaceABN(where="|".join(re.escape(p) for p in paths)), None


def _offload_note(mesh, target=None) -> str:
  """Why the plan has no ``offload`` site, for the platform it compiles for (``target``: a
  `jmem.measure.Target`, whose platform it is where it is compiled for without a device)."""
  platform = (mesh.devices.flat[0].platform if mesh is not None else
              target.platform if target is not None and target.deviceless else
              jax.default_backend())
  if platform == "cpu":
    return ("offload not searched (on CPU, where host and device memory are one, it saves "
            "nothing: only a GPU compile could measure it)")
  return (f"offload not searched ({platform}): neither of the walk's costs (FLOPs, the "
          "estimated step time) counts offload's host transfers, the H100 target's buffer "
          "assignment put full-precision offload at 0.44x exact's temp where the H100 itself "
          "held 0.97x (benchmarks/results/offload_flag.md), and where offload was measured (an "
          "H100, ResNet-50 224² at batch 64) it lost on both figures: 0.97x exact's temp "
          "bytes at 11.5x the step time, where recompute-2bit compiled to 0.29x at 1.21x)")


def _measured_sensitivities(model, paths, batch, x, y, loss_fn=None
                            ) -> tuple[dict[str, float], int]:
  """``C`` of each site the probe sees, measured at 2 bits on the examples ``batch`` at
  the model's initial weights (of ``loss_fn``, default cross-entropy), and the number of
  examples used."""
  ok = isinstance(batch, (tuple, list)) and len(batch) == 2
  cx, cy = batch if ok else (None, None)
  if not ok or (tuple(np.shape(cx)[1:]), tuple(np.shape(cy)[1:])) != (
      tuple(x.shape[1:]), tuple(y.shape[1:])) or len(cx) != len(cy) or len(cx) < 2:
    got = (f"x {np.shape(cx)} and y {np.shape(cy)}" if ok else
           f"a {type(batch).__name__}")
    raise ValueError(f"calibration_batch must be (x, y) arrays of at least 2 examples shaped "
                     f"like the example batch's, x (n, {', '.join(map(str, x.shape[1:]))}) and "
                     f"y (n{''.join(f', {d}' for d in y.shape[1:])}); got {got}.")
  for name, a in (("x", cx), ("y", cy)):
    a = np.asarray(a)
    if np.issubdtype(a.dtype, np.inexact) and not np.all(np.isfinite(a)):
      bad = int(np.sum(~np.isfinite(a)))
      raise ValueError(f"calibration_batch's {name} holds {bad} non-finite values (NaN or "
                       "inf): every site's gradient sensitivity would be NaN. Pass real, "
                       "finite examples (or sensitivities=).")
  params, probe_loss, data = actnn_technique.calibration_problem_on(
      model, cx, cy, max_values=_CALIBRATION_VALUES, loss_fn=loss_fn)
  where = "|".join(re.escape(p) for p in paths)
  c, _ = surgery.sensitivities(model, probe_loss, params, data,
                               surgery.ActNN("L3", where=where), bits=2)
  bad = {p: v for p, v in c.items() if p in paths and not math.isfinite(v)}
  if bad:
    raise ValueError(f"The gradient sensitivities measured on calibration_batch are not finite "
                     f"at the sites {sorted(bad)} (the model's loss or gradients on those "
                     "examples overflow): pass other examples, or sensitivities=.")
  return {p: float(v) for p, v in c.items() if p in paths}, int(data[0].shape[0])


def _compiled_slope(a, b, low: float = 0.1, high: float = math.inf) -> float:
  """Compiled bytes per estimated byte from ``(estimate, compiled)`` point ``a`` to ``b`` (a
  miss and a fit, two misses, or two fitting plans of the undo tries), held within [``low``,
  ``high``]: by default at least 0.1 (a point saved nothing compiled); 1 where the estimate
  does not fall from ``a`` to ``b``. Above 1 the compile saved more than the estimate, and
  undoing a reduction costs more than estimated too."""
  drop = a[0] - b[0]
  return min(max((a[1] - b[1]) / drop, low), high) if drop > 0 else 1.0
