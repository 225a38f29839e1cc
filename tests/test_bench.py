"""`jmem bench` and `jmem train`: rows, files, registry and clear errors."""

import contextlib
import dataclasses
import functools
import io
import json
import re
import os
import shutil

import jax
import pytest

from jmem import bench, cli


@pytest.mark.slow
def test_memory_only_rows_and_remat_saves():
  budget = 0.0625                                                   # 64 MiB
  rows = bench.run_bench(bench.BenchConfig(model="resnet8", batch_size=16, image_size=8,
                                           memory_only=True, budgets_gib=(budget,)), quiet=True)
  assert [r["technique"] for r in rows] == ["exact", "remat"]
  exact, remat = rows
  assert remat["saved_bytes"] < 0.5 * exact["saved_bytes"]
  assert remat["temp_bytes"] < exact["temp_bytes"]
  assert remat["baseline_saved_bytes"] == exact["saved_bytes"]
  assert remat["accuracy"] is None and remat["step_time_ratio"] is None
  # The largest batch leads: remat fits more examples into the same 64 MiB, at more FLOPs.
  key = "0.0625GiB"
  assert 16 < exact["max_batch"][key] < remat["max_batch"][key]
  assert remat["max_batch_ratio"] == pytest.approx(
      exact["per_example_temp_bytes"] / remat["per_example_temp_bytes"])
  assert remat["max_batch_ratio"] > 1.5 and exact["max_batch_ratio"] == 1.0
  assert remat["flops_ratio"] > 1.0 and exact["fixed_bytes"] > 0
  # The largest batch fits its budget (compiled again here), twice it does not, and the
  # line's next batch would not either.
  fns, opt, x, y = _bench_problem("resnet8", exact["max_batch"][key])
  fit = bench.batch_fit(fns, opt, x, y, ())
  assert fit.device_bytes[0] <= budget * 2**30 < fit.device_bytes[1]
  assert fit.fixed_bytes + fit.per_example_bytes * (exact["max_batch"][key] + 1) > \
      budget * 2**30 * 0.99
  assert "max batch 0.0625GiB" in bench.format_table(rows).splitlines()[0]



@pytest.mark.slow
def test_memory_only_in_bfloat16_against_exact_in_bfloat16():
  config = dict(model="resnet8", batch_size=8, image_size=8, memory_only=True, budgets_gib=())
  f32 = bench.run_bench(bench.BenchConfig(**config, techniques=()), quiet=True)
  bf16 = bench.run_bench(bench.BenchConfig(**config, techniques=("actnn-L2",),
                                           dtype="bfloat16"), quiet=True)
  assert [r["dtype"] for r in bf16] == ["bfloat16"] * 2
  # Convolution inputs are bfloat16 now (flax's BatchNorm keeps its statistics and
  # normalised values in float32, so not every residual halves). L2's 4-bit convolution
  # and BatchNorm inputs, and the 1-bit masks of the ReLUs between them
  # (`jmem.ops.actnn.between`), keep 0.115 of bf16 exact's residual bytes.
  assert bf16[0]["saved_bytes"] < 0.9 * f32[0]["saved_bytes"]
  assert 0.05 < bf16[1]["saved_ratio"] < 0.25
  assert "resnet8 (bfloat16)" in bench.format_table(bf16)
  bench.BenchConfig(model="video-vit", dtype="bfloat16").validate()   # every model has one
  assert cli.main(TRAIN + ["--dtype", "bfloat16"]) == 0
  with pytest.raises(ValueError, match="Unknown compute dtype"):
    bench.BenchConfig(dtype="float16").validate()


def _bench_problem(model, batch):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jmem import models, train  # pylint: disable=g-import-not-at-top
  fns = train.model_fns(models.create_model(model, 10))
  opt = train.default_optimizer(3e-3, 300)
  return (fns, opt, jax.ShapeDtypeStruct((batch, 8, 8, 1), jnp.float32),
          jax.ShapeDtypeStruct((batch,), jnp.int32))


