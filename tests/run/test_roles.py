"""The one table of a run's roles (:mod:`respo_verl.run.roles`): the modules that name roles read it, and each
spelling of verl's in it (a class, a trainer attribute, a step timer's label) is in verl 0.9.1's installed source, so
that a rename in verl fails here instead of leaving a stale copy."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import SimpleNamespace

from respo_verl.run import hooks, liveness, nodes, roles, stops, watchdog
from respo_verl.run.roles import (
    PROCESS_TITLES,
    ROLE,
    ROLES,
    SAMPLE_PHASES,
    TIMED_PHASES,
    UPDATE_WORKER,
    VALIDATION,
    actor_role,
)


def _file(module: str) -> Path:
    """The source file of an installed module or package, found without importing it (verl's trainer imports
    megatron-core)."""
    top, *rest = module.split(".")
    path = Path(importlib.util.find_spec(top).submodule_search_locations[0]).joinpath(*rest)
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _source(*packages: str) -> str:
    """The Python source of the installed ``packages``, one text."""
    return "\n".join(p.read_text() for package in packages for p in sorted(_file(package).parent.rglob("*.py")))


def test_the_modules_that_name_roles_read_the_one_table():
    assert stops.actor_role is roles.actor_role and watchdog.SAMPLE_PHASES is SAMPLE_PHASES
    assert nodes._RANK is ROLE[UPDATE_WORKER].actor_name and nodes._SERVER is ROLE[roles.ROLLOUT_SERVER].actor_name
    assert SAMPLE_PHASES == (TIMED_PHASES["gen"][0], VALIDATION)
    assert all(set(waits_on) <= set(ROLE) for _, waits_on in TIMED_PHASES.values())
    # generation waits on exactly the actors that the liveness check watches while a step waits for its samples
    assert roles.GENERATION_ACTORS == tuple(r.name for r in ROLES if r.attribute and not r.worker_group)


def test_each_class_end_names_its_role_whatever_the_order_of_the_table():
    ends = [(end, role.name) for role in ROLES for end in role.classes]
    for end, name in ends:
        assert actor_role(f"module.<locals>.Prefixed{end}") == name
        assert not [other for other, who in ends if who != name and other.endswith(end)], end
    assert actor_role("SomethingElse") is None


def test_the_liveness_check_finds_each_role_where_the_table_says_verls_trainer_holds_it():
    trainer = SimpleNamespace()
    for role in ROLES:
        if role.attribute:
            *path, last = role.attribute.split(".")
            holder = trainer
            for part in path:
                holder = vars(holder).setdefault(part, SimpleNamespace())
            setattr(holder, last, SimpleNamespace(world_size=3) if role.worker_group else [role.name] * 2)
    found = liveness.watched_actors(trainer)
    assert found == [(r.name, [r.name] * 2) for r in ROLES if r.attribute and not r.worker_group]
    assert liveness.waits_on(trainer, UPDATE_WORKER, roles.CRITIC_WORKER) == "3 update workers, 3 critic workers"


def test_every_spelling_of_verls_in_the_table_is_in_verls_source():
    """The labels of the step timers in the modules whose timers :func:`respo_verl.run.hooks.phase_timers` patches,
    the classes (verl's, TransferQueue's, or respo-verl's CPU rollout server), and the trainer's attributes."""
    timed = "\n".join(_file(module).read_text() for module in hooks.TIMED_MODULES)
    for label in TIMED_PHASES:
        assert f'marked_timer("{label}"' in timed, f"verl 0.9.1 times no phase {label!r}"
    classes = set(re.findall(r"^\s*class (\w+)", _source("verl", "transfer_queue", "respo_verl"), re.M))
    for end, _ in roles.ACTOR_ROLES:
        assert any(name.endswith(end) for name in classes), f"no class ends in {end!r}"
    verl = _source("verl")
    for role in ROLES:
        for part in role.attribute.split(".") if role.attribute else ():
            assert f"self.{part} =" in verl, f"verl's objects have no attribute {part!r} ({role.name})"


def test_a_role_process_title_is_a_ray_actor_of_a_role_or_a_vllm_engine_core():
    for end, _ in roles.ACTOR_ROLES:
        assert PROCESS_TITLES.match(f"ray::{end}.run") and PROCESS_TITLES.match(f"ray::vLLM{end} extra")
    assert PROCESS_TITLES.match("VLLM::EngineCore")
    for other in ("ray::IDLE", "ray::WorkerDictionary", "python -m ray::WorkerDict", "ray::dashboard"):
        assert not PROCESS_TITLES.match(other), other
