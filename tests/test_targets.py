"""Memory targets: an H100's buffer assignment compiled for on this CPU machine, checked
against the real H100's figure for the same step, and every way a target can be refused."""

import functools
import importlib.metadata
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import jmem
from jmem import measure, models, train
from jmem.measure import targets

# jmem's ResNet-50 224² train step at batch 64, on an NVIDIA H100 80GB HBM3 (JAX 0.11.2,
# CUDA 13, 2026-11-27): compile().memory_analysis().temp_size_in_bytes
# (benchmarks/results/gpu/h100_2026-11-27_gpu_true_figures.md).
H100_RESNET50_B64_TEMP = 5_963_010_656


def _resnet50_step_as_measured_on_the_h100():
  """Exactly the step measured on the H100: NHWC, 1000 classes, float32, optax.adamw(1e-3),
  softmax cross-entropy of int32 labels, train=True with batch_stats mutable; parameters,
  optimiser state and batch statistics donated, (x, y) not."""
  model = models.create_model("resnet50", 1000)
  opt = optax.adamw(1e-3)

  def init():
    v = model.init(jax.random.key(0), jnp.zeros((1, 224, 224, 3)), train=False)
    return v["params"], v["batch_stats"], opt.init(v["params"])

  def step(params, batch_stats, opt_state, x, y):
    def loss(p):
      logits, upd = model.apply({"params": p, "batch_stats": batch_stats}, x, train=True,
                                mutable=["batch_stats"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), upd
    (value, upd), grads = jax.value_and_grad(loss, has_aux=True)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), upd["batch_stats"], opt_state, value

  state = jax.eval_shape(init)
  x = jax.ShapeDtypeStruct((64, 224, 224, 3), jnp.float32)
  y = jax.ShapeDtypeStruct((64,), jnp.int32)
  return jax.jit(step, donate_argnums=(0, 1, 2)), (*state, x, y)


@pytest.mark.slow
def test_h100_target_gives_the_real_h100s_temp_bytes_within_1_percent():
  step, args = _resnet50_step_as_measured_on_the_h100()
  h100 = measure.target("h100")
  memory = h100.memory(step, *args)
  assert abs(memory.temp_bytes / H100_RESNET50_B64_TEMP - 1) < 0.01, memory.temp_bytes
  # (XLA:CPU's figure for this step is far from it, 126.8 against 88.4 MiB per example: the
  # reason for targets; compiling it too would add a minute to the suite.)
  assert h100.deviceless and h100.platform == "gpu"
  assert h100.device_kind == "NVIDIA H100 80GB HBM3"
  assert h100.memory_limit == 76_516_687_872
  assert "H100 target" in h100.label and "without the device" in h100.label


class _CNN(nn.Module):
  """A plain linen CNN of two blocks (jmem.convert's default sites)."""

  @nn.compact
  def __call__(self, x, train=True):
    for width in (16, 32):
      x = _Block(width)(x)
    return nn.Dense(10)(x.mean((1, 2)))


class _Block(nn.Module):
  width: int

  @nn.compact
  def __call__(self, x):
    return nn.relu(nn.Conv(self.width, (3, 3))(nn.relu(nn.Conv(self.width, (3, 3))(x))))


def _small_step(model, batch, side=16):
  fns = train.model_fns(model)
  opt = train.default_optimizer(1e-3, 10)
  x = jax.ShapeDtypeStruct((batch, side, side, 3), jnp.float32)
  return fns, opt, train.abstract_state(fns, opt, x)


@pytest.mark.slow
def test_fit_step_on_the_h100_target_confirms_its_largest_batch():
  """A remat step (jmem.jit's XLA:CPU option would make XLA:GPU refuse it) fitted on the
  H100 target: the slope from batches 8 and 16, the largest batch in a small limit
  compiled, fitting, and one more over it."""
  model = jmem.convert(_CNN(), jmem.Remat())
  fns, opt, state = _small_step(model, 8)
  step = train.make_train_step(fns, opt, donate=True)
  spec = lambda b: (state, jax.ShapeDtypeStruct((b, 16, 16, 3), jnp.float32),
                    jax.ShapeDtypeStruct((b,), jnp.int32))
  probe = measure.fit_step(step, spec, target="h100", batch_sizes=(8, 16),
                           memory_limit=10**9)
  assert probe.target == "h100" and probe.per_example_temp_bytes > 0
  limit = int(probe.fixed_bytes + 40.5 * probe.per_example_bytes)
  fit = measure.fit_step(step, spec, target="h100", batch_sizes=(8, 16), memory_limit=limit)
  best = fit.max_batch[limit]
  assert best in fit.memory and fit.memory[best].total_bytes <= limit
  assert fit.memory[8].temp_bytes == fit.temp_bytes[0]
  over = measure.target("h100").memory(step, *spec(best + 1))
  assert over.total_bytes > limit, (best, over.total_bytes, limit)
  with pytest.raises(measure.TargetError, match="memory_limit"):
    measure.fit_step(step, spec, target=None)          # XLA:CPU has no limit of its own