@pytest.mark.slow
def test_cli_bench_json_and_files(tmp_path, capsys):
  out = tmp_path / "res"
  # exact alone: the rows of other techniques are trained in the video bench test and
  # measured in the memory-only one; here the CLI's JSON, files and seeds.
  rc = cli.main(["bench", "--model", "resnet8", "--steps", "3", "--batch-size", "16",
                 "--image-size", "8", "--seeds", "0,1", "--json", "--no-progress",
                 "--techniques", "exact", "--budgets", "", "--output-dir", str(out)])
  assert rc == 0
  rows = json.loads(capsys.readouterr().out)
  required = {"technique", "model", "saved_bytes", "temp_bytes", "baseline_saved_bytes",
              "baseline_temp_bytes", "step_time_ratio", "accuracy"}
  for row in rows:
    assert required <= set(row) and row["max_batch"] == {}
    assert 0.0 <= row["accuracy"] <= 1.0 and len(row["accuracy_per_seed"]) == 2
    assert row["step_time_ratio"] > 0
  assert [r["technique"] for r in rows] == ["exact"] and rows[0]["step_time_ratio"] == 1.0
  for name in ("bench.json", "bench.md", "bench_memory.png"):
    assert (out / name).stat().st_size > 0


TRAIN = ["train", "--model", "resnet8", "--image-size", "8", "--batch-size", "16",
         "--steps", "2", "--no-progress"]
BENCH = ["bench", "--model", "resnet8", "--image-size", "8", "--batch-size", "16",
         "--steps", "1", "--no-progress", "--output-dir", "{tmp}/out"]

