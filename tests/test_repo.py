"""The README's commands are the ones CI runs."""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
  readme = (ROOT / "README.md").read_text()
  commands = re.findall(r"```bash\n(python3 -m venv[^\n]*)\n```", readme)
  assert len(commands) == 2, commands
  bench_cmd, test_cmd = commands
  assert bench_cmd.endswith("jmem bench") and "pytest" in test_cmd
  ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
  assert test_cmd in ci_lines


def _is_module(dotted: str) -> bool:
  path = ROOT / dotted.replace(".", "/")
  return path.is_dir() or path.with_suffix(".py").is_file()


def _jmem_imports(path: pathlib.Path) -> set[str]:
  """The jmem modules ``path`` imports, at any depth (lazy imports included)."""
  mods = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      mods |= {a.name for a in node.names if a.name.startswith("jmem")}
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jmem"):
      mods.add(node.module)
      mods |= {f"{node.module}.{a.name}" for a in node.names
               if _is_module(f"{node.module}.{a.name}")}
  return mods


# Private shared modules, below every technique: they import only each other.
LOW = {"jmem._axes", "jmem._backends", "jmem._bn_core", "jmem._context", "jmem._elementwise",
       "jmem._extras",
       "jmem._technique", "jmem._warn", "jmem._window"}
# One package (or module) per technique.
TECHNIQUES = ("jmem.ops.actnn", "jmem.ops.inplace_abn", "jmem.ops.sbp", "jmem.ops.remat",
              "jmem.parallel.sync_bn", "jmem.parallel.spatial")
# What sits above the techniques and must not be imported by them.
ABOVE = ("jmem.models", "jmem.surgery", "jmem.techniques", "jmem.bench", "jmem.cli", "jmem.planner",
         "jmem.tour")


def _under(mod: str, prefixes) -> bool:
  return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def _files(dotted: str):
  path = ROOT / dotted.replace(".", "/")
  return sorted(path.glob("*.py")) if path.is_dir() else [path.with_suffix(".py")]


def test_imports_point_down():
  """Kernels and the low shared modules import only low modules; a technique package
  imports no other technique and nothing above the techniques; only its glue
  (``technique.py``, ``modules.py``) imports the training loop."""
  private = {f"jmem.{p.stem}" for p in (ROOT / "jmem").glob("_*.py") if p.stem != "__init__"}
  assert private == LOW, ("every private module jmem/_*.py is a low module: add it to LOW "
                          "(or make it public)", private ^ LOW)
  for path in (ROOT / "pallas_kernels").glob("*.py"):
    got = {m for m in _jmem_imports(path) if m != "jmem"}
    assert got <= LOW, (path.name, got - LOW)
  for name in LOW:
    got = {m for m in _jmem_imports(_files(name)[0]) if m != "jmem"}
    assert got <= LOW, (name, got - LOW)
  for tech in TECHNIQUES:
    others = [t for t in TECHNIQUES if t != tech]
    for path in _files(tech):
      got = _jmem_imports(path)
      assert not {m for m in got if _under(m, others + list(ABOVE))}, (path, got)
      if path.stem not in ("technique", "modules", "remat"):
        assert not {m for m in got if _under(m, ("jmem.train",))}, (path, got)


@pytest.mark.slow
def test_a_bare_import_reaches_every_public_submodule():
  """Issue 48, defect 8: ``import jmem; jmem.models.create_model(...)`` raised
  AttributeError (``jmem.models`` was not imported by ``import jmem``)."""
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  code = ("import jmem\n"
          "assert type(jmem.models.create_model('resnet8', 10)).__name__ == 'ResNet'\n"
          "assert jmem.data.digits and jmem.train.train and jmem.parallel.data_parallel\n"
          "assert {'models', 'train', 'bench'} <= set(dir(jmem))\n"
          "try:\n  jmem.not_a_module\nexcept AttributeError as e:\n  print(e)\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=120, cwd=ROOT)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "module 'jmem' has no attribute 'not_a_module'"


def test_readme_is_short_and_narrow():
  """Issue 48: the README is an entry point (at most 200 lines of at most 100 columns);
  everything else lives in docs/."""
  lines = (ROOT / "README.md").read_text().splitlines()
  assert len(lines) <= 200, len(lines)
  wide = [(i, len(line)) for i, line in enumerate(lines, 1) if len(line) > 100]
  assert not wide, wide


def _commit(meta) -> str | None:
  return meta.get("commit") if isinstance(meta, dict) else None


def test_every_benchmark_result_names_its_commit():
  """Every JSON result outside results/gpu/ (GPU runs kept verbatim, with a header) names
  the commit that wrote it; no benchmark script puts tests/ on its path."""
  import json  # pylint: disable=g-import-not-at-top
  results = ROOT / "benchmarks" / "results"
  unnamed = []
  for path in sorted(results.rglob("*.json")):
    if (results / "gpu") in path.parents:
      continue
    data = json.loads(path.read_text())
    if not (isinstance(data, dict) and (_commit(data.get("meta")) or _commit(data))):
      unnamed.append(str(path.relative_to(results)))
  assert not unnamed, unnamed
  # Written by benchmarks/_common.py's writer: the whole stamp under "meta". The runs named
  # here are older than that stamp and not yet regenerated (each names its commit and says
  # where it came from); every other result has the whole stamp.
  historical = {"sbp_vit_pretrained_1200steps.json", "soak_multiprocess.json", "spatial.json",
                "bench.json"}
  stamp = {"commit", "date", "jax_version", "jaxlib", "device", "target"}
  unstamped = [str(p.relative_to(results)) for p in sorted(results.rglob("*.json"))
               if (results / "gpu") not in p.parents and p.name not in historical and
               not stamp <= set(json.loads(p.read_text()).get("meta") or {})]
  assert not unstamped, unstamped
  for path in (results / "gpu").glob("*.json"):
    data = json.loads(path.read_text())
    assert _commit(data.get("header")) or _commit(data.get("meta")), path.name
  for path in (ROOT / "benchmarks").glob("*.py"):
    text = path.read_text()
    assert not re.search(r"sys\.path\.[a-z]+\([^\n]*tests", text), path.name


def test_relative_links_in_readme_and_docs_exist():
  pages = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
  assert len(pages) > 1
  broken = []
  for page in pages:
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
      if re.match(r"[a-z]+:", target) or target.startswith("#"):
        continue
      if not (page.parent / target.split("#")[0]).exists():
        broken.append((page.name, target))
  assert not broken, broken
