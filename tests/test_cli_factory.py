"""`jmem train`, `jmem plan` and `jmem bench` on the user's own model: ``--model
module:factory`` or ``--model path/to/file.py:factory``, with ``--input-shape H,W,C``."""

import json
import re
import textwrap

import pytest

from jmem import bench, cli

# A tiny linen CNN whose blocks are submodules (the planner's sites), an NNX one, and
# factories that go wrong in each way the CLI must explain.
_MODELS = '''
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx


class Block(nn.Module):
  features: int

  @nn.compact
  def __call__(self, x):
    y = nn.relu(nn.Conv(self.features, (3, 3))(x))
    return nn.relu(nn.Conv(self.features, (3, 3))(y)) + x


class Net(nn.Module):
  num_classes: int = 10
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = nn.Conv(8, (3, 3), dtype=self.dtype)(x)
    x = Block(8)(Block(8)(x))
    return nn.Dense(self.num_classes, dtype=self.dtype)(x.mean(axis=(1, 2)))


class Flat(nn.Module):
  """Takes exactly 12 x 10 x 3 images (a Dense over the flattened pixels)."""
  num_classes: int = 10

  @nn.compact
  def __call__(self, x):
    assert x.shape[1:] == (12, 10, 3), x.shape
    return nn.Dense(self.num_classes)(x.reshape(len(x), -1))


class NNXNet(nnx.Module):

  def __init__(self, num_classes, *, rngs):
    self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
    self.head = nnx.Linear(4, num_classes, rngs=rngs)

  def __call__(self, x):
    return self.head(nnx.relu(self.conv(x)).mean(axis=(1, 2)))


def make_net(num_classes):
  return Net(num_classes)


def make_flat():
  return Flat()


def make_nnx(num_classes, rngs):
  return NNXNet(num_classes, rngs=rngs)


def not_a_module(num_classes):
  return lambda x: x


def seven_classes():
  return Net(7)


def per_pixel(num_classes):
  return nn.Conv(num_classes, (1, 1))


def needs_width(width, num_classes):
  return Net(num_classes)


def raises(num_classes):
  raise RuntimeError("no weights here")


the_class = Net
'''


@pytest.fixture(name="models_file")
def _models_file(tmp_path):
  path = tmp_path / "user_models.py"
  path.write_text(textwrap.dedent(_MODELS))
  return path


def _run(argv, capsys):
  """``(exit code, stdout, stderr)`` of ``jmem *argv``."""
  try:
    code = cli.main(argv)
  except SystemExit as e:
    code = e.code
  out = capsys.readouterr()
  return code, out.out, out.err


@pytest.mark.slow
def test_plan_takes_a_factory_in_a_file(models_file, tmp_path, capsys):
  code, out, err = _run(["plan", "--model", f"{models_file}:make_net", "--input-shape",
                         "16,12,3", "--batch-size", "8", "--budget", "60%", "--bits", "8",
                         "--max-compiles", "3", "--verify-steps", "1", "--json",
                         "--output-dir", str(tmp_path / "out")], capsys)
  assert code == 0, err
  plan = json.loads(out)
  assert plan["fits"] and plan["device_bytes"] < 0.6 * plan["exact_device_bytes"]
  assert {c["path"] for c in plan["choices"]} >= {"Block_0", "Block_1"}
  assert plan["verify"]["input_shape"] == [16, 12, 3]       # trained at the plan's shape
  assert set(plan["verify"]["accuracy"]) == {"exact", "plan"}


@pytest.mark.slow
def test_train_takes_a_package_factory_and_a_technique(models_file, capsys, monkeypatch):
  monkeypatch.syspath_prepend(str(models_file.parent))
  code, out, err = _run(["train", "--model", "user_models:make_net", "--technique", "remat",
                         "--steps", "2", "--batch-size", "8", "--image-size", "8",
                         "--no-progress"], capsys)
  assert code == 0, err
  assert "test accuracy" in out


@pytest.mark.slow
def test_train_and_bench_take_the_input_shape(models_file, tmp_path, capsys):
  spec = f"{models_file}:make_flat"                # 12 x 10 x 3 images only
  code, out, err = _run(["train", "--model", spec, "--input-shape", "12,10,3", "--steps", "2",
                         "--batch-size", "8", "--no-progress"], capsys)
  assert code == 0, err
  assert "test accuracy" in out
  ds = bench.make_dataset(spec, 12, input_shape=(12, 10, 3))
  assert ds.x_train.shape[1:] == (12, 10, 3) and ds.num_classes == 10
  assert (ds.x_train[..., 0] == ds.x_train[..., 2]).all()    # the gray, repeated
  code, out, err = _run(["bench", "--model", spec, "--input-shape", "12,10,3", "--memory-only",
                         "--techniques", "exact", "--batch-size", "4", "--budgets", "",
                         "--json", "--output-dir", str(tmp_path / "out")], capsys)
  assert code == 0, err
  assert json.loads(out)[0]["input_shape"] == [12, 10, 3]