# (flags that replace or extend TRAIN / BENCH, fragments the error message must contain).
# Every error is found before a step is compiled.
BAD_FLAGS = {
    "train-lr-nan": (TRAIN + ["--learning-rate", "nan"], ["learning_rate", "nan", "> 0"]),
    "train-lr-inf": (TRAIN + ["--learning-rate", "inf"], ["learning_rate", "inf"]),
    "train-lr-zero": (TRAIN + ["--learning-rate", "0"], ["learning_rate", "> 0"]),
    "train-lr-negative": (TRAIN + ["--learning-rate=-1e-3"], ["learning_rate", "-0.001"]),
    "bench-lr-nan": (BENCH + ["--learning-rate", "nan"], ["learning_rate", "nan"]),
    "train-batch-0": (TRAIN + ["--batch-size", "0"], ["batch_size 0", "--batch-size"]),
    "train-batch-too-big": (TRAIN + ["--batch-size", "5000"], ["batch_size 5000", "1438"]),
    "bench-batch-0": (BENCH + ["--batch-size", "0"], ["batch_size", "got 0"]),
    "bench-budget-negative": (BENCH + ["--budgets", "16,-1"], ["budgets", "positive", "-1"]),
    "bench-budget-word": (BENCH + ["--budgets", "lots"], ["budgets", "16,80", "'lots'"]),
    "plan-budget-zero": (["plan", "--budget", "0GiB"], ["budget", "'0GiB'", "more than 0"]),
    "train-seed-negative": (TRAIN + ["--seed", "-1"], ["seed", "--seed", "-1"]),
    "train-checkpoint-every-alone": (TRAIN + ["--checkpoint-every", "5"],
                                     ["--checkpoint-every 5", "--checkpoint-dir"]),
    "train-image-huge": (["train", "--image-size", "100000"], ["100000x100000", "GiB",
                                                                "--image-size"]),
    "bench-batch-too-big": (BENCH + ["--batch-size", "5000"], ["larger than", "--batch-size"]),
    "train-steps-negative": (TRAIN + ["--steps", "-3"], ["steps", "-3"]),
    "bench-steps-negative": (BENCH + ["--steps", "-3"], ["steps", "-3"]),
    "train-image-0": (TRAIN + ["--image-size", "0"], ["image_size", "got 0"]),
    "train-image-too-small": (TRAIN + ["--model", "convnext-digits", "--image-size", "1"],
                              ["at least 2x2", "got 1x1", "--image-size 2"]),
    "bench-image-too-small": (BENCH + ["--model", "convnext-t", "--memory-only"],
                              ["at least 32x32", "got 8x8"]),
    "train-video-too-small": (TRAIN + ["--model", "stt-resnet8", "--image-size", "16"],
                              ["too small", "16 frames", "--image-size 22"]),
    "train-unknown-model": (TRAIN + ["--model", "vgg"], ["'vgg'", "resnet20"]),
    "bench-unknown-model": (BENCH + ["--model", "vgg"], ["'vgg'", "resnet20"]),
    "train-unknown-technique": (TRAIN + ["--technique", "magic"], ["'magic'", "remat"]),
    "bench-unknown-technique": (BENCH + ["--techniques", "exact,magic"], ["'magic'", "remat"]),
    "train-technique-needs-other-model": (TRAIN + ["--technique", "sbp-0.5"],
                                          ["sbp-0.5", "video model"]),
    "train-eval-every-negative": (TRAIN + ["--eval-every", "-1"], ["eval_every", "-1"]),
    "train-checkpoint-every-0": (TRAIN + ["--checkpoint-every", "0", "--checkpoint-dir",
                                          "{tmp}/ckpt"], ["checkpoint_every"]),
    "train-unwritable-checkpoint-dir": (TRAIN + ["--checkpoint-dir", "{tmp}/file/ckpt"],
                                        ["checkpoint directory", "{tmp}/file/ckpt"]),
    "bench-unwritable-output-dir": (BENCH + ["--output-dir", "{tmp}/file/out"],
                                    ["{tmp}/file/out", "--output-dir"]),
    "train-resume-without-dir": (TRAIN + ["--resume"], ["checkpoint_dir"]),
    "train-resume-missing-dir": (TRAIN + ["--resume", "--checkpoint-dir", "{tmp}/missing"],
                                 ["{tmp}/missing", "does not exist", "without --resume"]),
    "train-resume-empty-dir": (TRAIN + ["--resume", "--checkpoint-dir", "{tmp}/empty"],
                               ["no checkpoint in", "{tmp}/empty", "without --resume"]),
    # {ckpt}: the checkpoints of TRAIN (steps 1 and 2); {broken}: a copy, both truncated
    # (one truncated step is resumed past: test_train's corrupted-checkpoint test).
    "train-fresh-over-checkpoints": (TRAIN + ["--checkpoint-dir", "{ckpt}"],
                                     ["already holds checkpoints (steps 1, 2)", "--resume"]),
    "train-resume-truncated": (TRAIN + ["--resume", "--checkpoint-dir", "{broken}"],
                               ["{broken}", "no checkpoint in it verifies",
                                "step 2: unreadable, perhaps truncated", "; step 1: unreadable",
                                "without --resume"]),
    "train-resume-other-model": (TRAIN + ["--resume", "--checkpoint-dir", "{ckpt}",
                                          "--model", "resnet20"],
                                 ["different run", "model: 'resnet8' there, 'resnet20' now"]),
    "train-resume-other-technique": (TRAIN + ["--resume", "--checkpoint-dir", "{ckpt}",
                                              "--technique", "remat"],
                                     ["technique: 'exact' there, 'remat' now"]),
    "train-resume-other-image-size": (TRAIN + ["--resume", "--checkpoint-dir", "{ckpt}",
                                               "--image-size", "16"],
                                      ["image_size: 8 there, 16 now"]),
    "train-resume-other-batch-size": (TRAIN + ["--resume", "--checkpoint-dir", "{ckpt}",
                                               "--batch-size", "8"],
                                      ["batch_size: 16 there, 8 now"]),
    "train-resume-other-learning-rate": (TRAIN + ["--resume", "--checkpoint-dir", "{ckpt}",
                                                  "--learning-rate", "0.1"],
                                         ["learning_rate: 0.003 there, 0.1 now"]),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """``(directory, stdout)`` of one short `TRAIN` run saving every step."""
  ckpt = str(tmp_path_factory.mktemp("trained") / "ckpt")
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    assert cli.main(TRAIN + ["--checkpoint-every", "1", "--checkpoint-dir", ckpt]) == 0
  return ckpt, out.getvalue()


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAD_FLAGS))
def test_cli_bad_flags_exit_2_with_a_clear_message(case, tmp_path, capsys, request):
  """Each bad flag: exit status 2 (as argparse's own errors), one line naming the problem."""
  (tmp_path / "file").write_text("not a directory")
  (tmp_path / "empty").mkdir()
  argv, fragments = BAD_FLAGS[case]
  paths = {"{tmp}": str(tmp_path)}
  if any("{ckpt}" in a or "{broken}" in a for a in argv):
    paths["{ckpt}"] = request.getfixturevalue("checkpoint")[0]
    paths["{broken}"] = str(tmp_path / "broken")
    shutil.copytree(paths["{ckpt}"], paths["{broken}"])
    for f in (tmp_path / "broken").glob("*/state/**/*"):
      if f.is_file():
        os.truncate(f, f.stat().st_size // 2)
  fill = lambda text: functools.reduce(lambda t, kv: t.replace(*kv), paths.items(), text)
  argv = [fill(a) for a in argv]
  with pytest.raises(SystemExit) as e:
    cli.main(argv)
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "Traceback" not in err, err
  assert err.splitlines()[-1].startswith(f"jmem {argv[0]}: error: "), err
  for fragment in fragments:
    assert fill(fragment) in err, (fragment, err)


@pytest.mark.slow
def test_registry_one_registration_adds_a_bench_row(monkeypatch):
  from jmem import techniques  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match="already registered"):
    bench.register_technique(bench.Technique("exact", lambda implementation: None))
  # A registry of this test's own: the name must not reach later tests in this worker
  # (benchmarks/gpu.py's test lists every registered name).
  monkeypatch.setattr(techniques, "_TECHNIQUES", dict(techniques._TECHNIQUES))
  name = "test-identity"
  bench.register_technique(bench.Technique(name, lambda implementation: None,
                                           "same as exact"))
  rows = bench.run_bench(bench.BenchConfig(model="resnet8", techniques=(name,), batch_size=8,
                                           image_size=8, memory_only=True, budgets_gib=()),
                         quiet=True)
  assert rows[1]["technique"] == name and rows[1]["saved_ratio"] == 1.0


