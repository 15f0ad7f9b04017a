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
            "routing replay needs model_engine=megatron (actor_rollout_ref.actor.strategy=megatron), got "
            "actor_rollout_ref.actor.strategy=fsdp with actor_rollout_ref.actor.megatron.router_replay.mode=R2",
        ),
        (["algorithm=grpo", "routing=r3"], "routing replay needs model_engine=megatron"),
        (
            ["algorithm=respo", "run_guard.sampler_agreement=1e-12"],
            "run_guard.sampler_agreement must be one of stop, warn, off, got 1e-12",
        ),
        (["algorithm=respo", "run_guard.max_phase_s=0"], "run_guard.max_phase_s must be > 0, got 0"),
        (
            ["algorithm=respo", "+ray_kwargs.task_runner_resources={trainer_node:0}"],
            "ray_kwargs.task_runner_resources={'trainer_node': 0}: takes a map of Ray resource names to positive "
            "amounts, e.g. {trainer_node: 1}",
        ),
        (["algorithm=respo", "+ray_kwargs.task_runner_resources=head"], "ray_kwargs.task_runner_resources=head: "),
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
        ["algorithm=respo", "+ray_kwargs.task_runner_resources={trainer_node:1,memory_node:0.5}"],
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

    dense = build_kit(KitSpec(), progress=False)
    moe = build_kit(KitSpec(moe=True), progress=False)
    r2 = ("model_engine=megatron", "routing=r2")
    with pytest.raises(ValueError) as info:  # the layout rule router-replay, before Ray
        check_job(_model_job(dense.model, *r2))
    assert "router_replay.mode=R2 (routing replay) needs an MoE model" in str(info.value)
    assert "model_type 'qwen3'" in str(info.value) and "\n" not in str(info.value)
    check_job(_model_job(moe.model, *r2))
    check_job(_model_job(dense.model))  # no routing replay: dense is fine


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.train_batch_size=7"], "data.train_batch_size=7 is not a whole number of mini-batches"),
        (["actor_rollout_ref.model.path=/nonexistent/model"], "actor_rollout_ref.model.path=/nonexistent/model: no"),
        (
            ["run_guard.sampler_agreement=1e-12"],
            "run_guard.sampler_agreement must be one of stop, warn, off, got 1e-12",
        ),
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


# The layout rules (respo_verl.layout.rules) on every run: the entry point and the sweep refuse, before Ray, a layout
# megatron-core would refuse only once Ray is up and the model has loaded on the cluster.
MG = "actor_rollout_ref.actor.megatron"
BROKEN_LAYOUTS = [
    # EP 3 does not divide the world of 2 x 8 GPUs, nor the model's 128 experts.
    ([f"{MG}.expert_model_parallel_size=3"], {"expert-grid"}, {"experts-ep"}),
    # TP 3 divides neither the world nor the 32 heads and 4 KV groups.
    ([f"{MG}.tensor_model_parallel_size=3"], {"world-grid"}, {"heads-tp", "kv-groups-tp"}),
    # A world of 3 x 8 that EP 6 divides, but the 128 experts it does not: only the model's shape tells.
    ([f"{MG}.expert_model_parallel_size=6", "trainer.nnodes=3"], set(), {"experts-ep"}),
]


def _model_folder(tmp_path, model: str):
    """A folder holding the ``config.json`` of a shipped architecture (the planner's own facts), as a run's model."""
    import json

    from respo_verl.layout.models import SHIPPED_MODELS
    from respo_verl.tools.plan.build import hf_config_from_shape

    folder = tmp_path / model
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config_from_shape(SHIPPED_MODELS[model])))
    return folder


def _rules_named(message: str) -> set[str]:
    import re

    return set(re.findall(r"\[([a-z0-9-]+)\] ", message))


@pytest.mark.parametrize(("overrides", "without_model", "with_model"), BROKEN_LAYOUTS)
def test_a_broken_layout_is_refused_naming_each_rule(tmp_path, overrides, without_model, with_model):
    preset = ["algorithm=respo", "+cluster=qwen3_30b_a3b_h100_2x8", *overrides]
    model = f"actor_rollout_ref.model.path={_model_folder(tmp_path, 'qwen3_30b_a3b')}"
    for extra, rules in (([], without_model), ([model], without_model | with_model)):
        job = compose_job("respo", [*preset, *extra])
        if not rules:
            check_job(job)  # the model's shape is unknown here: the rules on it are left out
            continue
        with pytest.raises(ValueError) as info:
            check_job(job)
        assert _rules_named(str(info.value)) == rules and "\n" not in str(info.value), str(info.value)
        assert str(info.value).startswith("layout: ")


