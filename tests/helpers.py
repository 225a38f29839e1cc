"""Helpers shared by several test modules (imported as ``helpers``: pytest puts tests/ on
the path)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

# Per-dtype tolerances of exact techniques against their references.
TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=5e-2, atol=5e-2)}


def bn_data(shape, dtype=jnp.float32, seed=0):
  """``(x, scale, bias, cotangent)`` for a normalisation over the last axis of ``shape``."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=shape) * 3 + 1, dtype)
  g = jnp.asarray(rng.normal(size=shape[-1]), jnp.float32)
  b = jnp.asarray(rng.normal(size=shape[-1]), jnp.float32)
  ct = jnp.asarray(rng.normal(size=shape), dtype)
  return x, g, b, ct


def assert_close_scaled(got, want, *, rtol=1e-5, atol=1e-5):
  """``got`` equals ``want`` to the tolerances, both divided by ``max(1, max|want|)``."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  scale = max(1.0, float(np.abs(want).max()))
  np.testing.assert_allclose(got / scale, want / scale, rtol=rtol, atol=atol)


def assert_trees_close(got, want, tol=1e-5):
  """Same tree; every leaf within ``tol`` of ``want`` relative to ``max(1e-3, max|want|)``
  over the whole tree (gradients near 0, such as an attention key bias's, are noise)."""
  assert jax.tree.structure(got) == jax.tree.structure(want)
  if not jax.tree.leaves(want):
    return
  a, b = np.asarray(ravel_pytree(got)[0]), np.asarray(ravel_pytree(want)[0])
  scale = max(1e-3, float(np.abs(b).max()))
  np.testing.assert_allclose(a / scale, b / scale, rtol=0, atol=tol)


def assert_close_dtype(got, want, dtype):
  """`assert_close_scaled` with the tolerances of ``dtype`` (see `TOL`)."""
  assert_close_scaled(got, want, **TOL[dtype])


# (mean, std) per channel. At 1e6 a float32 is good to 0.0625, so std 1e-2 would round to a
# constant: the 1e6 channels use std 1e-1 and 1.
OFFSET_CHANNELS = ((0.0, 1.0), (1e2, 1e-2), (1e2, 1.0), (1e4, 1e-2), (1e4, 1.0), (1e6, 1e-1),
                   (1e6, 1.0))
OFFSET_COUNTS, OFFSET_CAP = (13, 0, 3, 16, 1, 0, 2, 9), 16
EPS = 1e-10      # far below every variance here, so valid outputs have std 1, not ~0.95


def offset_data(channels=OFFSET_CHANNELS, counts=OFFSET_COUNTS, cap=OFFSET_CAP, dtype=np.float32,
                 seed=0):
  """``(x, mask)``: device ``d`` holds ``counts[d]`` valid rows, shifted by ``d/2`` std."""
  rng = np.random.default_rng(seed)
  mean, std = (np.array(v, np.float64) for v in zip(*channels))
  device = np.repeat(np.arange(len(counts)), cap)[:, None]
  x = (mean + std * (rng.normal(size=(len(counts) * cap, len(channels))) + 0.5 * device))
  mask = np.zeros((len(counts) * cap, 1), bool)
  for d, c in enumerate(counts):
    mask[d * cap:d * cap + c] = True
  return x.astype(dtype), mask


def exact_stats(x, mask, eps=EPS):
  """float64 mean, variance and normalised valid rows of the ALREADY-ROUNDED inputs."""
  xv = np.asarray(x[mask[:, 0]], np.float64)
  mean, var = xv.mean(0), xv.var(0)
  return mean, var, (xv - mean) / np.sqrt(var + eps)


def check_exact(x, mask, y, mean=None, var=None, *, var_rtol=1e-4, y_atol=1e-4):
  """Statistics and normalised valid outputs ``y`` (std 1 for ``EPS``) against `exact_stats`."""
  want_mean, want_var, want_y = exact_stats(x, mask)
  std = np.sqrt(want_var)
  if var is not None:
    np.testing.assert_allclose(var, want_var, rtol=var_rtol)
  if mean is not None:   # within one float32 ulp of the exact mean (plus 1e-5 std)
    ulp = np.spacing(np.abs(want_mean).astype(np.float32)).astype(np.float64)
    assert (np.abs(np.asarray(mean, np.float64) - want_mean) <= ulp + 1e-5 * std).all()
  yv = np.asarray(y, np.float64)[mask[:, 0]]
  np.testing.assert_allclose(yv, want_y, atol=y_atol)
  np.testing.assert_allclose(yv.mean(0), 0.0, atol=y_atol)
  np.testing.assert_allclose(yv.std(0), 1.0, atol=y_atol)


def unmasked_kernel_accesses(fn, *args):
  """Loads and stores inside the Pallas kernels of ``fn(*args)`` that carry no mask.

  Pallas' Triton lowering does not mask a partial last block: an unmasked access reads or
  writes past the end of the array on a GPU, while interpret mode (the CPU tests) pads
  silently. Returns ``[(primitive, ref shape)]``; accesses to one-element refs (a seed)
  are allowed.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from jax import tree_util  # pylint: disable=g-import-not-at-top

  found = []

  def kernel(jaxpr):
    for eqn in jaxpr.eqns:
      name = eqn.primitive.name
      shape = tuple(getattr(eqn.invars[0].aval, "shape", ())) if eqn.invars else ()
      if name in ("get", "swap"):
        masked = False
      elif name in ("masked_load", "masked_swap"):
        parts = tree_util.tree_unflatten(eqn.params["args_tree"], eqn.invars)
        masked = (parts[2] if name == "masked_load" else parts[3]) is not None
      else:
        masked = True
      if not masked and int(np.prod(shape)) > 1:
        found.append((name, shape))
      for sub in _subjaxprs(eqn):
        kernel(sub)

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call":
        kernel(eqn.params["jaxpr"])
      for sub in _subjaxprs(eqn):
        walk(sub)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


def _subjaxprs(eqn):
  for p in eqn.params.values():
    for v in (p if isinstance(p, (tuple, list)) else (p,)):
      if hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
        yield v.jaxpr
      elif hasattr(v, "eqns"):
        yield v


def torch_running_stats(batches, *, torch_momentum=0.1, unbiased=True):
  """PyTorch's documented BatchNorm update, in float64, over ``batches`` of valid values.

  ``running = (1 - m) * running + m * batch`` from mean 0, variance 1, with the batch
  variance times ``N / (N - 1)`` (``N`` the number of valid values per channel) when
  ``unbiased`` (PyTorch's rule); ``unbiased=False`` keeps the biased variance (Flax's).
  Each batch is ``[N, C]``: the valid values of a channel down a column.
  """
  m = torch_momentum
  c = np.shape(batches[0])[-1]
  mean, var = np.zeros(c), np.ones(c)
  for b in batches:
    b = np.asarray(b, np.float64)
    n = len(b)
    batch_var = b.var(0) * (n / (n - 1) if unbiased else 1.0)
    mean = (1 - m) * mean + m * b.mean(0)
    var = (1 - m) * var + m * batch_var
  return mean, var


def sharded_running_stats(models, batches, mask):
  """Running ``(mean, var)`` of linen BN-like ``models`` after one step per batch.

  The batches (``[8 * cap, ..., C]``) are split over 8 devices (mesh axis ``"d"``) with
  ``mask`` (valid rows); all models take one jitted step each, in one ``shard_map``.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
  variables = [m.init(jax.random.key(0), batches[0][:1], use_running_average=False)
               for m in models]

  def local(x, mask, variables):
    out = []
    for m, v in zip(models, variables):
      _, upd = m.apply(v, x, use_running_average=False, mask=mask, mutable=["batch_stats"])
      out.append({"params": v["params"], **upd})
    return out

  step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("d"), P("d"), P()),
                               out_specs=P()))
  put = lambda a: jax.device_put(a, NamedSharding(mesh, P("d")))
  for x in batches:
    variables = step(put(x), put(mask), variables)
  return [(np.asarray(v["batch_stats"]["mean"]), np.asarray(v["batch_stats"]["var"]))
          for v in variables]


def linear_fns():
  """`jmem.step.ModelFns` of a linear classifier on flattened inputs, 10 classes (compiles
  in a moment): for tests of the loop rather than of a model."""
  from jmem import step  # pylint: disable=g-import-not-at-top

  def init(key, x):
    return {"w": jax.random.normal(key, (x[0].size, 10)) * 0.01}, {}

  def apply(params, model_state, x, *, train, rng=None):
    del train, rng
    return x.reshape(x.shape[0], -1) @ params["w"], model_state
  return step.ModelFns(init, apply, None)
