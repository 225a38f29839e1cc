"""A light core: ``import jmem`` needs jax, jaxlib, flax, optax, chex and numpy only."""

import os
import subprocess
import sys
import textwrap
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run in a fresh interpreter in which the ``cli`` extra's modules cannot be imported, as in
# an environment with the core dependencies only.
_WITHOUT_EXTRAS = textwrap.dedent("""
    import importlib.abc, sys
    BLOCKED = ("sklearn", "scipy", "matplotlib")
    class Blocker(importlib.abc.MetaPathFinder):
      def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
          raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    sys.meta_path.insert(0, Blocker())
    import jmem
    for name in sorted(jmem._LAZY):
      getattr(jmem, name)                  # every submodule imports without the extra
    assert not [m for m in sys.modules if m.split(".")[0] in BLOCKED]
    from jmem import _extras, data
    try:
      data.digits(8)
    except _extras.MissingExtra as e:
      print("DATA:", e)
    from jmem import cli
    try:
      cli.main(["train", "--steps", "1", "--no-progress"])
    except SystemExit as e:
      print("EXIT:", e.code)
""")


def test_import_jmem_needs_only_the_core_dependencies():
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  out = subprocess.run([sys.executable, "-c", _WITHOUT_EXTRAS], env=env, capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  # What needs the extra says so, with the pip line; the command line in one line, exit 2.
  assert ("DATA: jmem.data's digits needs scikit-learn, which is not installed: pip install "
          "'jmem[cli]'") in out.stdout, out.stdout
  assert "EXIT: 2" in out.stdout, out.stdout
  assert "jmem train: error: jmem.data's digits needs scikit-learn" in out.stderr, out.stderr
  assert "Traceback" not in out.stderr, out.stderr[-3000:]


def test_core_dependencies_are_the_light_ones():
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)["project"]
  names = lambda reqs: {r.split(">")[0].split("=")[0].split("<")[0].split("[")[0].strip()
                        for r in reqs}
  assert names(project["dependencies"]) == {"jax", "jaxlib", "flax", "optax", "chex", "numpy"}
  extras = project["optional-dependencies"]
  assert names(extras["cli"]) == {"scikit-learn", "scipy", "matplotlib"}
  assert "jmem[cli]" in extras["test"]
