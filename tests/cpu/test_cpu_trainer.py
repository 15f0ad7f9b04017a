"""verl's own entry point on CPU, end to end: ``verl.trainer.main_ppo`` with ``+device=cpu``, as a user runs it.

The run is a real ``python -m verl.trainer.main_ppo`` subprocess (tests/support/cpu_runs.py): Ray, the agent loop,
the hf_cpu rollout server, FSDP2 on gloo, verl's naive weight sync and verl's file logger. Nothing is mocked.

One run here: verl's own entry point, trained once in the suite (the loss chosen by verl's own key, verl's legacy
trainer). ReSPO through our entry point with rollout reuse is checked on the uninterrupted reference run of
test_cpu_resume.py, VESPO through the trainer on the demo's real sweep (test_demo.py), the negative controls of the
weight sync and of log W on the stale-server run of test_cpu_stops.py, and the stop on non-finite log-probabilities at
the end of the vLLM R3 run of test_cpu_vllm.py.
"""

from __future__ import annotations

import pytest
from support import cpu_runs
from support.trainer_checks import assert_trains, log_w

from respo_verl.cpu.kit.build import KitSpec, build_kit

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def kit():
    return build_kit(KitSpec(), progress=False)


def _job(reuse: int, steps: int) -> list[str]:
    return [
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        f"data.train_batch_size={2 * reuse}",
        f"trainer.total_training_steps={steps}",
        "trainer.experiment_name=test",
        "trainer.logger=[console,file]",
    ]


def test_verls_entry_point_trains_respo_chosen_by_verls_key_with_the_legacy_trainer(kit, tmp_path):
    """``python -m verl.trainer.main_ppo ... loss_mode=respo`` without our preset (test_cpu_verl_loss_mode.py checks the
    same loss in-process for every kernel loss), on verl's legacy trainer (``trainer.use_v1=false``)."""
    command = cpu_runs.main_ppo(
        "+device=cpu",
        "actor_rollout_ref.actor.policy_loss.loss_mode=respo",
        "algorithm.adv_estimator=grpo",
        "trainer.use_v1=false",
        *_job(4, 2),
        entry=cpu_runs.VERLS,
    )
    rc, out = cpu_runs.launch(tmp_path, command)
    assert rc == 0, out[-4000:]
    assert "respo-verl: loss_mode=respo with verl's PolicyLossConfig: the kernel uses the paper's defaults" in out
    lines = cpu_runs.log_lines(tmp_path)
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        assert "actor/respo/pos/log_w_mean" in line["data"] and "actor/respo/starved_mass_share" in line["data"]
    assert_trains(lines)
    # N = 4: updates 2..4 of each rollout batch are off-policy, and the loss sees it in either branch (with N = 2 a
    # step's stale half could hold no positive answer, or follow an update whose advantages were all zero).
    assert max(log_w(lines)) > 0, log_w(lines)
