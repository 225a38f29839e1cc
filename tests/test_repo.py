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