@pytest.mark.slow
def test_the_h100_target_takes_the_kernels_a_gpu_takes():
  """The H100 target makes a GPU's automatic choice: for ActNN its XLA path (a step with the
  kernels was slower and bigger on an H100 and an H200), the Pallas (Triton) kernels where
  they are named; on the default backend (this CPU) the automatic choice is XLA."""
  h100 = measure.target("h100")
  texts = {}
  for name, on, implementation in (("h100", h100, None), ("pallas", h100, "pallas"),
                                   ("cpu", measure.target(), None)):
    model = jmem.convert(_CNN(), jmem.ActNN("L3", implementation=implementation))
    fns, opt, state = _small_step(model, 8)
    step = train.make_train_step(fns, opt)
    texts[name] = on.lower(step, state, jax.ShapeDtypeStruct((8, 16, 16, 3), jnp.float32),
                           jax.ShapeDtypeStruct((8,), jnp.int32)).as_text()
  # Each compressed residual: one quantize and one dequantize kernel.
  assert texts["pallas"].count("__gpu$xla.gpu.triton") >= 4
  assert "__gpu$xla.gpu.triton" not in texts["h100"] + texts["cpu"]


def test_a_deviceless_compile_without_triton_tiling_retries_with_cublas_and_says_so():
  """jaxlib 0.10.2's deviceless XLA:GPU finds no Triton tiling for some large products
  (the video ViT's at batch 128): the target compiles again with Triton's matrix products
  off and warns; any other error, or on a device, is raised as it is."""

  class Lowered:
    def __init__(self, message):
      self.message, self.calls = message, []

    def compile(self, compiler_options=None):
      self.calls.append(compiler_options)
      if compiler_options is None:
        raise RuntimeError(self.message)
      return "compiled"
  h100 = measure.target("h100")
  tiling = Lowered("INTERNAL: Couldn't find output tile sizes that satisfy hlo: %dot.1 = "
                   "f32[100352,384]{1,0} dot(%a, %b), metadata={...}")
  with pytest.warns(measure.TargetFallbackWarning, match="xla_gpu_enable_triton_gemm=False"):
    assert h100.compile_lowered(tiling) == "compiled"
  assert tiling.calls == [None, {"xla_gpu_enable_triton_gemm": False}]
  with pytest.raises(RuntimeError, match="out of memory"):
    h100.compile_lowered(Lowered("RESOURCE_EXHAUSTED: out of memory"))
  with pytest.raises(RuntimeError, match="output tile sizes"):
    measure.target().compile_lowered(Lowered("Couldn't find output tile sizes"))


def test_unknown_target_and_bad_spec_files_are_refused(tmp_path):
  with pytest.raises(measure.TargetError, match="Unknown target 'b9000'.*h100"):
    measure.target("b9000")
  with pytest.raises(measure.TargetError, match="No GPU spec file"):
    measure.target(str(tmp_path / "missing.txtpb"))
  shipped = os.path.join(os.path.dirname(targets.__file__), "specs", "h100_sxm.txtpb")
  with open(shipped) as f:
    text = f.read()
  bad = tmp_path / "bad.txtpb"        # a field this jaxlib does not know (as a newer file's)
  bad.write_text(text.replace("gpu_device_info {", "gpu_device_info {\n  warp_drive: 9", 1))
  with pytest.raises(measure.TargetError, match="could not use the GPU spec file.*delete"):
    measure.target(str(bad))
  # A file that parses but describes no GPU: XLA took it and then crashed Python in a
  # compile (a floating point exception); refused before.
  for name, content in (("empty.txtpb", ""), ("no_memory.txtpb",
                                               text.replace("device_memory_size", "# was"))):
    (tmp_path / name).write_text(content)
    with pytest.raises(measure.TargetError, match="does not describe a GPU: it has no "
                       + ("gpu_device_info" if not content else "device_memory_size")):
      measure.target(str(tmp_path / name))
  with pytest.raises(measure.TargetError, match="memory_limit"):
    measure.target("h100", memory_limit=0)