@pytest.mark.slow
def test_an_nnx_factory_trains_and_benches(models_file, tmp_path, capsys):
  spec = f"{models_file}:make_nnx"
  code, out, err = _run(["train", "--model", spec, "--steps", "2", "--batch-size", "8",
                         "--image-size", "8", "--no-progress"], capsys)
  assert code == 0, err
  assert "test accuracy" in out
  code, out, err = _run(["bench", "--model", spec, "--memory-only", "--techniques", "exact",
                         "--batch-size", "4", "--image-size", "8", "--budgets", "", "--json",
                         "--output-dir", str(tmp_path / "out")], capsys)
  assert code == 0, err
  exact, = json.loads(out)
  assert exact["model"] == spec and exact["temp_bytes"] > 0


def test_the_calling_convention(models_file):
  spec = f"{models_file}:make_net"
  model = bench.create_model(spec, 3, "bfloat16")        # no dtype=: the field is cloned
  assert model.num_classes == 3 and model.dtype == "bfloat16"
  assert bench.create_model(f"{models_file}:Net", 4).num_classes == 4   # a class is a factory
  assert bench.load_factory(spec) is bench.load_factory(spec)          # imported once


ALL, TRAIN = ("train", "plan", "bench"), ("train",)   # one command where the path is shared

# (--model, more flags, the error's pattern, the commands that check it)
_BAD = [
    ("no_such_pkg_xyz.models:make", [], "no module named 'no_such_pkg_xyz' on the Python "
     "path", ALL),
    ("{dir}/missing.py:make", [], "there is no file", TRAIN),
    ("{file}:make_cnn", [], "has no attribute 'make_cnn'; its callables: .*make_net", ALL),
    ("{file}:the_clas", [], "its callables: Block, Flat, NNXNet, Net", TRAIN),
    ("{file}:not_a_module", [], r"not_a_module\(num_classes=10\) returned a function; "
     "expected a flax.linen.Module or a flax.nnx.Module", ALL),
    ("{file}:the_class.num_classes", [], r"is not callable \(type int\)", TRAIN),
    ("{file}:seven_classes", [], r"returns float32\[2, 7\] .*expected float logits of "
     r"shape \[batch, 10\]", ALL),
    ("{file}:per_pixel", [], r"returns float32\[2, 8, 8, 10\]", TRAIN),
    ("{file}:make_flat", [], r"fails on a float32 batch of shape \(2, 8, 8, 1\).*"
     "--input-shape H,W,C", ALL),
    ("{file}:needs_width", [], "needs width, which jmem cannot give", TRAIN),
    ("{file}:raises", [], r"raises\(num_classes=10\) raised RuntimeError: no weights here",
     TRAIN),
    ("{file}:make_nnx", ["--dtype", "bfloat16"], "takes no dtype= and its model has no "
     "dtype field", ALL),
    ("{file}:make_net", ["--input-shape", "8,8"], "expected H,W,C", ALL),
    ("{file}:make_net", ["--input-shape", "8,8,1", "--image-size", "8"], "give one", ALL),
    ("unet", ["--input-shape", "16,16,1"], "is a segmentation model", TRAIN),
]


@pytest.mark.parametrize("command, model, extra, message", [
    (command, model, extra, message) for model, extra, message, commands in _BAD
    for command in commands])
def test_bad_models_exit_2_with_one_line(models_file, tmp_path, capsys, command, model,
                                         extra, message):
  model = model.format(file=models_file, dir=models_file.parent)
  size = [] if "--input-shape" in extra else ["--image-size", "8"]
  argv = [command, "--model", model, "--batch-size", "4"] + size + extra + {
      "train": ["--steps", "1", "--no-progress"],
      "plan": ["--budget", "60%", "--output-dir", str(tmp_path / "out")],
      "bench": ["--memory-only", "--techniques", "exact", "--output-dir",
                str(tmp_path / "out")]}[command]
  code, _, err = _run(argv, capsys)
  assert code == 2, err
  lines = err.strip().splitlines()
  assert len(lines) == 1 or lines[0].startswith("usage:"), err    # argparse's: with usage
  assert lines[-1].startswith(f"jmem {command}: error: "), err
  assert re.search(message, lines[-1]), lines[-1]


def test_registered_names_still_work(capsys):
  assert not bench.is_factory("resnet8")
  code, _, err = _run(["train", "--model", "nope"], capsys)
  assert code == 2 and "or your own as module:factory" in err, err
