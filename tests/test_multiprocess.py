"""Several processes on JAX's distributed runtime: 2 processes x 4 simulated CPU devices on
127.0.0.1 (gloo collectives), against this process's 8 devices.

One launch of two `jmem train` processes (process 0 configured by the JMEM_* variables,
process 1 by flags) trains (a) a data-parallel ResNet-8 with SyncBN on padded, masked
batches (20 examples over 8 devices: process 0 holds 12 real rows, process 1 8 real rows and
4 padding rows, its last device none real) and (b) a ConvNeXt whose activations are sharded
over H x W = 2 x 4 (H split between the processes, halos crossing them); then (c) the run of
(a) again, held mid-run just after its step-2 checkpoint. Both processes are killed there:
process 1 by SIGKILL, after which process 0 must exit non-zero by itself within the
heartbeat timeout. A second launch resumes (c) and must end bit-identical to (a). Every
process is bounded by a timeout and killed by its PID. Run alone with
``pytest -m multiprocess``.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jmem import bench, cli, models, train

pytestmark = pytest.mark.multiprocess

HEARTBEAT_S = 10
RESNET = ["train", "--model", "resnet8", "--technique", "sync-bn", "--image-size", "8",
          "--batch-size", "20", "--steps", "4", "--mesh", "8", "--checkpoint-every", "2",
          "--no-progress"]
CONVNEXT = ["train", "--model", "convnext-digits", "--image-size", "16", "--batch-size", "8",
            "--steps", "2", "--mesh", "1x2x4", "--checkpoint-every", "2", "--no-progress"]

# Runs `jmem train` once per argument list in this process. With "hold", the last run
# stops just after saving its step-2 checkpoint (in the middle of the run, the distributed
# runtime live) and waits there to be killed.
WORKER = r"""
import json, sys, time
from jmem import train
from jmem.cli import main
runs = json.loads(sys.argv[1])
for i, argv in enumerate(runs):
  if sys.argv[2] == "hold" and i == len(runs) - 1:
    save = train._Checkpoints.save
    def held_save(self, step, *args, **kwargs):
      save(self, step, *args, **kwargs)
      if step == 2:
        print("HELD", flush=True)
        time.sleep(600)
    train._Checkpoints.save = held_save
  print("EXIT", main(argv), flush=True)
"""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start(runs, tmp_path, tag, *, hold=False):
  port = _free_port()
  env = dict(os.environ)
  # 4 devices each, by flag: the other XLA flags (conftest's) as they are.
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if not f.startswith("--xla_force_host_platform_device_count"))
  env.update(JAX_PLATFORMS="cpu",
             # The resuming launch loads the first launch's compiled programs.
             JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  settings = [  # process 0 from the environment, process 1 from flags
      ({"JMEM_COORDINATOR": f"127.0.0.1:{port}", "JMEM_NUM_PROCESSES": "2",
        "JMEM_PROCESS_ID": "0"}, []),
      ({}, ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "1"])]
  procs = []
  for pid, (extra_env, flags) in enumerate(settings):
    out = open(tmp_path / f"{tag}{pid}.out", "w")
    err = open(tmp_path / f"{tag}{pid}.err", "w")
    runs_pid = [argv + flags + ["--local-devices", "4", "--heartbeat-timeout", str(HEARTBEAT_S)]
                for argv in runs]
    procs.append(subprocess.Popen(
        [sys.executable, "-c", WORKER, json.dumps(runs_pid), "hold" if hold else "run"],
        env={**env, **extra_env}, stdout=out, stderr=err, cwd=tmp_path))
    out.close()
    err.close()
  return procs


def _kill(procs):
  for p in procs:
    if p.poll() is None:
      os.kill(p.pid, signal.SIGKILL)
      p.wait()


def _read(tmp_path, tag, pid, stream="out"):
  return (tmp_path / f"{tag}{pid}.{stream}").read_text()


def _wait_for(procs, tmp_path, tag, text, timeout):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if all(text in _read(tmp_path, tag, i) for i in range(len(procs))):
      return
    dead = [p for p in procs if p.poll() is not None]
    if dead:
      break
    time.sleep(0.2)
  logs = "\n".join(f"--- process {i}:\n{_read(tmp_path, tag, i)[-2000:]}"
                   f"{_read(tmp_path, tag, i, 'err')[-3000:]}" for i in range(len(procs)))
  raise AssertionError(f"{text!r} not printed by every process in time:\n{logs}")


def _reference(argv):
  """The same `jmem train` run on this process's 8 devices, as the CLI builds it."""
  args = cli._parser().parse_args(argv)
  dataset = bench.make_dataset(args.model, args.image_size)
  model = bench.build_model(args.technique, models.create_model(args.model, dataset.num_classes),
                            dataset, args.batch_size)
  model = cli._on_mesh(model, args.mesh, args.technique)
  config = train.TrainConfig(steps=args.steps, batch_size=args.batch_size, progress=False)
  return train.train(model, dataset, config)