@pytest.mark.slow
def test_actnn_l3_technique_calibrates_bits_before_measuring():
  import jax
  import jax.numpy as jnp
  import optax
  from jmem import models, train
  import jmem
  assert bench.get_technique("actnn-L3").calibrate
  rows = bench.run_bench(bench.BenchConfig(model="resnet8", techniques=("actnn-L3",),
                                           batch_size=8, image_size=8, memory_only=True,
                                           budgets_gib=()),
                         quiet=True)
  uniform = jmem.convert(models.create_model("resnet8", 10), jmem.ActNN("L3"))
  saved, _ = bench.step_memory(train.model_fns(uniform), optax.sgd(0.1),
                               jax.ShapeDtypeStruct((8, 8, 8, 1), jnp.float32),
                               jax.ShapeDtypeStruct((8,), jnp.int32))
  # Per-layer widths change the layout but not the 2-bit budget.
  assert rows[1]["saved_bytes"] != saved and rows[1]["saved_bytes"] <= 1.02 * saved
  assert rows[1]["saved_ratio"] < 1 / 8, rows[1]


@pytest.mark.slow
def test_cli_train_resume(checkpoint, tmp_path, capsys):
  ckpt, first = checkpoint
  copy = str(tmp_path / "ckpt")
  shutil.copytree(ckpt, copy)
  assert cli.main(TRAIN + ["--checkpoint-dir", copy, "--resume"]) == 0   # resumes at the end
  second = capsys.readouterr().out
  assert "resumed from step 2" in second
  assert first.splitlines()[-1] == second.splitlines()[-1]   # same final accuracy


@pytest.mark.parametrize("command", ["bench", "plan", "train"])
def test_every_subcommand_prints_its_help(command, capsys):
  """argparse formats help with ``%``: a registered name such as ``plan-50%`` in a help
  text made ``jmem bench --help`` raise instead of printing."""
  with pytest.raises(SystemExit) as exit_:
    cli.main([command, "--help"])
  assert exit_.value.code == 0
  out = capsys.readouterr().out
  assert out.startswith(f"usage: jmem {command}") and (
      command == "plan" or "plan-50%" in out), out


