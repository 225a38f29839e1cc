"""The README's commands are the ones CI runs."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
  readme = (ROOT / "README.md").read_text()
  commands = re.findall(r"```bash\n(python3 -m venv[^\n]*)\n```", readme)
  assert len(commands) == 2, commands
  bench_cmd, test_cmd = commands
  assert bench_cmd.endswith("jmem bench") and "pytest" in test_cmd
  ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
  assert test_cmd in ci_lines


def _jmem_imports(path: pathlib.Path) -> set[str]:
  text = path.read_text()
  mods = set(re.findall(r"^\s*from (jmem[\w.]*) import", text, re.M))
  mods |= set(re.findall(r"^\s*import (jmem[\w.]*)", text, re.M))
  for base, names in re.findall(r"^\s*from (jmem[\w.]*) import \(?([\w, _]+)", text, re.M):
    mods |= {f"{base}.{n.split(' as ')[0].strip()}" for n in names.split(",")
             if n.strip().startswith("_")}
  return mods


def test_imports_point_down():
  """Kernels import only jmem's low shared modules (never the ops that call them); the
  shared BatchNorm core and the elementwise math import nothing above them."""
  low = {"jmem", "jmem._bn_core", "jmem._elementwise"}
  for path in (ROOT / "pallas_kernels").glob("*.py"):
    assert _jmem_imports(path) <= low, (path.name, _jmem_imports(path) - low)
  for name in ("_bn_core.py", "_elementwise.py"):
    assert not _jmem_imports(ROOT / "jmem" / name), name
  # ops/inplace_abn.py uses the core, not the SyncBN technique.
  assert "jmem.parallel" not in " ".join(_jmem_imports(ROOT / "jmem" / "ops" / "inplace_abn.py"))
