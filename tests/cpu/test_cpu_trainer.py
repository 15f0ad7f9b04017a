"""verl's own trainer on CPU, end to end: ``main_ppo`` with the ``+device=cpu`` preset, as a user runs it.

Each run is a real ``python -m ... main_ppo`` subprocess (tests/support/cpu_runs.py): Ray, TransferQueue, the agent
loop, the hf_cpu rollout server, FSDP2 on gloo, verl's naive weight sync and verl's file logger. Nothing is mocked;
one run injects a fault (NaN log-probabilities reaching the registered loss) through a module loaded in the Ray
workers.

Two runs here: verl's own entry point, trained once (the loss chosen by verl's own key, verl's legacy trainer), and
the non-finite stop. ReSPO through our entry point with rollout reuse is checked on the uninterrupted reference run
of test_cpu_resume.py, VESPO through the trainer on the real sweep of tests/tools/sweep/test_sweep_cpu.py, and the
negative controls of the weight sync and of log W on the stale-server run of test_cpu_stops.py.
"""

from __future__ import annotations

import pytest
from support import cpu_runs
from support.trainer_checks import assert_trains, log_w

from respo_verl.cpu.kit.build import KitSpec, build_kit
from respo_verl.run.stops import EXIT_GUARD

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


def test_nonfinite_log_probs_stop_the_run_with_the_loss_error(kit, tmp_path):
    command = cpu_runs.command(
        tmp_path / "ckpt", 2, 2, "trainer.save_freq=-1", *cpu_runs.extra_modules("inject_nonfinite")
    )
    rc, out = cpu_runs.launch(tmp_path, command)
    assert rc == EXIT_GUARD, out[-4000:]
    # one line naming the step and the loss's refusal, and no traceback after it
    cpu_runs.stop_line(
        out,
        r"\(non-finite data, exit 3\): step 1: FloatingPointError: respo loss received non-finite values on valid "
        r"response tokens.*",
    )
    assert cpu_runs.log_lines(tmp_path) == []  # no step was logged: the run did not train on