@pytest.mark.slow
def test_the_unet_is_registered_with_a_label_per_pixel(capsys, monkeypatch):
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jmem import data, models, planner, train
  assert "unet" in models.MODEL_NAMES and models.model_task("unet") == "segmentation"
  ds = bench.make_dataset("unet", 16)
  assert ds.num_classes == 11 and ds.y_train.shape == (len(ds.x_train), 16, 16)
  # A side the poolings do not divide: the error names the sides, not a batch it was traced at.
  with pytest.raises(ValueError, match="H and W divisible by 16 .4 poolings.; got H x W 30 x 32"):
    models.UNet(11).init(jax.random.key(0), jnp.zeros((1, 30, 32, 1)))
  ink = ds.x_train[..., 0] > 1.0                    # a digit's label on its ink, else 10
  digit = data.digits(16).y_train[:, None, None]
  assert np.array_equal(ds.y_train, np.where(ink, digit, 10)) and 0.05 < ink.mean() < 0.5
  # jmem train: pixel accuracy over the test set, here its first 16 images (the U-Net's
  # 3x3 convolutions of 1x1 and 2x2 maps run as XLA:CPU's own loops, which at the tests'
  # -O0 took 37 s over the whole set).
  make, evaluate, evaluated = bench.make_dataset, train.evaluate, []
  with monkeypatch.context() as patch:
    patch.setattr(bench, "make_dataset", lambda *a, **k: dataclasses.replace(
        make(*a, **k), x_test=ds.x_test[:16], y_test=ds.y_test[:16]))
    patch.setattr(train, "evaluate", lambda fns, state, x, y, **k: evaluated.append(
        np.shape(y)) or evaluate(fns, state, x, y, **k))
    assert cli.main(["train", "--model", "unet", "--image-size", "16", "--steps", "1",
                     "--batch-size", "8", "--no-progress"]) == 0
  out = capsys.readouterr().out
  assert "test accuracy" in out and evaluated and set(evaluated) == {(16, 16, 16)}, evaluated
  assert 0.0 <= json.loads(out.splitlines()[0])["test_accuracy"] <= 1.0, out
  # jmem bench: the step compiled with per-pixel labels; the U-Net's stages are the
  # default sites of the bench's techniques (remat: traced, not compiled); one it cannot
  # take fails at once.
  exact, = bench.run_bench(bench.BenchConfig(model="unet", techniques=(), batch_size=1,
                                             image_size=16, memory_only=True, budgets_gib=()),
                           quiet=True)
  x, y = (jax.ShapeDtypeStruct((2, 16, 16, 1), jnp.float32),
          jax.ShapeDtypeStruct((2, 16, 16), jnp.int32))
  saved = [bench.saved_bytes(train.model_fns(bench.build_model(
      t, models.create_model("unet", 11), ds, 2)), optax.sgd(0.1), x, y)
      for t in ("exact", "remat")]
  assert exact["saved_bytes"] > 0 and saved[1] < 0.5 * saved[0], saved
  compiles = []
  monkeypatch.setattr(bench, "batch_fit", lambda *a, **k: compiles.append(a))
  with pytest.raises(ValueError, match="'sbp-0.5' needs the model's SBP sites"):
    bench.run_bench(bench.BenchConfig(model="unet", techniques=("sbp-0.5",), batch_size=2,
                                      image_size=16, memory_only=True), quiet=True)
  assert not compiles
  # jmem plan: the example batch and the calibration labels are per pixel, 11 classes.
  seen = {}

  def fake_plan(model, batch, budget, **kw):
    seen.update(model=model, batch=batch, calibration=kw["calibration_batch"])
    raise KeyboardInterrupt
  monkeypatch.setattr(planner, "plan", fake_plan)
  with pytest.raises(KeyboardInterrupt):
    cli.main(["plan", "--model", "unet", "--image-size", "64", "--batch-size", "4",
              "--budget", "1GiB"])
  assert seen["model"].num_classes == 11
  assert [a.shape for a in seen["batch"]] == [(4, 64, 64, 3), (4, 64, 64)]
  cx, cy = seen["calibration"]
  assert cx.shape == (16, 64, 64, 3) and cy.shape == (16, 64, 64)
  assert set(np.unique(cy)) <= set(range(11)) and 10 in cy and len(np.unique(cy)) > 2


def test_plan_flags_reach_the_planner(monkeypatch):
  # --no-inplace-abn and --policies reach jmem.plan; with no compressing policy there is
  # nothing for sensitivities to order, so no calibration batch is made.
  from jmem import planner
  seen = {}

  def fake_plan(model, batch, budget, **kw):
    seen.update(kw)
    raise KeyboardInterrupt
  monkeypatch.setattr(planner, "plan", fake_plan)
  base = ["plan", "--model", "resnet8", "--image-size", "16", "--batch-size", "4", "--budget",
          "50%"]
  with pytest.raises(KeyboardInterrupt):
    cli.main(base + ["--no-inplace-abn", "--policies", "recompute"])
  assert seen["inplace_abn"] is False and tuple(seen["policies"]) == ("recompute",)
  assert seen["calibration_batch"] is None and seen["approximate"]
  with pytest.raises(KeyboardInterrupt):
    cli.main(base)
  assert seen["inplace_abn"] is True and seen["policies"] is None
  assert seen["calibration_batch"][0].shape == (16, 16, 16, 3)


