"""The job's one typed view (respo_verl.run.jobcheck.Job): each fact read from its one key, the routing replay keys held
to agree before Ray."""

from __future__ import annotations

from pathlib import PurePosixPath

import pytest
from conftest import compose
from support.entry import run_entry

from respo_verl.routing.mode import REPLAY_KEY
from respo_verl.run.guards import GuardConfig
from respo_verl.run.jobcheck import REF_REPLAY_KEY, ROLLOUT_REPLAY_KEY, Job
from respo_verl.run.resolvers import run_name

MEGATRON_R3 = ["algorithm=respo", "model_engine=megatron", "routing=r3"]


def test_the_view_of_a_megatron_r3_job():
    batch = ["data.train_batch_size=96", "actor_rollout_ref.actor.ppo_mini_batch_size=32"]
    ray = "+ray_kwargs.task_runner_resources={trainer_node:1}"
    cfg = compose([*MEGATRON_R3, "+cluster=qwen3_30b_a3b_h100_1x8", *batch, "run_guard.max_phase_s=60", ray])
    job = Job.of(cfg)
    assert (job.backend, job.replay, job.layout.replay, job.reuse) == ("megatron", "r3", "r3", 3)
    assert job.guard == GuardConfig(**{**cfg.run_guard, "max_phase_s": 60.0})
    assert job.respo_trainer and job.trainer_resources == {"trainer_node": 1.0}
    model = PurePosixPath(cfg.actor_rollout_ref.model.path).name
    assert job.run_name == run_name(model, "respo", 3, cfg.actor_rollout_ref.rollout.seed, "r3")


@pytest.mark.parametrize(
    ("overrides", "backend"),
    [
        (["model_engine=megatron"], "megatron"),
        (["model_engine=dp"], "fsdp"),
        # the Megatron CPU preset sets the actor's strategy without model_engine: the strategy is what verl runs
        (["+device=cpu_megatron"], "megatron"),
        (["+device=cpu", "model_engine=megatron"], "fsdp"),
    ],
)
def test_the_actors_strategy_alone_decides_the_engine(overrides, backend):
    job = Job.of(compose(["algorithm=respo", *overrides]))
    assert job.backend == job.layout.backend == backend


def test_routing_replay_off_the_megatron_engine_is_refused_and_the_legacy_trainer_is_not_ours():
    with pytest.raises(ValueError, match=r"^routing replay needs model_engine=megatron \(actor_rollout_ref\.actor"):
        Job.of(compose(["algorithm=respo", "model_engine=dp", "routing=r2"]))
    assert not Job.of(compose(["algorithm=respo", "trainer.use_v1=false"])).respo_trainer


@pytest.mark.parametrize(
    ("routing", "override", "values"),
    [
        ("r3", f"{REF_REPLAY_KEY}=disabled", ("R3", "disabled", "true")),
        ("r3", f"{ROLLOUT_REPLAY_KEY}=false", ("R3", "R3", "false")),
        ("r2", f"{ROLLOUT_REPLAY_KEY}=true", ("R2", "R2", "true")),
        ("r2", f"{REF_REPLAY_KEY}=R3", ("R2", "R3", "false")),
        ("off", f"{REPLAY_KEY}=R3", ("R3", "disabled", "false")),
    ],
)
def test_routing_replay_keys_that_disagree_are_named_with_their_values(routing, override, values):
    cfg = compose(["algorithm=respo", "model_engine=megatron", f"routing={routing}", override])
    with pytest.raises(ValueError) as info:
        Job.of(cfg)
    named = ", ".join(f"{k}={v}" for k, v in zip((REPLAY_KEY, REF_REPLAY_KEY), values[:2], strict=True))
    assert str(info.value).startswith(f"routing replay: {named} and {ROLLOUT_REPLAY_KEY}={values[2]} disagree: ")


def test_the_entry_point_refuses_disagreeing_replay_keys_before_ray(tmp_path):
    proc = run_entry([*MEGATRON_R3, f"{ROLLOUT_REPLAY_KEY}=false"], tmp_path)  # the fast tier refuses ray.init
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"respo_verl.main_ppo: routing replay: {REPLAY_KEY}=R3, "), line
