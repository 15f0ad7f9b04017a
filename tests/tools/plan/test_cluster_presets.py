"""Every cluster preset composes with both entry points, passes verl's validate_config and dataclass conversion,
stays out of the algorithm's keys, and is accepted by the planner."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
from conftest import compose
from omegaconf import OmegaConf
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import omega_conf_to_dataclass, validate_config
from verl.workers.config import FSDPActorConfig, FSDPEngineConfig, McoreActorConfig, McoreEngineConfig, RolloutConfig

from respo_verl.run.jobcheck import check_job
from respo_verl.tools.plan.cli import plan
from respo_verl.tools.plan.presets import PRESETS, shipped_presets

CONF = Path(__file__).resolve().parents[3] / "configs"
PRESET_NAMES = sorted(PRESETS)
# Keys owned by algorithm/*.yaml: a cluster preset must not set them.
ALGORITHM_OWNED = (
    "algorithm",
    "policy_loss",
    "loss_agg_mode",
    "clip_ratio",
    "clip_ratio_low",
    "clip_ratio_high",
    "clip_ratio_c",
    "use_kl_loss",
    "entropy_coeff",
    "ppo_epochs",
    "kl_loss_coef",
)


@cache
def _job(entry: str, preset: str, task: str = "dapo_math_overlong"):
    choice = "algorithm=respo" if entry == "respo" else "+algorithm=respo"
    return compose([choice, f"+cluster={preset}", f"+task={task}"], entry=entry)


def test_every_shipped_preset_has_planner_metadata():
    assert shipped_presets() == PRESET_NAMES


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_preset_composes_and_validates_with_both_entry_points(preset):
    jobs = {entry: _job(entry, preset) for entry in ("respo", "verl")}
    for cfg in jobs.values():
        check_job(cfg)  # what the run refuses before Ray, the layout rules included
        validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
        actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
        expected = McoreActorConfig if "30b" in preset else FSDPActorConfig
        assert type(actor) is expected
        # verl's worker renames the ref's log_prob_* keys before building the ref actor; its engine config is
        # converted as it stands.
        ref = cfg.actor_rollout_ref.ref
        ref_engine = omega_conf_to_dataclass(ref.megatron if "30b" in preset else ref.fsdp_config)
        assert type(ref_engine) is (McoreEngineConfig if "30b" in preset else FSDPEngineConfig)
        assert isinstance(omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout), RolloutConfig)
        assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "respo"  # the algorithm survives the preset
    assert OmegaConf.to_container(jobs["respo"], resolve=True) == OmegaConf.to_container(jobs["verl"], resolve=True)


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_planner_accepts_every_preset(preset):
    _, mem, violations, _ = plan(preset)
    expected = set(PRESETS[preset].refused_by)
    assert {v.rule for v in violations} == expected, [str(v) for v in violations]
    if not expected:
        assert 0 < mem.peak_gib <= mem.gpu_gib


def _keys(node, prefix=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield f"{prefix}{k}"
            yield from _keys(v, f"{prefix}{k}.")


def test_the_fully_reshardable_switch_reaches_verls_engine_config_with_both_entry_points():
    """``+respo_verl=fully_reshardable`` (configs/respo_verl/fully_reshardable.yaml) on a preset: verl's engine config
    takes it, with either entry point, and nothing else of the job changes."""
    for entry, choice in (("respo", "algorithm=respo"), ("verl", "+algorithm=respo")):
        plain = compose([choice, "+cluster=qwen3_30b_a3b_h100_2x8"], entry=entry)
        switched = compose([choice, "+cluster=qwen3_30b_a3b_h100_2x8", "+respo_verl=fully_reshardable"], entry=entry)
        check_job(switched)
        engine = omega_conf_to_dataclass(switched.actor_rollout_ref.actor.megatron)
        assert engine.dist_ckpt_optim_fully_reshardable and engine.distrib_optim_fully_reshardable_mem_efficient
        assert not omega_conf_to_dataclass(plain.actor_rollout_ref.actor.megatron).dist_ckpt_optim_fully_reshardable
        for key in ("dist_ckpt_optim_fully_reshardable", "distrib_optim_fully_reshardable_mem_efficient"):
            OmegaConf.update(switched, f"actor_rollout_ref.actor.megatron.{key}", False)
        assert OmegaConf.to_container(switched, resolve=True) == OmegaConf.to_container(plain, resolve=True)


@pytest.mark.parametrize(
    "path",
    sorted((CONF / "cluster").glob("*.yaml"))
    + sorted((CONF / "respo_verl").glob("qwen3*.yaml"))
    + [CONF / "respo_verl" / "protocol.yaml", CONF / "respo_verl" / "fully_reshardable.yaml"],
    ids=lambda p: p.stem,
)
def test_presets_leave_algorithm_keys_alone(path):
    keys = list(_keys(OmegaConf.to_container(OmegaConf.load(path))))
    owned = [k for k in keys if k.split(".")[-1] in ALGORITHM_OWNED or k.startswith("algorithm")]
    assert owned == [], f"{path.name} sets algorithm-owned keys {owned}"


def test_paper_layouts():
    h200 = _job("respo", "qwen3_30b_a3b_h200_1x8")
    mg = h200.actor_rollout_ref.actor.megatron
    assert (mg.tensor_model_parallel_size, mg.expert_model_parallel_size, mg.expert_tensor_parallel_size) == (2, 8, 1)
    assert mg.pipeline_model_parallel_size == 1 and not mg.param_offload and not mg.optimizer_offload
    assert mg.override_transformer_config.moe_router_dtype == "fp32"
    assert mg.override_transformer_config.moe_token_dispatcher_type == "flex"
    assert mg.override_transformer_config.recompute_granularity == "full"
    assert h200.actor_rollout_ref.rollout.tensor_model_parallel_size == 4
    assert h200.data.max_response_length == 8192
    # ref follows the actor's grid
    assert h200.actor_rollout_ref.ref.megatron.tensor_model_parallel_size == 2
    assert h200.actor_rollout_ref.ref.megatron.expert_model_parallel_size == 8
    small = _job("respo", "qwen3_1p7b_h100_1x8", "dapo_math")
    assert small.actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size == 2
    assert small.actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size == 2
    assert small.actor_rollout_ref.rollout.tensor_model_parallel_size == 2
    assert small.data.max_response_length == 15360


PAPER_30B = "qwen3_30b_a3b_h200_1x8_paper"


def test_the_paper_preset_is_the_papers_h200_settings():
    paper = _job("respo", PAPER_30B)
    actor, rollout = paper.actor_rollout_ref.actor, paper.actor_rollout_ref.rollout
    mg = actor.megatron
    assert (mg.tensor_model_parallel_size, mg.expert_model_parallel_size, mg.expert_tensor_parallel_size) == (2, 8, 1)
    assert mg.pipeline_model_parallel_size == 1 and rollout.tensor_model_parallel_size == 4
    assert not mg.param_offload and not mg.optimizer_offload
    assert not actor.optim.override_optimizer_config.get("optimizer_cpu_offload", False)
    assert rollout.gpu_memory_utilization == 0.85
    assert actor.ppo_max_token_len_per_gpu == rollout.log_prob_max_token_len_per_gpu == 18432
    # the runnable H200 preset differs from it in the vLLM fraction only
    runnable = OmegaConf.to_container(_job("respo", "qwen3_30b_a3b_h200_1x8"), resolve=True)
    record = OmegaConf.to_container(paper, resolve=True)
    assert runnable["actor_rollout_ref"]["rollout"].pop("gpu_memory_utilization") == 0.35
    record["actor_rollout_ref"]["rollout"].pop("gpu_memory_utilization")
    assert runnable == record


def test_the_1p7b_presets_are_the_papers_settings():
    for preset in ("qwen3_1p7b_h100_1x8", "qwen3_1p7b_h100_2x8"):
        cfg = _job("respo", preset, "dapo_math")
        actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
        assert actor.fsdp_config.model_dtype == "bf16"
        assert actor.ppo_max_token_len_per_gpu == rollout.log_prob_max_token_len_per_gpu == 32768
        assert rollout.gpu_memory_utilization == 0.75
        assert actor.fsdp_config.ulysses_sequence_parallel_size == 2 and rollout.tensor_model_parallel_size == 2


def test_the_one_node_h100_cpu_optimizer_is_precision_aware():
    cfg = _job("respo", "qwen3_30b_a3b_h100_1x8")
    optim = cfg.actor_rollout_ref.actor.optim
    assert optim.override_optimizer_config.optimizer_cpu_offload is True
    assert optim.use_precision_aware_optimizer is True


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_every_preset_header_says_how_it_relates_to_the_paper(preset):
    header = (CONF / "cluster" / f"{preset}.yaml").read_text().split("defaults:")[0]
    assert "paper" in header
    exact = preset in ("qwen3_30b_a3b_h200_1x8_paper", "qwen3_1p7b_h100_1x8")
    assert exact or "Differs from the paper" in header, header


def test_task_presets_set_the_dapo_reward():
    cfg = _job("verl", "qwen3_30b_a3b_h100_2x8")
    assert cfg.reward.reward_manager.name == "dapo"
    kwargs = OmegaConf.to_container(cfg.reward.reward_kwargs, resolve=True)
    assert kwargs == {
        "max_resp_len": 8192,
        "overlong_buffer_cfg": {"enable": True, "len": 4096, "penalty_factor": 1.0, "log": True},
    }
    val = cfg.actor_rollout_ref.rollout.val_kwargs
    assert (val.temperature, val.top_p, val.n, val.do_sample) == (1.0, 0.7, 16, True)
    plain = _job("respo", "qwen3_1p7b_h100_1x8", "dapo_math")
    assert plain.reward.reward_kwargs.overlong_buffer_cfg.enable is False


# --- checkpoints -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_every_preset_saves_every_32_updates_into_a_folder_of_its_own(preset):
    cfg = _job("respo", preset)
    reuse = cfg.data.train_batch_size // cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    assert cfg.trainer.save_freq == max(1, 32 // reuse) > 0
    assert cfg.trainer.resume_mode == "auto" and cfg.trainer.max_actor_ckpt_to_keep == 2
    folder = Path(cfg.trainer.default_local_dir)
    assert folder.is_absolute() and folder.name == cfg.trainer.experiment_name
    assert cfg.trainer.experiment_name.endswith(f"-respo-n{reuse}-s{cfg.actor_rollout_ref.rollout.seed}")


def test_runs_that_differ_in_algorithm_n_seed_or_routing_get_different_folders():
    preset = "qwen3_30b_a3b_h200_1x8"
    base = ["+cluster=" + preset, "+task=dapo_math_overlong", "actor_rollout_ref.model.path=/m/Qwen3-30B-A3B-Base"]
    variants = {
        "respo": ["algorithm=respo"],
        "vespo": ["algorithm=vespo"],
        "grpo": ["algorithm=grpo"],
        "n16": ["algorithm=respo", "data.train_batch_size=512"],
        "seed2": ["algorithm=respo", "actor_rollout_ref.rollout.seed=2"],
        "r3": ["algorithm=respo", "routing=r3"],
    }
    folders = {k: compose([*v, *base], entry="respo").trainer.default_local_dir for k, v in variants.items()}
    assert len(set(folders.values())) == len(folders), folders
    assert folders["respo"].endswith("/respo_verl/Qwen3-30B-A3B-Base-respo-n8-s42")
    assert folders["r3"].endswith("/Qwen3-30B-A3B-Base-respo-n8-s42-r3") and folders["grpo"].endswith("-grpo-n8-s42")


def test_checkpoint_root_follows_the_environment(monkeypatch):
    monkeypatch.setenv("RESPO_VERL_CHECKPOINTS", "/scratch/ckpt")
    cfg = compose(["algorithm=respo", "+cluster=qwen3_1p7b_h100_1x8", "+task=dapo_math_overlong"], entry="respo")
    assert cfg.trainer.default_local_dir == f"/scratch/ckpt/respo_verl/{cfg.trainer.experiment_name}"
    assert "-respo-n" in cfg.trainer.experiment_name


def test_the_planner_prints_the_checkpoint_cost(capsys):
    from respo_verl.tools.plan.cli import main

    assert main(["qwen3_30b_a3b_h200_1x8", "data.train_batch_size=512"]) == 0  # N = 16
    out = " ".join(capsys.readouterr().out.split())
    # 30.53 B parameters x (2 bytes bf16 weights + 12 bytes fp32 main parameters and Adam moments)
    assert (
        "checkpoints: every 2 training steps (32 optimizer updates) and at the last; 427 GB each, 2 kept: 855 GB" in out
    )
    assert main(["qwen3_1p7b_h100_1x8", "trainer.save_freq=-1"]) in (0, 1)
    assert "checkpoints: OFF (trainer.save_freq=-1)" in capsys.readouterr().out


# --- the GPU stack ---------------------------------------------------------------------------------------------------

MEGATRON_PRESETS = [p for p in PRESET_NAMES if "30b" in p]
ALLTOALL = "actor_rollout_ref.actor.megatron.override_transformer_config.moe_token_dispatcher_type=alltoall"


def test_the_megatron_presets_are_the_30b_ones():
    assert MEGATRON_PRESETS and all(_job("respo", p).model_engine == "megatron" for p in MEGATRON_PRESETS)


@pytest.mark.parametrize("preset", MEGATRON_PRESETS)
def test_every_megatron_preset_builds_through_mbridge(preset):
    """verl 0.9.1 builds through Megatron-Bridge unless vanilla_mbridge is true: the presets say mbridge, for the actor
    and the ref, and verl's engine dataclasses keep it."""
    for entry in ("respo", "verl"):
        cfg = _job(entry, preset)
        for role in ("actor", "ref"):
            mg = cfg.actor_rollout_ref[role].megatron
            assert mg.use_mbridge is True and mg.vanilla_mbridge is True, (entry, role)
        with pytest.warns(FutureWarning, match="vanilla_mbridge"):  # verl 0.9.1 marks the mbridge path deprecated
            engine = omega_conf_to_dataclass(cfg.actor_rollout_ref.ref.megatron)
        assert engine.use_mbridge and engine.vanilla_mbridge
    raw = OmegaConf.load(CONF / "respo_verl" / "qwen3_30b_a3b_megatron.yaml")
    assert raw.actor_rollout_ref.actor.megatron.vanilla_mbridge is True  # set, not left to verl's default (false)


@pytest.mark.parametrize("preset", MEGATRON_PRESETS)
def test_every_megatron_preset_runs_deepep_and_composes_with_alltoall(preset):
    tf = _job("respo", preset).actor_rollout_ref.actor.megatron.override_transformer_config
    assert (tf.moe_token_dispatcher_type, tf.moe_flex_dispatcher_backend) == ("flex", "deepep")  # the paper's
    cfg = compose(["algorithm=respo", f"+cluster={preset}", "+task=dapo_math_overlong", ALLTOALL], entry="respo")
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    for role in ("actor", "ref"):  # the ref follows the actor's override_transformer_config
        assert cfg.actor_rollout_ref[role].megatron.override_transformer_config.moe_token_dispatcher_type == "alltoall"
    assert type(omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)) is McoreActorConfig
    violations = plan(preset, [ALLTOALL])[2]  # the planner takes the override as it takes the preset
    assert {v.rule for v in violations} == set(PRESETS[preset].refused_by), [str(v) for v in violations]
