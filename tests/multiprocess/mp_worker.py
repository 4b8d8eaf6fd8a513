"""One process of a multi-process test job; see mp_launch.

Usage: python mp_worker.py CONFIG_JSON, with JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES and JAX_PROCESS_ID in the environment (absent: a single
process). CONFIG keys:
  out           directory for the results: every process writes
                history_<p>.json; process 0 writes state.npz (and
                predictions.npy with "predict").
  workdir       the Trainer's workdir, or null; or a list, one per process id.
  batches, seed the global batches (mp_model.make_batches).
  num_steps     fit's num_steps (null: all batches).
  stop_at       request_stop() after this step (an interrupted, pipelined
                checkpoint carries an in-flight batch), or null.
  stop_process  only this process requests the stop (null: every process).
  predict       also predict the batches after training.
  fail          {"process": p, "step": k, "how": "kill" | "raise"}: process
                p SIGKILLs itself or raises after step k, or null.
  learning_rate per process id (a disagreeing job), or one number.
  no_kernels    a process that behaves as if its C++ CPU kernels were not
                built (it chooses the portable backend), or null.
  short         a process that feeds one batch less than the others, or null.
  pipelining    the Trainer's mode (default true).
  empty         a process that feeds no batch at all, or null.
  late          {"process": p, "seconds": s}: process p sleeps s seconds
                before it builds its Trainer, or null.
  mesh_devices  a mesh of the first this many of jax.devices() (null: every device).
  timeout_s, heartbeat_timeout_s  passed to initialize_distributed.
"""

import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pipelining import Callback, initialize_distributed  # noqa: E402


class Inject(Callback):
  """Stops, dies or raises at a step."""

  def __init__(self, config, process, out):
    self.config, self.process, self.out = config, process, out

  def on_step_end(self, trainer, step, metrics):
    fail = self.config.get("fail")
    if fail and fail["process"] == self.process and step == fail["step"]:
      with open(os.path.join(self.out, "failed_at.txt"), "w") as f:
        f.write(repr(time.time()))
      if fail["how"] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
      raise RuntimeError(f"injected failure in process {self.process} at step {step}")
    if self.config.get("stop_at") == step and self.config.get("stop_process") in (None,
                                                                                 self.process):
      trainer.request_stop()


def main():
  config = json.loads(sys.argv[1])
  # Inside the job, an exception ends this process at once (fail-fast).
  with initialize_distributed(timeout_s=config.get("timeout_s", 60),
                              heartbeat_timeout_s=config.get("heartbeat_timeout_s", 10)):
    run(config)


def run(config):
  import jax
  import numpy as np

  from mp_model import local_batches, make_batches, make_trainer, state_arrays

  process = jax.process_index()
  late = config.get("late")
  if late and late["process"] == process:
    time.sleep(late["seconds"])
  if config.get("no_kernels") == process:
    from sc_framework.primitives import _backend

    _backend.cpu_kernels_available = lambda: False
  rate = config.get("learning_rate", 0.3)
  if isinstance(rate, list):
    rate = rate[process]
  incremental = None
  if config.get("incremental"):
    from checkpoint import IncrementalPolicy

    incremental = IncrementalPolicy(**config["incremental"])
  workdir = config.get("workdir")
  if isinstance(workdir, list):
    workdir = workdir[process]
  mesh = None
  if config.get("mesh_devices"):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:config["mesh_devices"]]), ("devices",))
  trainer = make_trainer(workdir, learning_rate=rate, mesh=mesh,
                         save_every=config.get("save_every"), incremental=incremental,
                         pipelining=config.get("pipelining", True))
  data = local_batches(trainer, make_batches(config["batches"], config["seed"]))
  if config.get("short") == process:
    data = data[:-1]
  if config.get("empty") == process:
    data = []
  history = trainer.fit(data, num_steps=config.get("num_steps"), epochs=config.get("epochs"),
                        callbacks=[Inject(config, process, config["out"])])
  result = {"losses": [m["loss"] for m in history.metrics], "final_step": history.final_step,
            "resumed_from": history.resumed_from, "interrupted": history.interrupted,
            "local_devices": [trainer.plan.local_devices().start,
                              trainer.plan.local_devices().stop]}
  if config.get("predict"):
    predictions = trainer.predict(data)
    result["evaluate"] = trainer.evaluate(data)
  arrays = state_arrays(trainer)
  if process == 0:
    np.savez(os.path.join(config["out"], "state.npz"), **arrays)
    if config.get("predict"):
      np.save(os.path.join(config["out"], "predictions.npy"), predictions)
  with open(os.path.join(config["out"], f"history_{process}.json"), "w") as f:
    json.dump(result, f)


if __name__ == "__main__":
  main()