@pytest.mark.slow
def test_every_model_trains_and_benches_with_the_default_image_size(capsys, tmp_path):
  """Left out, ``--image-size`` is 16 rounded up to the model's unit (a ConvNeXt's stem and
  halvings, the U-Net's poolings, the video ViT's patch), or for a video model the smallest
  frame its clips of ``--num-frames`` need, rounded so too: ``jmem train --model video-vit``
  and ``jmem bench --model video-vit`` with no size run instead of failing on the default,
  and every registered image model takes its default."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jmem import models  # pylint: disable=g-import-not-at-top
  cases = {("video-vit", 16, 16): 24, ("stt-resnet8", 16, 16): 22, ("stt-resnet8", 4, 16): 16,
           ("video-vit", 40, 16): 64, ("resnet8", 16, 16): 16, ("unet", 16, 20): 32,
           ("convnext-t", 16, 16): 32, ("convnext-digits", 16, 1): 2,
           ("no-such-model", 16, 16): 16}
  got = {k: bench.default_image_size(*k) for k in cases}
  assert got == cases, got
  assert bench.min_frame_size(40) == 58 and bench.min_frame_size(16) == 22
  bench.make_dataset("stt-resnet8", 22, num_frames=16, train_clips=2, test_clips=2)
  with pytest.raises(ValueError, match="at least 22x22"):
    bench.make_dataset("stt-resnet8", 21, num_frames=16, train_clips=2, test_clips=2)
  # Every registered model takes its default (traced, not compiled); where the unit is
  # above 1, one pixel less is refused (not a NaN loss).
  for name in models.MODEL_NAMES:
    model, video = models.create_model(name, 10), models.model_task(name) == "video"
    size = bench.default_image_size(name, 4, 1)
    lead = (1, 4) if video else (1,)
    for side in (size, size - 1):
      x = jax.ShapeDtypeStruct(lead + (side, side, 1 if video else 3), jnp.float32)
      init = lambda x, m=model: m.init(jax.random.key(0), x)
      if side == size:
        jax.eval_shape(init, x)
      elif models.image_size_unit(name) > 1:
        with pytest.raises(ValueError, match="at least|divisible"):
          jax.eval_shape(init, x)
  assert cli.main(["train", "--model", "video-vit", "--steps", "1", "--batch-size", "4",
                   "--train-clips", "16", "--no-progress"]) == 0
  assert "test accuracy" in capsys.readouterr().out
  out = tmp_path / "bench"
  assert cli.main(["bench", "--model", "video-vit", "--memory-only", "--techniques", "exact",
                   "--budgets", "", "--batch-size", "4", "--train-clips", "16",
                   "--no-progress", "--output-dir", str(out)]) == 0
  capsys.readouterr()
  written = json.loads((out / "bench.json").read_text())
  assert written["meta"]["config"]["image_size"] == 24, written["meta"]
  # Every result names the commit that wrote it (this checkout's; None for an installed copy).
  assert written["meta"]["commit"] == bench.source_commit(), written["meta"]
  assert bench.source_commit() is None or re.fullmatch(r"[0-9a-f]{7,}(\+changes)?",
                                                       bench.source_commit())


def test_source_commit_of_a_copy_is_the_named_one(monkeypatch):
  """A checkout's files copied to another machine (a GPU's, where git may have no
  repository or another base) name the commit they came from in ``JMEM_SOURCE_COMMIT``."""
  import subprocess  # pylint: disable=g-import-not-at-top
  no_repo = lambda *a, **k: subprocess.CompletedProcess(a, 128, "", "not a git repository")
  monkeypatch.setattr(subprocess, "run", no_repo)
  monkeypatch.delenv("JMEM_SOURCE_COMMIT", raising=False)
  assert bench.source_commit() is None
  monkeypatch.setenv("JMEM_SOURCE_COMMIT", "51d1694")
  assert bench.source_commit() == "51d1694"
  monkeypatch.undo()
  monkeypatch.setenv("JMEM_SOURCE_COMMIT", "2bdf73e")
  assert bench.source_commit() == "2bdf73e"     # named, whatever this checkout's git says


def test_every_table_names_the_target_of_its_bytes():
  """The default target's columns say XLA:CPU too (its buffer assignment is not a GPU's)."""
  cpu = dict(target="default", target_label="XLA:CPU (cpu, this machine's default backend)")
  assert bench.caption([cpu]) == ("XLA:CPU", "")
  h100 = dict(target="h100", target_label="H100 target (NVIDIA H100 80GB HBM3: ...)",
              measured_on="cpu")
  assert bench.caption([h100]) == ("H100 target", "host " + jax.devices()[0].platform)
  row = dict(cpu, technique="exact", model="resnet8", per_example_temp_bytes=2**20,
             max_batch_ratio=1.0, flops_ratio=1.0, temp_bytes=2**20, temp_ratio=1.0,
             saved_bytes=2**20, saved_ratio=1.0, step_time_ratio=1.0, accuracy=None)
  assert "| MiB / example (XLA:CPU) |" in bench.format_table([row])
