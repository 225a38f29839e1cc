"""Several processes (one per host, or several on one machine) on JAX's own runtime.

jmem runs multi-controller: every process runs the same program, `initialize` connects them
through `jax.distributed.initialize`, and a mesh over ``jax.devices()`` (all processes'
devices) spans them. `jmem.train.train` then builds each batch as a global array from the
rows each process holds (`jmem.step.global_batch`), evaluates on the whole test set, saves
orbax checkpoints from every process and reports from process 0 only.

  jmem train --coordinator 10.0.0.1:12345 --num-processes 2 --process-id 0 --mesh 16 ...
  jmem train --coordinator 10.0.0.1:12345 --num-processes 2 --process-id 1 --mesh 16 ...

or the same three settings from ``JMEM_COORDINATOR``, ``JMEM_NUM_PROCESSES`` and
``JMEM_PROCESS_ID``. On CPU (tests, or a cluster of CPU hosts) the collectives go through
gloo over TCP.

A process that dies takes the run with it: the others stop at their next collective, or at
the latest when the coordination service misses its heartbeats for
``heartbeat_timeout_seconds``, and exit with a non-zero status (JAX aborts them; Python
cannot catch it). Restart every process with ``--resume`` and the same mesh: the run goes
on bit-identically from its last checkpoint.
"""

from __future__ import annotations

import os

import jax

__all__ = ["initialize", "settings_from_env", "is_primary"]

ENV = ("JMEM_COORDINATOR", "JMEM_NUM_PROCESSES", "JMEM_PROCESS_ID")


def settings_from_env(coordinator: str | None = None, num_processes: int | None = None,
                      process_id: int | None = None) -> tuple[str | None, int | None, int | None]:
  """The three settings, each from its argument or else from its ``JMEM_*`` variable."""
  env = [os.environ.get(k) or None for k in ENV]
  coordinator = coordinator if coordinator is not None else env[0]
  values = []
  for name, given, text in (("JMEM_NUM_PROCESSES", num_processes, env[1]),
                            ("JMEM_PROCESS_ID", process_id, env[2])):
    if given is None and text is not None:
      try:
        given = int(text)
      except ValueError:
        raise ValueError(f"{name} must be an integer, got {text!r}.") from None
    values.append(given)
  return coordinator, values[0], values[1]


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, heartbeat_timeout_seconds: int = 100,
               initialization_timeout: int = 300) -> bool:
  """Connects this process to the others (`jax.distributed.initialize`); True if it did.

  Call it before any JAX computation. With no settings given (arguments or ``JMEM_*``
  variables) it does nothing and returns False: a single process. It also makes the CPU
  backend's collectives go through gloo, which is what lets a mesh of CPU devices span
  processes (it changes nothing on GPUs).

  Args:
    coordinator: ``host:port`` of process 0's coordination service (every process gives
      the same one).
    num_processes: how many processes take part.
    process_id: this process, in ``[0, num_processes)``.
    heartbeat_timeout_seconds: how long a silent process may go before the others are
      stopped.
    initialization_timeout: how long to wait for every process to connect.

  Raises:
    ValueError: settings missing or out of range, or JAX already computed something.
  """
  coordinator, num_processes, process_id = settings_from_env(coordinator, num_processes,
                                                             process_id)
  given = {"coordinator": coordinator, "num_processes": num_processes,
           "process_id": process_id}
  if all(v is None for v in given.values()):
    return False
  missing = [k for k, v in given.items() if v is None]
  if missing:
    raise ValueError(
        f"Several processes need a coordinator, the number of processes and this process's "
        f"id; {', '.join(missing)} missing. Give --coordinator HOST:PORT --num-processes N "
        f"--process-id I (or {', '.join(ENV)}).")
  host, colon, port = coordinator.rpartition(":")
  if not colon or not host or not port.isdigit():
    raise ValueError(f"coordinator must be HOST:PORT (e.g. 127.0.0.1:12345), got "
                     f"{coordinator!r}.")
  if num_processes < 1 or not 0 <= process_id < num_processes:
    raise ValueError(f"process_id must be in [0, num_processes) and num_processes >= 1, got "
                     f"process_id={process_id}, num_processes={num_processes}.")
  if heartbeat_timeout_seconds < 1:
    raise ValueError(f"heartbeat_timeout_seconds must be >= 1, got "
                     f"{heartbeat_timeout_seconds}.")
  if jax.distributed.is_initialized():
    if (jax.process_count(), jax.process_index()) != (num_processes, process_id):
      raise ValueError(
          f"jax.distributed is already initialised as process {jax.process_index()} of "
          f"{jax.process_count()}, not {process_id} of {num_processes}.")
    return True
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # A loopback coordinator listens on loopback only (JAX's default is every interface).
  loopback = host in ("localhost", "::1", "[::1]") or host.startswith("127.")
  try:
    jax.distributed.initialize(coordinator, num_processes, process_id,
                               initialization_timeout=initialization_timeout,
                               heartbeat_timeout_seconds=heartbeat_timeout_seconds,
                               coordinator_bind_address=coordinator if loopback else None)
  except RuntimeError as e:
    if "before any JAX" in str(e) or "must be called before" in str(e):
      raise ValueError("jmem.distributed.initialize must run before any JAX computation "
                       "(call it first thing in the program).") from e
    raise
  return True


def is_primary() -> bool:
  """Whether this is process 0, the one that reports and plots."""
  return jax.process_index() == 0
