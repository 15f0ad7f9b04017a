"""``python -m respo_verl.main_ppo``: verl's PPO trainer with ``algorithm`` as a config group.

Same run as ``python -m verl.trainer.main_ppo +algorithm=respo ...``; the differences are the primary config
(``conf/respo_trainer.yaml``, where ``algorithm=respo`` is a plain override and the default) and a preflight that,
once Ray is up, checks on every node that this package is importable and its losses are registered, so that a
cluster with a node missing the package stops before any model is loaded.
"""

from __future__ import annotations

import hydra
import ray
from omegaconf import DictConfig
from verl.trainer.main_ppo import TaskRunnerV1, run_ppo
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import validate_config
from verl.utils.device import auto_set_device

from respo_verl.verl.plugin import require_policy_loss
from respo_verl.verl.preflight import check_ray_nodes


class _PreflightTaskRunner:
    """Wraps verl's V1 TaskRunner actor class: runs the node preflight right before the runner starts."""

    @staticmethod
    def remote(*args, **kwargs):
        check_ray_nodes()
        return TaskRunnerV1.remote(*args, **kwargs)

    @staticmethod
    def options(*args, **kwargs):
        check_ray_nodes()
        return TaskRunnerV1.options(*args, **kwargs)


def run(config: DictConfig) -> None:
    """Validate ``config`` as verl's main_ppo does, then train with verl's V1 TaskRunner."""
    auto_set_device(config)
    require_policy_loss(config.actor_rollout_ref.actor.policy_loss.get("loss_mode", "vanilla"))
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    if not config.trainer.use_v1:
        raise ValueError("respo_verl.main_ppo runs verl's V1 trainer only; set trainer.use_v1=true")
    run_ppo(config, task_runner_class=_PreflightTaskRunner)
    if ray.is_initialized():
        ray.shutdown()


@hydra.main(config_path="conf", config_name="respo_trainer", version_base=None)
def main(config: DictConfig) -> None:
    run(config)


if __name__ == "__main__":
    main()