def test_a_spec_file_by_path_is_a_target(tmp_path):
  """The shipped H100 file given by path: the same device, its limit 0.9 of the file's
  device_memory_size."""
  path = os.path.join(os.path.dirname(targets.__file__), "specs", "h100_sxm.txtpb")
  t = measure.target(path)
  assert t.deviceless and t.device_kind == "NVIDIA H100 80GB HBM3"
  assert t.memory_limit == int(84_942_979_072 * 0.9)


def test_missing_or_mismatched_plugin_says_what_to_install(monkeypatch):
  real = importlib.metadata.version

  def without_plugin(name):
    if name.startswith("jax-cuda"):
      raise importlib.metadata.PackageNotFoundError(name)
    return real(name)
  monkeypatch.setattr(importlib.metadata, "version", without_plugin)
  with pytest.raises(measure.TargetError, match=r"pip install 'jmem\[gpu-target\]'"):
    measure.target("h100")

  def other_version(name):
    return "0.0.1" if name.startswith("jax-cuda") else real(name)
  monkeypatch.setattr(importlib.metadata, "version", other_version)
  import jaxlib  # pylint: disable=g-import-not-at-top
  with pytest.raises(measure.TargetError,
                     match=f"exactly the installed jaxlib's version, {jaxlib.__version__}.*"
                           f"jax-cuda12-plugin=={jaxlib.__version__}"):
    measure.target("h100")


def test_a_jaxlib_other_than_the_pinned_one_is_refused(monkeypatch):
  """The target's figures are checked against the H100 for one compiler; another jaxlib is
  refused with the extra's pip line, or taken as it is when the environment says so."""
  assert measure.PINNED_JAXLIB == targets._jaxlib_version()  # CI installs the extra's pin
  with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml")) as f:
    assert f'"jaxlib=={measure.PINNED_JAXLIB}"' in f.read()
  monkeypatch.setattr(targets, "_jaxlib_version", lambda: "0.9.0")
  monkeypatch.delenv("JMEM_TARGET_ANY_JAXLIB", raising=False)
  with pytest.raises(measure.TargetError,
                     match=rf"jaxlib {measure.PINNED_JAXLIB} only.*jaxlib 0\.9\.0.*"
                           r"pip install 'jmem\[gpu-target\]'.*JMEM_TARGET_ANY_JAXLIB=1"):
    measure.target("h100")
  monkeypatch.setenv("JMEM_TARGET_ANY_JAXLIB", "1")
  # Past the pin, the plugin check still holds: jax-cuda12-plugin is at the real jaxlib's.
  with pytest.raises(measure.TargetError, match="exactly the installed jaxlib's version, 0.9.0"):
    measure.target("h100")


def test_a_cuda13_plugin_gets_its_own_pip_line(monkeypatch):
  real = importlib.metadata.version

  def cuda13_only(name):
    if name == "jax-cuda13-plugin":
      return "0.0.1"
    if name.startswith("jax-cuda"):
      raise importlib.metadata.PackageNotFoundError(name)
    return real(name)
  monkeypatch.setattr(importlib.metadata, "version", cuda13_only)
  with pytest.raises(measure.TargetError,
                     match=rf"pip install jax-cuda13-plugin=={measure.PINNED_JAXLIB} "
                           r"nvidia-cuda-nvcc \("):
    measure.target("h100")


