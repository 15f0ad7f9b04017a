"""The stand-in run (tests/support/standin/standin_run.py) holding its GPU slots on the Ray cluster it runs on, as a
verl run holds its resource pool: ``python -m standin_gpu_run <overrides>``, as a Ray job of
tests/tools/sweep/test_sweep_ray.py (this folder and the stand-in's on the head's ``PYTHONPATH``).

It joins the job's cluster, reserves ``trainer.nnodes x trainer.n_gpus_per_node`` GPU slots in one placement group
(one bundle per slot, as verl's pools ask), makes the stand-in's steps while it holds them, and gives them back. Slots
not free within :data:`WAIT_S` end the run with exit status 1, as verl stops a run whose GPUs are taken.
"""

from __future__ import annotations

import sys

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from standin_run import main as run_steps

WAIT_S = 20.0  # far longer than Ray takes to free the slots of a job that has ended


def main(argv: list[str]) -> int:
    options = dict(arg.lstrip("+").split("=", 1) for arg in argv if "=" in arg)
    slots = int(options["trainer.nnodes"]) * int(options["trainer.n_gpus_per_node"])
    name = options.get("trainer.experiment_name", "run")
    ray.init()  # the job's cluster (Ray's job supervisor sets RAY_ADDRESS)
    group = placement_group([{"GPU": 1}] * slots)
    ready, _ = ray.wait([group.ready()], timeout=WAIT_S)
    if not ready:
        print(f"standin: {name} found no {slots} free GPU slots in {WAIT_S:.0f} s", flush=True)
        return 1
    print(f"standin: {name} holds {slots} GPU slots", flush=True)
    try:
        return run_steps(argv)
    finally:
        remove_placement_group(group)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
