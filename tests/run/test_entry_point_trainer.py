"""Which trainer ``python -m respo_verl.main_ppo`` runs, and the reaper it starts (respo_verl/run/launch.py).

verl's legacy trainer (``trainer.use_v1=false``) has none of the respo-verl trainer's additions, so our entry point
refuses it while the run guards are on, in one line naming the key, before Ray starts.
"""

from __future__ import annotations

import pytest
from support.entry import run_entry

from respo_verl import main_ppo
from respo_verl.run import launch
from respo_verl.run.compose import compose_job

LEGACY = "trainer.use_v1=false"


def test_the_legacy_trainer_is_refused_in_one_line_before_ray(tmp_path):
    for extra in ([], ["--cfg", "job"]):
        proc = run_entry(["algorithm=respo", "+device=cpu", LEGACY, *extra], tmp_path)
        assert proc.returncode == 2, proc.stderr[-3000:]
        lines = [line for line in proc.stderr.splitlines() if line.startswith("respo_verl.main_ppo:")]
        assert len(lines) == 1 and lines[0].startswith(f"respo_verl.main_ppo: {LEGACY}: verl's legacy trainer"), lines
        assert "run_guard.enable=false" in lines[0]
        assert "Traceback" not in proc.stderr and "ray init" not in proc.stdout


def test_the_legacy_trainer_runs_when_the_guards_are_turned_off():
    launch.check_trainer(compose_job(main_ppo.ENTRY, ["algorithm=respo", LEGACY, "run_guard.enable=false"]))
    launch.check_trainer(compose_job(main_ppo.ENTRY, ["algorithm=respo"]))  # the V1 trainer: nothing to refuse
    with pytest.raises(ValueError, match=LEGACY):
        launch.check_trainer(compose_job(main_ppo.ENTRY, ["algorithm=vespo", LEGACY]))


def test_no_reaper_without_a_local_cluster_of_this_driver():
    """Before ``ray.init`` (and for a cluster reached through an address, where Ray's node is connect-only) the
    entry point starts no reaper: nothing of another cluster is ever stopped."""
    import ray

    assert not ray.is_initialized()
    assert launch.stop_local_ray_with_driver() is None