def _checkpoint(directory, like):
  ckpt = train._Checkpoints(str(directory), 2, resume=True)
  try:
    return ckpt.steps[-1], ckpt.restore(like)
  finally:
    ckpt.close()


def _max_diff(a, b):
  return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


@pytest.mark.slow
def test_two_processes_match_one_resume_exactly_and_die_together(tmp_path):
  assert jax.device_count() == 8
  full, killed = tmp_path / "full", tmp_path / "killed"
  runs = [RESNET + ["--checkpoint-dir", str(full)],
          CONVNEXT + ["--checkpoint-dir", str(tmp_path / "convnext")],
          RESNET + ["--checkpoint-dir", str(killed)]]
  procs = _start(runs, tmp_path, "a", hold=True)
  try:
    _wait_for(procs, tmp_path, "a", "HELD", timeout=400)
    # A peer that dies stops the other: killed process 1, process 0 aborts by itself.
    t0 = time.monotonic()
    os.kill(procs[1].pid, signal.SIGKILL)
    try:
      rc0 = procs[0].wait(timeout=HEARTBEAT_S + 30)
    except subprocess.TimeoutExpired:
      rc0 = None
    survived_s = time.monotonic() - t0
  finally:
    _kill(procs)
  assert rc0 is not None and rc0 != 0, (rc0, survived_s)
  assert survived_s < HEARTBEAT_S + 10, survived_s
  out0, out1, err0, err1 = (_read(tmp_path, "a", 0), _read(tmp_path, "a", 1),
                            _read(tmp_path, "a", 0, "err"), _read(tmp_path, "a", 1, "err"))
  assert out0.count("EXIT 0") == out1.count("EXIT 0") == 2, (out0, err0[-3000:], err1[-3000:])
  # Process 0 reports, process 1 does not; process 0 names every checkpoint it saves.
  assert out0.count("test accuracy") == 2 and "test accuracy" not in out1
  for step in (2, 4):           # once each, though the process ran three trainings
    assert err0.count(f"step {step} saved in {full / str(step)}") == 1
  assert f"step 2 saved in {killed / '2'}" in err0 and "saved in" not in err1

  # (a) and (b) against one process with 8 devices.
  ref_a = _reference(RESNET)
  step, state_a = _checkpoint(full, ref_a.state)
  assert step == 4
  assert _max_diff(state_a.params, ref_a.state.params) < 1e-5
  assert _max_diff(state_a.model_state, ref_a.state.model_state) < 1e-5
  accuracies = [json.loads(line)["test_accuracy"] for line in out0.splitlines()
                if line.startswith("{")]
  assert accuracies[0] == pytest.approx(ref_a.test_accuracy, abs=1e-9)
  ref_b = _reference(CONVNEXT)
  assert accuracies[1] == pytest.approx(ref_b.test_accuracy, abs=1e-9)
  step, state_b = _checkpoint(tmp_path / "convnext", ref_b.state)
  assert step == 2
  assert _max_diff(state_b.params, ref_b.state.params) < 1e-5

  # (c) resumed in two fresh processes: bit-identical to the uninterrupted (a).
  assert _checkpoint(killed, ref_a.state)[0] == 2
  procs = _start([RESNET + ["--checkpoint-dir", str(killed), "--resume"]], tmp_path, "r")
  try:
    for p in procs:
      p.wait(timeout=300)
  finally:
    _kill(procs)
  assert [p.returncode for p in procs] == [0, 0], _read(tmp_path, "r", 0, "err")[-3000:]
  assert "resumed from step 2" in _read(tmp_path, "r", 0)
  step, state_c = _checkpoint(killed, ref_a.state)
  assert step == 4
  for x, y in zip(jax.tree.leaves(state_c), jax.tree.leaves(state_a), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
