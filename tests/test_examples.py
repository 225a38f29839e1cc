"""The runnable examples in examples/ run as written and check what they claim."""

import importlib.util
import os

import pytest

pytestmark = pytest.mark.slow     # each test compiles whole steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples",
                                                                   f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_sync_bn_example_is_exact_and_its_check_catches_the_usual_mistake(capsys):
  example = _load("sync_bn")
  assert example.main() == 0
  assert "exact to 1e-5" in capsys.readouterr().out
  # A per-device mean loss whose gradients are averaged again: the check must fail it.
  assert example.main(mistake=True) == 1
  assert "NOT within 1e-5" in capsys.readouterr().out
