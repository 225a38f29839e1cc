"""The tour (`jmem bench` with no options): its parts, fast. Its sections are run_bench
configurations, which tests/test_bench.py runs; the whole tour is the README's main job."""

import re

import pytest

from jmem import cli, tour


def test_the_quoted_accuracies_are_in_their_result_files():
  import pathlib  # pylint: disable=g-import-not-at-top
  root = pathlib.Path(__file__).resolve().parents[1]
  for technique, (quote, source) in tour.QUOTED.items():
    text = (root / source).read_text()
    for number in re.findall(r"\d+\.\d+(?:%|e-\d+)", quote):
      assert number in text, (technique, number, source)


def test_sync_bn_row_is_exact_with_devices_holding_nothing():
  check = tour.sync_bn_check()
  assert check["counts"][1] == 0 and check["nan_outputs"] == 0
  assert check["max_abs_error_valid"] < 1e-5 and check["running_mean_error"] < 1e-5
  assert check["collectives_forward_backward"].get("all-gather", 0) >= 1


@pytest.mark.parametrize("argv,is_tour", [
    (["bench"], True), (["bench", "--output-dir", "x", "--no-progress"], True),
    (["bench", "--json"], True), (["bench", "--target", "h100"], True),
    (["bench", "--model", "resnet8"], False),
    (["bench", "--memory-only"], False), (["train"], False), (["plan"], False)])
def test_which_bench_is_the_tour(argv, is_tour):
  assert cli._is_tour(argv) is is_tour   # pylint: disable=protected-access


def test_tour_table_and_figure(tmp_path):
  base = dict(model="resnet20", steps=60, per_example_temp_bytes=2**20, flops_ratio=1.0,
              temp_ratio=1.0, saved_ratio=1.0, step_time_ratio=1.0, max_batch_ratio=1.0,
              accuracy=0.99)
  rows = [dict(base, section="A", technique="exact"),
          dict(base, section="A", technique="actnn-L3", max_batch_ratio=4.5,
               flops_ratio=1.07, accuracy=None, quoted_accuracy="99.16%",
               source="benchmarks/results/stacks_accuracy.md",
               collectives={"all-reduce": 2, "collective-permute": 8}),
          dict(section="SyncBN", technique="sync-bn", model="BatchNorm layer",
               sync_bn=dict(max_abs_error_valid=1e-7, counts=[1, 0], nan_outputs=0,
                            collectives_forward_backward={"all-gather": 1}))]
  table = tour.format_tour(rows)
  assert "4.50x" in table and "99.16%, from benchmarks/results/stacks_accuracy.md" in table
  assert "1 all-gather (forward + backward)" in table and "99.00% (60 steps)" in table
  assert "| 8 collective-permute, 2 all-reduce |" in table     # the actnn-L3 row's
  spatial = dict(base, section="S", technique="spatial-8", saved_bytes=800.0, saved_ratio=1.6)
  tour._saved_per_device(spatial, 8)   # pylint: disable=protected-access
  assert spatial["saved_bytes"] == 100.0 and spatial["saved_bytes_all_devices"] == 800.0
  assert "| 0.200 |" in tour.format_tour([spatial])
  paths = tour.write_tour(rows, str(tmp_path))
  assert all((tmp_path / f"tour.{e}").exists() for e in ("json", "md", "png")), paths
  # The figure and table say that each point is against exact on its own model.
  md = (tmp_path / "tour.md").read_text()
  assert ("the points span 2 models (resnet20, BatchNorm layer), so compare a technique "
          "with exact") in md, md
  assert "per device" not in md
  assert "Points marked per device" in tour._models_note(  # pylint: disable=protected-access
      rows + [dict(spatial, section="S (per-device)")])


def test_the_tour_gives_the_spatial_row_per_device(monkeypatch):
  """run_tour divides the spatial row's traced saved bytes (every device's blocks) by its 8
  devices, and no other row's."""
  def fake_bench(config, **kwargs):
    del kwargs
    return [dict(technique=t, saved_bytes=80.0, saved_ratio=1.0 if t == "exact" else 1.6)
            for t in ("exact",) + tuple(config.techniques)]
  monkeypatch.setattr(tour.bench, "run_bench", fake_bench)
  monkeypatch.setattr(tour, "sync_bn_check", dict)
  rows = {(r["section"], r["technique"]): r for r in tour.run_tour(quiet=True)}
  spatial = [r for (_, t), r in rows.items() if t == "spatial-8"]
  assert len(spatial) == 1 and spatial[0]["saved_ratio"] == pytest.approx(0.2)
  assert spatial[0]["saved_bytes"] == 10.0 and spatial[0]["saved_bytes_all_devices"] == 80.0
  others = [r for (_, t), r in rows.items() if t not in ("spatial-8", "sync-bn")]
  assert len(others) > 4 and all(r["saved_bytes"] == 80.0 for r in others)