def test_a_hub_id_is_read_from_the_local_hugging_face_cache_only(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from respo_verl.layout.models import local_model_config

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # read when the module is imported
    assert local_model_config("Qwen/Qwen3-30B-A3B") is None  # not cached: nothing is downloaded
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen3-30B-A3B" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((_model_folder(tmp_path, "qwen3_30b_a3b") / "config.json").read_text())
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc123")  # as the hub writes it: no newline
    assert local_model_config("Qwen/Qwen3-30B-A3B") == snapshot / "config.json"
    job = compose_job(
        "respo",
        [
            "algorithm=respo",
            "+cluster=qwen3_30b_a3b_h100_2x8",
            "actor_rollout_ref.model.path=Qwen/Qwen3-30B-A3B",
            f"{MG}.expert_model_parallel_size=6",
            "trainer.nnodes=3",
        ],
    )
    with pytest.raises(ValueError, match=r"\[experts-ep\] 128 experts are not divisible by EP = 6"):
        check_job(job)


@pytest.mark.parametrize(
    ("overrides", "model"),
    [
        (["+device=cpu"], "dense"),
        (["+device=cpu", "+task=cpu_chain"], "dense"),  # the chain kit's model has the dense one's layers and heads
        (["+device=cpu_megatron", "model_engine=megatron", "routing=r2"], "moe"),
    ],
    ids=["cpu", "cpu_chain", "cpu_megatron"],
)
def test_the_cpu_presets_pass_the_layout_rules_with_their_model(overrides, model):
    """The cluster presets pass them in tests/tools/plan/test_cluster_presets.py (the job's rules there, and the
    planner's with each preset's model)."""
    from respo_verl.cpu.kit.build import KitSpec, build_kit
    from respo_verl.layout.models import job_model_shape

    kit = build_kit(KitSpec(moe=model == "moe"), progress=False)
    job = compose_job("respo", ["algorithm=respo", *overrides, f"actor_rollout_ref.model.path={kit.model}"])
    assert job_model_shape(job) is not None  # the rules on the model's shape ran too
    check_job(job)


@pytest.mark.parametrize("cfg", [[], ["--cfg", "job"]], ids=["run", "cfg-job"])
def test_the_entry_point_refuses_a_broken_layout_before_ray_in_one_line(tmp_path, cfg):
    import time

    argv = ["algorithm=respo", "+cluster=qwen3_30b_a3b_h100_2x8", f"{MG}.expert_model_parallel_size=3", *cfg]
    started = time.monotonic()
    proc = run_entry(argv, tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("respo_verl.main_ppo:")]
    assert len(lines) == 1 and lines[0].startswith("respo_verl.main_ppo: layout: 1 rule(s)"), proc.stderr[-3000:]
    assert "[expert-grid] expert grid ETP·EP·PP = 1·3·1 = 3 does not divide the world 16" in lines[0]
    assert "Traceback" not in proc.stderr and time.monotonic() - started < 60


def test_the_sweep_refuses_a_broken_layout_before_its_first_run(tmp_path, capsys):
    from respo_verl.cli import main as cli_main

    out = tmp_path / "sweep"
    argv = ["sweep", "--algos", "respo", "--reuse", "4", "--seeds", "0", "--preset", "qwen3_30b_a3b_h100_2x8"]
    broken = [f"{MG}.tensor_model_parallel_size=3"]
    for mode in (["--print"], []):  # printed for a scheduler, or run here: refused before either
        assert cli_main([*argv, *mode, "--out", str(out), "--", *broken]) == 2
        err = capsys.readouterr().err
        assert err.startswith("respo-verl sweep: run model-respo-n4-s0: ") and "\n" not in err.rstrip("\n"), err
        assert ": layout: 1 rule(s)" in err and "[world-grid] world 16 is not divisible by TP·PP·CP = 3·1·1" in err
        assert not out.exists()  # no manifest, no log: nothing started


@pytest.mark.parametrize("cfg", [[], ["--cfg", "job"]], ids=["run", "cfg-job"])
def test_the_entry_point_checks_a_job_once_and_a_run_is_composed_once(tmp_path, monkeypatch, cfg):
    """The run itself is replaced by a recorder (the fast tier starts no trainer): what is counted is how often the
    driver checks the job and composes it outside Hydra before it would start the run."""
    from respo_verl import main_ppo
    from respo_verl.run import compose

    calls = {"check": 0, "compose_job": 0, "run": 0}

    def counted(name, function):
        def call(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return call

    monkeypatch.setattr(main_ppo, "check", counted("check", main_ppo.check))
    monkeypatch.setattr(compose, "compose_job", counted("compose_job", compose.compose_job))
    monkeypatch.setattr(main_ppo, "run", counted("run", lambda config, job: None))
    proc = run_entry(["algorithm=respo", "+device=cpu", *cfg], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if cfg:  # Hydra prints the job and calls no task: the job is composed and checked before it
        assert calls == {"check": 1, "compose_job": 1, "run": 0}
        assert "actor_rollout_ref:" in proc.stdout
    else:  # Hydra composes the job, the task checks it once and runs it
        assert calls == {"check": 1, "compose_job": 0, "run": 1}
