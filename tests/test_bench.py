"""`jmem bench` and `jmem train`: rows, files, registry and clear errors."""

import json

import pytest

from jmem import bench, cli


def test_memory_only_rows_and_remat_saves():
  rows = bench.run_bench(bench.BenchConfig(model="resnet20", batch_size=16, image_size=8,
                                           memory_only=True), quiet=True)
  assert [r["technique"] for r in rows] == ["exact", "remat"]
  exact, remat = rows
  assert remat["saved_bytes"] < 0.5 * exact["saved_bytes"]
  assert remat["temp_bytes"] < exact["temp_bytes"]
  assert remat["baseline_saved_bytes"] == exact["saved_bytes"]
  assert remat["accuracy"] is None and remat["step_time_ratio"] is None


def test_cli_bench_json_and_files(tmp_path, capsys):
  out = tmp_path / "res"
  rc = cli.main(["bench", "--model", "resnet8", "--steps", "3", "--batch-size", "16",
                 "--image-size", "8", "--seeds", "0,1", "--json", "--no-progress",
                 "--output-dir", str(out)])
  assert rc == 0
  rows = json.loads(capsys.readouterr().out)
  required = {"technique", "model", "saved_bytes", "temp_bytes", "baseline_saved_bytes",
              "baseline_temp_bytes", "step_time_ratio", "accuracy"}
  for row in rows:
    assert required <= set(row)
    assert 0.0 <= row["accuracy"] <= 1.0 and len(row["accuracy_per_seed"]) == 2
    assert row["step_time_ratio"] > 0
  assert rows[0]["step_time_ratio"] == 1.0
  for name in ("bench.json", "bench.md", "bench_memory.png"):
    assert (out / name).stat().st_size > 0


def _error(argv, capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(argv)
  assert e.value.code == 2
  return capsys.readouterr().err


def test_cli_errors_are_clear(tmp_path, capsys):
  assert "resnet20" in _error(["bench", "--model", "vgg"], capsys)
  err = _error(["bench", "--techniques", "exact,magic"], capsys)
  assert "magic" in err and "remat" in err
  assert "larger than" in _error(["bench", "--batch-size", "5000", "--steps", "1",
                                  "--output-dir", str(tmp_path)], capsys)
  assert "steps" in _error(["bench", "--steps", "-3"], capsys)
  blocker = tmp_path / "f"
  blocker.write_text("x")
  assert "--output-dir" in _error(["bench", "--output-dir", str(blocker / "d")], capsys)


def test_registry_one_registration_adds_a_bench_row():
  with pytest.raises(ValueError, match="already registered"):
    bench.register_technique(bench.Technique("exact", lambda m: m))
  name = "test-identity"
  if name not in bench.technique_names():
    bench.register_technique(bench.Technique(name, lambda m: m, "same as exact"))
  rows = bench.run_bench(bench.BenchConfig(model="resnet8", techniques=(name,), batch_size=8,
                                           image_size=8, memory_only=True), quiet=True)
  assert rows[1]["technique"] == name and rows[1]["saved_ratio"] == 1.0


def test_actnn_l3_technique_calibrates_bits_before_measuring():
  import jax
  import jax.numpy as jnp
  import optax
  from jmem import models, train
  from jmem.ops import actnn
  assert bench.get_technique("actnn-L3").prepare is not None
  rows = bench.run_bench(bench.BenchConfig(model="resnet8", techniques=("actnn-L3",),
                                           batch_size=8, image_size=8, memory_only=True),
                         quiet=True)
  uniform = actnn.convert(models.create_model("resnet8", 10), "L3")
  saved, _ = bench.step_memory(train.model_fns(uniform), optax.sgd(0.1),
                               jax.ShapeDtypeStruct((8, 8, 8, 1), jnp.float32),
                               jax.ShapeDtypeStruct((8,), jnp.int32))
  # Per-layer widths change the layout but not the 2-bit budget.
  assert rows[1]["saved_bytes"] != saved and rows[1]["saved_bytes"] <= 1.02 * saved
  assert rows[1]["saved_ratio"] < 1 / 8, rows[1]


def test_cli_train_resume(tmp_path, capsys):
  ckpt = str(tmp_path / "ckpt")
  args = ["train", "--model", "resnet8", "--image-size", "8", "--batch-size", "16",
          "--steps", "4", "--checkpoint-every", "2", "--checkpoint-dir", ckpt, "--no-progress"]
  assert cli.main(args) == 0
  first = capsys.readouterr().out
  assert cli.main(args + ["--resume"]) == 0    # already finished: resumes at the end
  second = capsys.readouterr().out
  assert "resumed from step 4" in second
  assert first.splitlines()[-1] == second.splitlines()[-1]   # same final accuracy
