"""`check_job` refuses invalid kernel hyperparameters and routing replay off the Megatron engine, in one line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from respo_verl.verl.compose import compose_job
from respo_verl.verl.jobcheck import check_job

LOSS = "actor_rollout_ref.actor.policy_loss"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["algorithm=respo", f"{LOSS}.respo.alpha_pos=0.5"],
            f"{LOSS}.respo: ReSPOConfig.alpha_pos must be >= 1, got 0.5",
        ),
        (["algorithm=respo", f"{LOSS}.respo.beta_neg=0"], "ReSPOConfig.beta_neg must be in (0, 1], got 0.0"),
        (["algorithm=vespo", f"{LOSS}.vespo.k_neg=-1"], f"{LOSS}.vespo: VESPOConfig.k_neg must be >= 0, got -1.0"),
        (["algorithm=vespo", f"{LOSS}.vespo.log_w_clip=abc"], "VESPOConfig.log_w_clip must be a number, got 'abc'"),
        (
            ["algorithm=respo", "model_engine=dp", "routing=r2"],
            "routing replay needs model_engine=megatron, got model_engine=dp "
            "with actor_rollout_ref.actor.megatron.router_replay.mode=R2",
        ),
        (["algorithm=grpo", "routing=r3"], "routing replay needs model_engine=megatron"),
    ],
)
def test_bad_jobs_are_refused_with_one_line(overrides, message):
    with pytest.raises(ValueError) as info:
        check_job(compose_job("respo", overrides))
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm=respo"],
        ["algorithm=vespo", "model_engine=megatron", "routing=r2"],
        ["algorithm=gspo", "model_engine=megatron", "routing=r3"],
        ["algorithm=grpo", "routing=off"],
        ["algorithm=respo", f"{LOSS}.respo.alpha_neg=3", f"{LOSS}.respo.lambda_pos=0"],
    ],
)
def test_valid_jobs_pass(overrides):
    check_job(compose_job("respo", overrides))


def test_checking_a_job_imports_neither_verl_nor_torch():
    code = (
        "import sys; from omegaconf import OmegaConf; from respo_verl.verl.jobcheck import check_job\n"
        "cfg = OmegaConf.create({'actor_rollout_ref': {'actor': {'policy_loss': {'respo': {'alpha_pos': 0.5}}}}})\n"
        "try:\n    check_job(cfg)\nexcept ValueError as exc:\n    print(exc)\n"
        "print(sorted(m for m in ('verl', 'hydra', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == [
        "actor_rollout_ref.actor.policy_loss.respo: ReSPOConfig.alpha_pos must be >= 1, got 0.5",
        "[]",
    ]