def test_a_gpu_target_needs_jax_platforms_cpu():
  """In a process whose JAX platforms are not just cpu, the target says how to fix it (the
  CUDA plugin would try to open a GPU), and the command line sets them itself."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  code = ("import jax, jmem\n"
          "try:\n  jmem.measure.target('h100')\n"
          "except jmem.measure.TargetError as e:\n  print('REFUSED', e)\n")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
  assert "REFUSED" in out.stdout and "JAX_PLATFORMS=cpu" in out.stdout, out.stdout + out.stderr


def test_jit_lowered_for_a_target_gets_that_platforms_options():
  """`jmem.jit` adds XLA:CPU's option on the CPU and none for the GPU target (XLA:GPU
  refuses it); called, it runs on the default backend."""
  f = measure.jit(lambda x: jnp.sin(x) * 2)
  x = jnp.ones(4)
  assert float(f(x)[0]) == pytest.approx(2 * jnp.sin(1.0))
  cpu = f.lower(x).compile()
  gpu = measure.target("h100").compile(f, x)
  assert measure.platform_of(cpu) == "cpu" and measure.platform_of(gpu) == "gpu"
  assert measure.xla_compiler_options("gpu") == {}


@functools.lru_cache(maxsize=None)
def _cli(*argv):
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  return subprocess.run([sys.executable, "-m", "jmem.cli", *argv], env=env,
                        capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_cli_refuses_what_a_target_cannot_do():
  out = _cli("plan", "--model", "resnet8", "--image-size", "16", "--batch-size", "8",
             "--target", "h100", "--verify-steps", "5")
  assert out.returncode == 2 and "--verify-steps cannot go with it" in out.stderr, out.stderr
  # One device is what the target compiles for: --mesh 1 is no layout to refuse; 2x1x1 is.
  out = _cli("plan", "--model", "resnet8", "--image-size", "16", "--batch-size", "8",
             "--target", "h100", "--mesh", "1", "--verify-steps", "5")
  assert out.returncode == 2 and " --verify-steps cannot go with it" in out.stderr and \
      "--mesh" not in out.stderr, out.stderr
  out = _cli("plan", "--model", "resnet8", "--image-size", "16", "--batch-size", "8",
             "--target", "h100", "--mesh", "2x1x1")
  assert out.returncode == 2 and "--mesh cannot go with it" in out.stderr, out.stderr
  out = _cli("bench", "--target", "tpu9", "--memory-only")
  assert out.returncode == 2 and "Unknown target 'tpu9'" in out.stderr, out.stderr


@pytest.mark.slow
def test_a_plain_linen_model_has_another_peak_on_the_h100_than_on_xla_cpu():
  """What the targets are for: one step, two buffer assignments."""
  fns, opt, state = _small_step(_CNN(), 32, side=32)
  step = train.make_train_step(fns, opt)
  x = jax.ShapeDtypeStruct((32, 32, 32, 3), jnp.float32)
  y = jax.ShapeDtypeStruct((32,), jnp.int32)
  on_gpu = measure.target("h100").memory(step, state, x, y).temp_bytes
  on_cpu = measure.target().memory(step, state, x, y).temp_bytes
  assert on_gpu > 0 and on_cpu > 0 and on_gpu != on_cpu


@pytest.mark.slow
def test_a_plan_for_the_h100_steers_by_its_estimated_step_time():
  """`jmem.plan(target="h100")`: every step it compiles is timed by the H100 step-time
  estimate, the plan's sites are saved or at 2 bits (8 and 4 cost more on a GPU), and the
  plan, which fits, is estimated no slower than 2 bits at every site."""
  model = models.create_model("resnet8", 10)
  x = jax.ShapeDtypeStruct((128, 16, 16, 1), jnp.float32)
  y = jax.ShapeDtypeStruct((128,), jnp.int32)
  plan = jmem.plan(model, (x, y), "60%", target="h100", max_batch=False, max_compiles=5)
  assert plan.objective == "estimated step time" and plan.fits, plan.table()
  assert plan.seconds > 0 and plan.exact_seconds > 0 and plan.measured_seconds
  assert all(s is not None and s > 0 for s in plan.measured_seconds)
  assert {c.label for c in plan.choices} <= {"save", "compress 2-bit"}, plan.table()
  assert "Estimated step time" in plan.table()
  on = measure.target("h100")
  everywhere = jmem.convert(model, jmem.Policy("compress", bits=2))
  step, args = jmem.planner._train_step(everywhere, train.default_optimizer(1e-3, 100), x, y)  # pylint: disable=protected-access
  lowered = on.lower(step, *args)
  compiled = on.compile_lowered(lowered)
  flops = measure.step_flops(compiled, lowered)        # as the plan's steps count them
  uniform = measure.estimate_step_time(compiled, flops).seconds
  assert plan.seconds <= uniform, (plan.seconds, uniform, plan.table())
