"""`check_job` refuses invalid kernel hyperparameters and routing replay off the Megatron engine, in one line."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support.entry import run_entry

from respo_verl import algorithms
from respo_verl.run.compose import compose_job
from respo_verl.run.jobcheck import check_job

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
        "import sys; from omegaconf import OmegaConf; from respo_verl.run.jobcheck import check_job\n"
        "cfg = OmegaConf.create({'actor_rollout_ref': {'actor': {'policy_loss': {'respo': {'alpha_pos': 0.5}}}}})\n"
        "try:\n    check_job(cfg)\nexcept ValueError as exc:\n    print(exc)\n"
        "print(sorted(m for m in ('verl', 'hydra', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == [
        "actor_rollout_ref.actor.policy_loss.respo: ReSPOConfig.alpha_pos must be >= 1, got 0.5",
        "[]",
    ]


def test_a_rollout_batch_that_is_not_whole_mini_batches_is_refused():
    job = compose_job("respo", ["algorithm=respo", "data.train_batch_size=7", f"{LOSS[:-12]}.ppo_mini_batch_size=2"])
    with pytest.raises(ValueError) as info:
        check_job(job)
    assert str(info.value) == (
        "data.train_batch_size=7 is not a whole number of mini-batches of "
        "actor_rollout_ref.actor.ppo_mini_batch_size=2 (N = 3.5): make it a multiple"
    )


def _model_job(path, *overrides):
    return compose_job("respo", ["algorithm=respo", f"actor_rollout_ref.model.path={path}", *overrides])


def test_a_local_model_path_that_is_not_there_is_refused_and_a_hub_id_is_left_to_verl(tmp_path):
    from respo_verl.run.jobcheck import ModelCheckError, check_model

    with pytest.raises(ModelCheckError, match=rf"^actor_rollout_ref.model.path={tmp_path}/nope: no such file"):
        check_model(_model_job(tmp_path / "nope"))
    check_model(_model_job("Qwen/Qwen3-1.7B"))


def test_routing_replay_on_a_dense_model_is_refused():
    from respo_verl.cpu.kit.build import KitSpec, build_kit
    from respo_verl.run.jobcheck import ModelCheckError, check_model

    dense = build_kit(KitSpec(), progress=False)
    moe = build_kit(KitSpec(moe=True), progress=False)
    r2 = ("model_engine=megatron", "routing=r2")
    with pytest.raises(ModelCheckError) as info:
        check_model(_model_job(dense.model, *r2))
    assert "router_replay.mode=R2 (routing replay) needs an MoE model" in str(info.value)
    assert "model_type 'qwen3'" in str(info.value)
    check_model(_model_job(moe.model, *r2))
    check_model(_model_job(dense.model))  # no routing replay: dense is fine


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.train_batch_size=7"], "data.train_batch_size=7 is not a whole number of mini-batches"),
        (["actor_rollout_ref.model.path=/nonexistent/model"], "actor_rollout_ref.model.path=/nonexistent/model: no"),
    ],
)
def test_the_entry_point_refuses_them_in_one_line(tmp_path, overrides, message):
    proc = run_entry(["algorithm=respo", "+device=cpu", *overrides], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"respo_verl.main_ppo: {message}" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_a_local_cuda_job_on_a_machine_without_cuda_is_refused_before_ray(tmp_path, monkeypatch):
    """Without the CPU preset the job is a cuda job; its model is a local path that exists (the CPU kit's), so that
    the machine is the only thing wrong. Today's alternative: Ray waits for GPUs, silently."""
    from respo_verl.cpu.kit.build import KitSpec, build_kit

    kit = build_kit(KitSpec(), progress=False)
    argv = [
        "algorithm=respo", f"actor_rollout_ref.model.path={kit.model}",
        f"data.train_files={kit.train_files}", f"data.val_files={kit.val_files}",
    ]  # fmt: skip
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    proc = run_entry(argv, tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "respo_verl.main_ppo: trainer.device=cuda, but this machine's torch" in proc.stderr, proc.stderr[-3000:]
    assert "sees no CUDA device" in proc.stderr and "Traceback" not in proc.stderr
    # Sent to a cluster instead, the check is left to the per-node preflight.
    from omegaconf import OmegaConf

    from respo_verl.run.jobcheck import check_machine

    cluster = {"trainer": {"device": "cuda"}, "ray_kwargs": {"ray_init": {"address": "10.0.0.1"}}}
    check_machine(OmegaConf.create(cluster))
    check_machine(OmegaConf.create({"trainer": {"device": "cpu"}}))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "algorithm=respoo",
            f"algorithm=respoo: no such option of algorithm (one of {', '.join(algorithms.NAMES)})",
        ),
        ("+cluster=qwen3_30b", "cluster=qwen3_30b: no such option of cluster (one of qwen3_1p7b_h100_1x8, "),
        ("routing=r4", "routing=r4: no such option of routing (one of off, r2, r3)"),
    ],
)
def test_a_typo_in_a_config_group_is_one_line_exit_2(tmp_path, override, message):
    """Hydra's own report is 14-19 lines and lists verl's rollout_correction among the algorithms."""
    overrides = [override] if override.startswith("algorithm=") else ["algorithm=respo", override]
    for extra in ([], ["--cfg", "job"]):
        proc = run_entry([*overrides, *extra], tmp_path)
        assert proc.returncode == 2, proc.stderr[-3000:]
        lines = [line for line in proc.stderr.splitlines() if line.startswith("respo_verl.main_ppo:")]
        assert len(lines) == 1 and message in lines[0], proc.stderr[-3000:]
        assert "rollout_correction" not in proc.stderr and "Traceback" not in proc.stderr
