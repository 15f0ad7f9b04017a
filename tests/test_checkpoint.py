"""Checkpoints that know their run, the run-identity resolvers, and the step guards of the respo-verl trainer.

Everything here is the real code on real files and configurations; the trainer's use of it runs end to end in
tests/cpu/test_cpu_resume.py.
"""

from __future__ import annotations

import json
import os

import pytest
from omegaconf import OmegaConf

from respo_verl import checkpoint
from respo_verl.checkpoint import CheckpointError, identity, plan_resume, write_marker_info
from respo_verl.run import resolvers
from respo_verl.run.guards import (
    FAILED_SAMPLES_KEY,
    FAILED_SHARE_KEY,
    STOPPED_KEY,
    GuardConfig,
    StepGuards,
    failed_sample_metrics,
)
from respo_verl.run.stops import RunStopped


def _cfg(folder, train_batch_size=8, mini=2, seed=0, **trainer):
    """A job on one node of two GPUs (FSDP, verl's default engine); ``trainer`` overrides trainer keys."""
    return OmegaConf.create(
        {
            "data": {"train_batch_size": train_batch_size},
            "actor_rollout_ref": {
                "actor": {"ppo_mini_batch_size": mini, "policy_loss": {"loss_mode": "respo"}},
                # as verl's config: the rollout's copy of the GPUs per node follows the trainer's
                "rollout": {"n": 4, "seed": seed, "n_gpus_per_node": "${trainer.n_gpus_per_node}"},
                "model": {"path": "/models/Qwen3-1.7B"},
            },
            "trainer": {
                "default_local_dir": str(folder),
                "resume_mode": "auto",
                "total_training_steps": 10,
                "nnodes": 1,
                "n_gpus_per_node": 2,
                **trainer,
            },
            "run_guard": {"enable": True},
        }
    )


# A checkpoint's files: one larger than both ends the check reads, one smaller than one end.
FILES = {"actor/optim_world_size_1_rank_0.pt": bytes(range(256)) * 1024, "data.pt": b"loader state"}


def _save(folder, step, cfg, marker=True, listed=True):
    """A checkpoint folder as the trainer leaves it: its files written, then its marker, which lists them (a marker
    of an older version, ``listed=False``, has no list)."""
    path = folder / f"global_step_{step}"
    path.mkdir(parents=True)
    for name, data in FILES.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    if marker:
        files = {"files": checkpoint.manifest(path)} if listed else {}
        write_marker_info(path, {**identity(cfg), "step": step, **files})
    (folder / checkpoint.TRACKER).write_text(str(step))
    return path


# --- resolvers -----------------------------------------------------------------------------------------------------


def test_run_name_carries_model_algorithm_n_seed_and_routing():
    assert resolvers.run_name("cpu-moe", "respo", 2, 0, "r3") == "cpu-moe-respo-n2-s0-r3"
    assert resolvers.run_name("m", "vespo", 8, 1, "off") == resolvers.run_name("m", "vespo", 8, 1) == "m-vespo-n8-s1"
    with pytest.raises(ValueError, match=r"routing must be one of off, r2, r3, got 'R3'"):
        resolvers.run_name("m", "respo", 8, 1, "R3")


def test_a_jobs_run_name_is_the_scheme_with_the_model_folder_and_the_loss_modes_algorithm():
    assert resolvers.job_run_name("respo", 64, 16, 1, "/m/Qwen3-30B-A3B/", "R3") == "Qwen3-30B-A3B-respo-n4-s1-r3"
    assert resolvers.job_run_name("vanilla", 64, 2, 7, "Qwen/Qwen3-1.7B") == "Qwen3-1.7B-grpo-n32-s7"
    assert resolvers.job_run_name("gspo", 64, 64, 0, "m", "disabled") == "m-gspo-n1-s0"


def test_save_freq_is_a_fixed_number_of_updates_and_at_least_every_step():
    assert resolvers.save_freq(32, 64, 16) == 8  # N = 4
    assert resolvers.save_freq(32, 64, 2) == 1  # N = 32
    assert resolvers.save_freq(32, 512, 8) == 1  # N = 64: still every step


def test_resolvers_refuse_a_batch_that_is_not_whole_mini_batches():
    with pytest.raises(ValueError, match=r"data.train_batch_size=10 .* actor_rollout_ref.actor.ppo_mini_batch_size=4"):
        resolvers.save_freq(32, 10, 4)


def test_resolvers_resolve_in_a_composed_config():
    resolvers.register()
    resolvers.register()  # idempotent
    cfg = OmegaConf.create({"a": 64, "b": 8, "f": "${respo_verl.save_freq:32,${a},${b}}"})
    assert cfg.f == 4


# --- plan_resume ---------------------------------------------------------------------------------------------------


def test_a_fresh_folder_starts_from_scratch(tmp_path):
    plan = plan_resume(_cfg(tmp_path / "missing"))
    assert plan.resume_from is None and not plan.warnings


def test_resume_from_the_runs_own_checkpoint_with_per_attempt_keys_changed(tmp_path):
    first = _cfg(tmp_path, total_training_steps=4, save_freq=1)
    path = _save(tmp_path, 2, first)
    again = _cfg(tmp_path, total_training_steps=9, save_freq=3, logger=["console", "file"])
    again.run_guard.max_failed_share = 0.5
    assert checkpoint.fingerprint(first) == checkpoint.fingerprint(again)
    plan = plan_resume(again)
    assert plan.resume_from == path and not plan.warnings


def test_a_checkpoint_of_another_configuration_is_refused_naming_both(tmp_path):
    _save(tmp_path, 3, _cfg(tmp_path, train_batch_size=8))  # N = 4
    with pytest.raises(CheckpointError) as err:
        plan_resume(_cfg(tmp_path, train_batch_size=4))  # N = 2
    message = str(err.value)
    assert "\n" not in message
    assert "global_step_3 belongs to another run (respo N=4 (train_batch_size 8" in message
    assert "this run is respo N=2 (train_batch_size 4" in message
    assert "data.train_batch_size: 8 -> 4" in message
    assert "trainer.experiment_name" in message and "resume_mode=disable" in message


def test_another_seed_is_another_run(tmp_path):
    _save(tmp_path, 1, _cfg(tmp_path, seed=1))
    with pytest.raises(CheckpointError, match=r"actor_rollout_ref.rollout.seed: 1 -> 2"):
        plan_resume(_cfg(tmp_path, seed=2))


def test_a_half_written_newest_checkpoint_is_skipped_loudly(tmp_path):
    cfg = _cfg(tmp_path)
    complete = _save(tmp_path, 2, cfg)
    _save(tmp_path, 3, cfg, marker=False)  # verl wrote its tracker, the marker never came
    plan = plan_resume(cfg)
    assert plan.resume_from == complete
    assert len(plan.warnings) == 1 and "HALF-WRITTEN CHECKPOINT" in plan.warnings[0]
    assert "global_step_3" in plan.warnings[0] and "resuming from global_step_2" in plan.warnings[0]


def test_checkpoints_without_markers_resume_as_verl_would_with_a_warning(tmp_path):
    cfg = _cfg(tmp_path)
    path = _save(tmp_path, 4, cfg, marker=False)
    plan = plan_resume(cfg)
    assert plan.resume_from == path
    assert "has no respo_verl_run.json" in plan.warnings[0] and "cannot be checked" in plan.warnings[0]


def test_the_marker_lists_every_file_with_its_size_and_check(tmp_path):
    path = _save(tmp_path, 2, _cfg(tmp_path))
    listed = json.loads((path / checkpoint.MARKER).read_text())["files"]
    assert sorted(listed) == sorted(FILES)  # the marker itself is not listed
    assert listed["data.pt"]["size"] == len(b"loader state") and listed["actor/optim_world_size_1_rank_0.pt"]["size"]
    assert checkpoint.verify(path, listed) is None


def test_the_check_reads_both_ends_of_a_file(tmp_path):
    big = tmp_path / "big"
    big.write_bytes(b"a" * (4 * checkpoint.CHECK_BYTES))
    before = checkpoint.file_check(big)
    with big.open("r+b") as fh:
        fh.seek(2 * checkpoint.CHECK_BYTES)
        fh.write(b"b")  # the middle: not read, the size is the same
    assert checkpoint.file_check(big) == before
    with big.open("r+b") as fh:
        fh.seek(-1, 2)
        fh.write(b"b")  # the last byte: read
    assert checkpoint.file_check(big) != before


@pytest.mark.parametrize("damage", ["truncated", "missing", "changed", "unreadable"])
def test_a_damaged_newest_checkpoint_is_refused_naming_the_file_and_the_way_out(tmp_path, damage):
    cfg = _cfg(tmp_path)
    _save(tmp_path, 1, cfg)
    before = _save(tmp_path, 2, cfg)
    newest = _save(tmp_path, 3, cfg)
    optim = newest / "actor" / "optim_world_size_1_rank_0.pt"
    size = optim.stat().st_size
    if damage == "truncated":
        with optim.open("r+b") as fh:
            fh.truncate(size // 2)
    elif damage == "missing":
        optim.unlink()
    elif damage == "changed":
        optim.write_bytes(b"x" * size)
    else:
        optim.chmod(0)
        if os.access(optim, os.R_OK):
            pytest.skip("this user reads files whatever their mode (root)")
    with pytest.raises(CheckpointError) as err:
        plan_resume(cfg)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"DAMAGED CHECKPOINT {newest}: {optim}")
    assert {
        "truncated": f"has {size // 2} bytes, the save wrote {size}",
        "missing": "is missing",
        "changed": "first and last 64 KiB differ from what the save wrote",
        "unreadable": "cannot be read: Permission denied",
    }[damage] in message
    override = f"trainer.resume_mode=resume_path trainer.resume_from_path={before}"
    assert message.endswith(f"to resume from global_step_2, the newest intact checkpoint before it, add {override}")
    # the override it names: the checkpoint it names is verified, and the trainer resumes from it as verl does
    again = _cfg(tmp_path, resume_mode="resume_path", resume_from_path=str(before))
    assert plan_resume(again).resume_from is None
    with pytest.raises(CheckpointError, match=r"DAMAGED CHECKPOINT .*global_step_3 \(trainer.resume_from_path\)"):
        plan_resume(_cfg(tmp_path, resume_mode="resume_path", resume_from_path=str(newest)))


def test_the_way_out_skips_damaged_checkpoints_before_the_newest(tmp_path):
    cfg = _cfg(tmp_path)
    _save(tmp_path, 1, cfg)
    (_save(tmp_path, 2, cfg) / "data.pt").unlink()
    (_save(tmp_path, 3, cfg) / "data.pt").unlink()
    with pytest.raises(CheckpointError, match=r"global_step_3/data.pt is missing; to resume from global_step_1,"):
        plan_resume(cfg)
    (tmp_path / "global_step_1" / "data.pt").unlink()
    with pytest.raises(CheckpointError, match=r"no intact checkpoint before it: set trainer.resume_mode=disable"):
        plan_resume(cfg)


def test_a_marker_without_a_file_list_is_accepted_with_a_note(tmp_path):
    cfg = _cfg(tmp_path)
    path = _save(tmp_path, 2, cfg, listed=False)  # a marker as markers were before they listed files
    plan = plan_resume(cfg)
    assert plan.resume_from == path
    assert plan.warnings == (
        f"{path} was saved before checkpoints listed their files (its {checkpoint.MARKER} has none): its files are "
        "not verified; resuming from it",
    )


def test_resume_disabled_ignores_the_folder(tmp_path):
    _save(tmp_path, 1, _cfg(tmp_path, train_batch_size=8))
    assert plan_resume(_cfg(tmp_path, train_batch_size=4, resume_mode="disable")).resume_from is None


def test_the_marker_is_complete_json(tmp_path):
    cfg = _cfg(tmp_path)
    path = _save(tmp_path, 1, cfg)
    info = json.loads((path / checkpoint.MARKER).read_text())
    assert info["fingerprint"] == checkpoint.fingerprint(cfg) and info["summary"]["N"] == 4 and info["step"] == 1
    assert not list(path.glob(f".{checkpoint.MARKER}.*"))  # no temporary file left beside it


# --- the layout, compared apart --------------------------------------------------------------------------------------

MEGATRON = "actor_rollout_ref.actor.megatron"


def _mcore_cfg(folder, tp=1, ep=2, fully_reshardable=False, distributed=True, lr=1e-3, **trainer):
    """A Megatron job (MoE, routing replay R3), the reference following the actor's layout as in verl's config."""
    megatron = {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": 1,
        "virtual_pipeline_model_parallel_size": None,
        "context_parallel_size": 1,
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": None,
        "use_distributed_optimizer": distributed,
        "dist_ckpt_optim_fully_reshardable": fully_reshardable,
    }
    ref = {key: f"${{{MEGATRON}.{key}}}" for key in megatron}
    megatron["router_replay"] = {"mode": "R3"}
    node = {"strategy": "megatron", "megatron": megatron, "optim": {"lr": lr}}
    return OmegaConf.merge(_cfg(folder, **trainer), {"actor_rollout_ref": {"actor": node, "ref": {"megatron": ref}}})


def _hf_weights(checkpoint_path):
    """The HF copy of the weights verl's Megatron checkpoint manager saves (``model`` in save_contents)."""
    hf = checkpoint_path / "actor" / "model" / "huggingface"
    hf.mkdir(parents=True)
    (hf / "model.safetensors").write_bytes(b"weights")
    return hf


def _overrides(line, after):
    """The ``key=value`` overrides a refusal names after ``after``, up to the closing parenthesis."""
    return line.split(after, 1)[1].split(")", 1)[0].split()


def test_the_marker_records_the_layout_and_the_fingerprint_leaves_it_out(tmp_path):
    cfg = _mcore_cfg(tmp_path, tp=1, ep=2, nnodes=2, n_gpus_per_node=4)
    info = json.loads((_save(tmp_path, 1, cfg) / checkpoint.MARKER).read_text())
    assert info["layout"] == {
        "backend": "megatron",
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "virtual_pipeline_model_parallel_size": None,
        "context_parallel_size": 1,
        "expert_model_parallel_size": 2,
        "expert_tensor_parallel_size": 1,  # null: megatron takes TP
        "data_parallel_size": 8,  # 2 nodes × 4 GPUs / (TP × PP × CP)
        "nnodes": 2,
        "n_gpus_per_node": 4,
        "use_distributed_optimizer": True,
        "optimizer_format": "dp_reshardable",
        "routing": "r3",
        "model": "/models/Qwen3-1.7B",
    }
    wider = _mcore_cfg(tmp_path, tp=2, ep=4, nnodes=4, n_gpus_per_node=8, fully_reshardable=True)
    assert checkpoint.identity(wider)["layout"]["data_parallel_size"] == 16
    assert checkpoint.identity(wider)["layout"]["optimizer_format"] == "fully_reshardable"
    assert checkpoint.fingerprint(wider) == info["fingerprint"]  # the layout is compared apart
    assert checkpoint.identity(_mcore_cfg(tmp_path, distributed=False))["layout"]["optimizer_format"] == (
        "not distributed"
    )
    fsdp = checkpoint.identity(_cfg(tmp_path, nnodes=1, n_gpus_per_node=8))["layout"]
    assert (fsdp["backend"], fsdp["data_parallel_size"], fsdp["nnodes"], fsdp["n_gpus_per_node"]) == ("fsdp", 8, 1, 8)
    with pytest.raises(ValueError, match=r"^trainer.nnodes unset: a checkpoint records the layout it is saved on$"):
        checkpoint.identity(_cfg(tmp_path, nnodes=None))


def test_the_same_layout_resumes_without_a_word(tmp_path):
    path = _save(tmp_path, 2, _mcore_cfg(tmp_path, ep=2))
    plan = plan_resume(_mcore_cfg(tmp_path, ep=2, total_training_steps=20))
    assert plan.resume_from == path and plan.warnings == ()


@pytest.mark.parametrize("fmt", ["dp_reshardable", "fully_reshardable"])
def test_a_change_of_data_parallel_only_resumes_from_either_format_with_one_warning(tmp_path, fmt):
    saved = _mcore_cfg(tmp_path, ep=2, nnodes=1, n_gpus_per_node=2, fully_reshardable=fmt == "fully_reshardable")
    path = _save(tmp_path, 2, saved)
    plan = plan_resume(_mcore_cfg(tmp_path, ep=2, nnodes=2, n_gpus_per_node=2))  # a second node, EP as saved
    assert plan.resume_from == path
    assert plan.warnings == (
        f"layout changed since {path}: data_parallel_size 2 -> 4, nodes × GPUs 1×2 -> 2×2; the optimizer was saved "
        f"{fmt}: megatron-core reshards it in data parallel",
    )


def test_an_expert_parallel_change_from_dp_reshardable_is_refused_naming_both_ways_out(tmp_path):
    saved = _mcore_cfg(tmp_path, ep=2, nnodes=1, n_gpus_per_node=2)
    path = _save(tmp_path, 2, saved)
    hf = _hf_weights(path)
    smaller = _mcore_cfg(tmp_path, ep=1, nnodes=1, n_gpus_per_node=1)  # the same run on one slot
    with pytest.raises(CheckpointError) as err:
        plan_resume(smaller)
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith(
        f"layout changed since {path}: expert_model_parallel_size 2 -> 1, data_parallel_size 2 -> 1, nodes × GPUs "
        "1×2 -> 1×1; the optimizer was saved dp_reshardable, which megatron-core reshards in data parallel only"
    )
    assert "belongs to another run" not in line
    back = _overrides(line, "Resume on the saved layout (")
    assert back == [f"{MEGATRON}.expert_model_parallel_size=2", "trainer.nnodes=1", "trainer.n_gpus_per_node=2"]
    assert line.endswith(
        f"or start from its weights with a fresh optimizer and step 0: actor_rollout_ref.model.path={hf} "
        "trainer.experiment_name=<a new name>"
    )
    # the first way out: the saved layout resumes, without a word
    plan = plan_resume(OmegaConf.merge(smaller, OmegaConf.from_dotlist(back)))
    assert plan.resume_from == path and plan.warnings == ()


def test_the_weights_way_out_starts_a_run_of_its_own(tmp_path):
    """Followed as the refusal says it, in a job whose folder is named by the run (as the presets' is)."""
    folder = f"{tmp_path}/${{trainer.experiment_name}}"
    path = _save(tmp_path / "run", 2, _mcore_cfg(tmp_path, ep=2, default_local_dir=folder, experiment_name="run"))
    smaller = _mcore_cfg(tmp_path, ep=1, n_gpus_per_node=1, default_local_dir=folder, experiment_name="run")
    with pytest.raises(CheckpointError, match=r"(?<=HF weights of a checkpoint that holds them: this one does not)"):
        plan_resume(smaller)  # no HF copy yet: the line names what saves one
    hf = _hf_weights(path)
    with pytest.raises(CheckpointError) as err:
        plan_resume(smaller)
    restart = str(err.value).split("fresh optimizer and step 0: ", 1)[1].replace("<a new name>", "run-from-step-2")
    fresh = OmegaConf.merge(smaller, OmegaConf.from_dotlist(restart.split()))
    assert fresh.actor_rollout_ref.model.path == str(hf)
    assert plan_resume(fresh).resume_from is None  # a folder of its own: a fresh start, the checkpoint left alone
    again = _save(tmp_path / "run-from-step-2", 1, fresh)
    assert plan_resume(fresh).resume_from == again  # and a relaunch with the same overrides resumes it


def test_an_expert_parallel_change_from_fully_reshardable_resumes_with_one_warning(tmp_path):
    path = _save(tmp_path, 2, _mcore_cfg(tmp_path, ep=4, n_gpus_per_node=4, fully_reshardable=True))
    plan = plan_resume(_mcore_cfg(tmp_path, ep=2, n_gpus_per_node=2, fully_reshardable=True))
    assert plan.resume_from == path
    assert plan.warnings == (
        f"layout changed since {path}: expert_model_parallel_size 4 -> 2, data_parallel_size 4 -> 2, nodes × GPUs "
        "1×4 -> 1×2; the optimizer was saved fully_reshardable: megatron-core reshards it",
    )
    # the saved format decides, not this run's: verl reads it from the checkpoint
    plan = plan_resume(_mcore_cfg(tmp_path, ep=2, n_gpus_per_node=2, fully_reshardable=False))
    assert plan.resume_from == path and "saved fully_reshardable: megatron-core reshards it" in plan.warnings[0]


@pytest.mark.parametrize("saved_ep, ep", [(2, 1), (1, 2)])
def test_expert_parallel_1_to_more_or_back_is_refused_even_from_fully_reshardable(tmp_path, saved_ep, ep):
    """megatron-core 0.16.1 gives the experts an optimizer of their own only at EP > 1: the checkpoint holds the state
    of two chained optimizers or of one, and ChainedOptimizer loads neither into the other."""
    path = _save(tmp_path, 2, _mcore_cfg(tmp_path, ep=saved_ep, n_gpus_per_node=2, fully_reshardable=True))
    with pytest.raises(CheckpointError) as err:
        plan_resume(_mcore_cfg(tmp_path, ep=ep, n_gpus_per_node=2, fully_reshardable=True))
    line = str(err.value)
    assert line.startswith(
        f"layout changed since {path}: expert_model_parallel_size {saved_ep} -> {ep}; the optimizer was saved "
        "fully_reshardable, but megatron-core 0.16.1 gives the experts an optimizer of their own only at EP > 1 and "
        "cannot load the state of two optimizers into one, or of one into two. Resume on the saved layout "
        f"({MEGATRON}.expert_model_parallel_size={saved_ep}), or "
    ), line


def test_a_tensor_parallel_change_is_refused_even_from_fully_reshardable(tmp_path):
    """verl 0.9.1 keeps the RNG state as a ShardedObject of global shape (PP, TP): another TP cannot load it."""
    path = _save(tmp_path, 2, _mcore_cfg(tmp_path, tp=2, ep=2, fully_reshardable=True))
    with pytest.raises(CheckpointError) as err:
        plan_resume(_mcore_cfg(tmp_path, tp=1, ep=2, fully_reshardable=True))
    line = str(err.value)
    assert line.startswith(
        f"layout changed since {path}: tensor_model_parallel_size 2 -> 1, expert_tensor_parallel_size 2 -> 1, "
        "data_parallel_size 1 -> 2; the optimizer was saved fully_reshardable, but verl 0.9.1 keeps the RNG state "
        "by (PP, TP) and cannot load it at another TP or PP"
    )
    back = _overrides(line, "Resume on the saved layout (")
    assert back == [f"{MEGATRON}.tensor_model_parallel_size=2", f"{MEGATRON}.expert_tensor_parallel_size=2"]


def test_a_damaged_checkpoint_on_another_layout_names_the_damage_first(tmp_path):
    """Its way out (an intact checkpoint before it) comes before the layout's: the saved layout would not help."""
    _save(tmp_path, 1, _mcore_cfg(tmp_path, ep=2))
    (_save(tmp_path, 2, _mcore_cfg(tmp_path, ep=2)) / "data.pt").unlink()
    with pytest.raises(CheckpointError, match=r"^DAMAGED CHECKPOINT .*global_step_2: .*data.pt is missing; to resume "):
        plan_resume(_mcore_cfg(tmp_path, ep=1, n_gpus_per_node=1))


def test_turning_the_distributed_optimizer_off_is_refused(tmp_path):
    _save(tmp_path, 2, _mcore_cfg(tmp_path, fully_reshardable=True))
    with pytest.raises(CheckpointError, match=r"use_distributed_optimizer True -> False; the optimizer's checkpoint "):
        plan_resume(_mcore_cfg(tmp_path, distributed=False))


def test_an_fsdp_checkpoint_resumes_on_its_own_world_size_only(tmp_path):
    path = _save(tmp_path, 2, _cfg(tmp_path, n_gpus_per_node=4))
    with pytest.raises(CheckpointError) as err:
        plan_resume(_cfg(tmp_path, n_gpus_per_node=8))
    line = str(err.value)
    assert line.startswith(
        f"layout changed since {path}: data_parallel_size 4 -> 8, nodes × GPUs 1×4 -> 1×8; verl's FSDP checkpoint "
        "holds one file per rank, named by its world size"
    )
    assert _overrides(line, "Resume on the saved layout (") == ["trainer.nnodes=1", "trainer.n_gpus_per_node=4"]
    # FSDP saves no HF weights by default: the line names verl's merger
    assert f"python -m verl.model_merger merge --backend fsdp --local_dir {path / 'actor'}" in line
    # Ulysses alone: the FSDP mesh, hence every shard, is as saved
    ulysses = OmegaConf.merge(
        _cfg(tmp_path, n_gpus_per_node=4), {"actor_rollout_ref": {"actor": {"ulysses_sequence_parallel_size": 2}}}
    )
    plan = plan_resume(ulysses)
    assert plan.resume_from == path
    assert plan.warnings == (
        f"layout changed since {path}: ulysses_sequence_parallel_size 1 -> 2, data_parallel_size 4 -> 2; verl's "
        "FSDP shards follow the FSDP mesh, which stays as saved",
    )


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"lr": 1e-4}, "actor_rollout_ref.actor.optim.lr: 0.001 -> 0.0001"),
        ({"train_batch_size": 4}, "data.train_batch_size: 8 -> 4"),
    ],
)
def test_a_change_outside_the_layout_is_still_another_run(tmp_path, change, key):
    """With the layout changed too: the differing keys name the run's change, not the layout's."""
    _save(tmp_path, 2, _mcore_cfg(tmp_path, ep=2, fully_reshardable=True))
    with pytest.raises(CheckpointError) as err:
        plan_resume(_mcore_cfg(tmp_path, ep=1, n_gpus_per_node=1, fully_reshardable=True, **change))
    line = str(err.value)
    assert "belongs to another run" in line and f"differing keys (checkpoint -> this run): {key}." in line


def _save_unmarked_layout(folder, step, cfg):
    """A checkpoint whose marker was written before markers recorded the layout: its fingerprint hashed the whole
    configuration but the per-attempt keys, the layout with it."""
    path = _save(folder, step, cfg)
    info = json.loads((path / checkpoint.MARKER).read_text())
    del info["layout"]
    info["fingerprint"] = checkpoint.config_hash(cfg, checkpoint.PER_ATTEMPT_KEYS)[:16]
    write_marker_info(path, info)
    return path


def test_a_marker_without_a_layout_keeps_the_layout_in_its_fingerprint(tmp_path):
    path = _save_unmarked_layout(tmp_path, 2, _mcore_cfg(tmp_path, ep=2, fully_reshardable=True))
    plan = plan_resume(_mcore_cfg(tmp_path, ep=2, fully_reshardable=True, total_training_steps=20))
    assert plan.resume_from == path and plan.warnings == ()
    with pytest.raises(CheckpointError) as err:  # a change megatron-core could reshard: another run, as before
        plan_resume(_mcore_cfg(tmp_path, ep=1, fully_reshardable=True))
    line = str(err.value)
    assert "belongs to another run" in line
    assert f"{MEGATRON}.expert_model_parallel_size: 2 -> 1" in line


def test_resume_path_checks_the_layout_of_the_checkpoint_it_names(tmp_path):
    path = _save(tmp_path, 2, _mcore_cfg(tmp_path, ep=2))
    named = {"resume_mode": "resume_path", "resume_from_path": str(path)}
    with pytest.raises(CheckpointError, match=r"expert_model_parallel_size 2 -> 1, .* saved dp_reshardable, which"):
        plan_resume(_mcore_cfg(tmp_path, ep=1, n_gpus_per_node=1, **named))
    plan = plan_resume(_mcore_cfg(tmp_path, ep=2, nnodes=2, **named))
    assert plan.resume_from is None  # verl resumes from the path it names
    assert plan.warnings == (
        f"layout changed since {path}: data_parallel_size 2 -> 4, nodes × GPUs 1×2 -> 2×2; the optimizer was saved "
        "dp_reshardable: megatron-core reshards it in data parallel",
    )


def test_a_shipped_preset_resumes_on_more_nodes():
    """qwen3_30b_a3b_h100_2x8 and _4x8 differ in trainer.nnodes only: data parallel, from verl's dp_reshardable."""
    from respo_verl.tools.plan.presets import compose_preset

    two, four = (compose_preset(f"qwen3_30b_a3b_h100_{n}x8") for n in (2, 4))
    saved, current = checkpoint.identity(two), checkpoint.identity(four)
    assert saved["fingerprint"] == current["fingerprint"]
    verdict = checkpoint.layout_verdict(saved["layout"], current["layout"])
    assert verdict.resumes and verdict.changes == ("data_parallel_size 8 -> 16", "nodes × GPUs 2×8 -> 4×8")
    assert saved["layout"]["optimizer_format"] == "dp_reshardable"
    assert saved["layout"]["expert_model_parallel_size"] == current["layout"]["expert_model_parallel_size"] == 8


def test_the_fully_reshardable_switch_saves_a_checkpoint_an_expert_parallel_change_resumes_from():
    """``+respo_verl=fully_reshardable`` on a shipped preset: the same run (the format is a layout key), its marker
    records the format, and a relaunch with another EP resumes from its checkpoints where the preset's own are refused;
    a change of data parallel only resumes from both."""
    from respo_verl.tools.plan.presets import compose_preset

    switch = "+respo_verl=fully_reshardable"
    halved_ep = [f"{MEGATRON}.expert_model_parallel_size=4"]
    plain, switched = (identity(compose_preset("qwen3_30b_a3b_h100_2x8", extra)) for extra in ([], [switch]))
    assert switched["fingerprint"] == plain["fingerprint"]
    assert (plain["layout"]["optimizer_format"], switched["layout"]["optimizer_format"]) == (
        "dp_reshardable",
        "fully_reshardable",
    )
    other_ep = identity(compose_preset("qwen3_30b_a3b_h100_2x8", [switch, *halved_ep]))["layout"]
    more_nodes = identity(compose_preset("qwen3_30b_a3b_h100_4x8"))["layout"]
    verdict = checkpoint.layout_verdict(switched["layout"], other_ep)
    assert verdict.resumes and verdict.changes == ("expert_model_parallel_size 8 -> 4",), verdict
    verdict = checkpoint.layout_verdict(plain["layout"], other_ep)
    assert (
        not verdict.resumes and "dp_reshardable, which megatron-core reshards in data parallel only" in verdict.reason
    )
    for saved in (plain, switched):
        verdict = checkpoint.layout_verdict(saved["layout"], more_nodes)
        assert verdict.resumes and verdict.changes == ("data_parallel_size 8 -> 16", "nodes × GPUs 2×8 -> 4×8")


# --- guards --------------------------------------------------------------------------------------------------------


def test_failed_samples_are_counted_from_the_padding_tags():
    tags = [{"is_padding": False}] * 6 + [{"is_padding": True}] * 2
    assert failed_sample_metrics(tags, expected=8) == {FAILED_SAMPLES_KEY: 2.0, FAILED_SHARE_KEY: 0.25}
    # padding to a multiple of the data-parallel size on top of a full batch is not a failure
    tags = [{"is_padding": False}] * 8 + [{"is_padding": True}] * 2
    assert failed_sample_metrics(tags, expected=8)[FAILED_SAMPLES_KEY] == 0.0


def test_groups_verl_evicted_and_generated_again_count_as_failed_samples():
    """verl's training/rollout_failure/evicted_samples counts prompt groups that failed whole (n samples each); the
    step's batch is then full, without padding, and only verl's count says that anything failed."""
    full = [{"is_padding": False}] * 8
    metrics = failed_sample_metrics(full, expected=8, evicted_groups=1.0, group_size=2)
    assert metrics == {FAILED_SAMPLES_KEY: 2.0, FAILED_SHARE_KEY: 0.2}  # 2 of the 10 samples generated
    both = failed_sample_metrics(full[:6] + [{"is_padding": True}] * 2, expected=8, evicted_groups=2, group_size=2)
    assert both == {FAILED_SAMPLES_KEY: 6.0, FAILED_SHARE_KEY: 0.5}  # 2 padded + 2 groups × 2, of 12
    assert failed_sample_metrics(full, expected=8, evicted_groups=0, group_size=2)[FAILED_SAMPLES_KEY] == 0.0
    for bad in (-1, 0.5):
        with pytest.raises(ValueError, match=r"training/rollout_failure/evicted_samples=.* is not a count of groups"):
            failed_sample_metrics(full, expected=8, evicted_groups=bad, group_size=2)


def test_a_group_verl_evicted_stops_a_run_under_the_default_guard(monkeypatch):
    """What verl reports after a reward function raised once (evicted_samples=1.0, a full batch) stops the run."""
    trainer = _bare_trainer(monkeypatch, {"training/rollout_failure/evicted_samples": 1.0})
    batch = type("Batch", (), {"tags": [{"is_padding": False}] * 4})()
    stop = r"step 2: respo_verl/failed_share=0.3333 \(2.0 samples .* the 1 group\(s\) verl evicted .*max_failed_share=0"
    with pytest.raises(RunStopped, match=stop):
        trainer._compute_metrics(batch, {}, {}, global_steps=2, epoch=0)
    step, logged = trainer.logger.logged[0]
    assert step == 2 and logged[FAILED_SAMPLES_KEY] == 2.0 and logged[STOPPED_KEY] == 1.0
    tolerant = _bare_trainer(monkeypatch, {"training/rollout_failure/evicted_samples": 1.0})
    tolerant._guards = StepGuards(GuardConfig(max_failed_share=0.5))
    metrics = {}
    tolerant._compute_metrics(batch, metrics, {}, global_steps=2, epoch=0)
    assert metrics[FAILED_SAMPLES_KEY] == 2.0 and tolerant.logger.logged == []


def test_any_failed_sample_stops_the_cpu_default_and_a_share_is_tolerated_when_set():
    metrics = {FAILED_SHARE_KEY: 1 / 64, FAILED_SAMPLES_KEY: 1.0}
    with pytest.raises(RunStopped, match=r"step 7: respo_verl/failed_share=0.0156 .*max_failed_share=0.0"):
        StepGuards(GuardConfig()).check(metrics, step=7)
    StepGuards(GuardConfig(max_failed_share=0.02)).check(metrics, step=7)


def test_the_clamp_share_guard_names_the_metric_and_the_step():
    with pytest.raises(RunStopped, match=r"step 1: actor/respo/clamp_frac=0.750 > run_guard.max_clamp_share=0.1"):
        StepGuards(GuardConfig()).check({"actor/respo/clamp_frac": 0.75}, step=1)


def _collapsed(entropy=0.0, signal=0.0):
    return {"actor/entropy": entropy, "critic/advantages/max": signal, "critic/advantages/min": -signal}


def test_collapse_stops_after_k_quiet_steps_in_a_row_only():
    guards = StepGuards(GuardConfig(collapse_steps=3))
    guards.check(_collapsed(), step=1)
    guards.check(_collapsed(), step=2)
    guards.check(_collapsed(signal=1.0), step=3)  # a group with a signal: the count starts again
    guards.check(_collapsed(), step=4)
    guards.check(_collapsed(entropy=0.5), step=5)  # entropy back: starts again
    guards.check(_collapsed(), step=6)
    guards.check(_collapsed(), step=7)
    with pytest.raises(RunStopped, match=r"step 8: actor/entropy=0.00e\+00 .* for 3 steps in a row"):
        guards.check(_collapsed(), step=8)


def _bare_trainer(monkeypatch, step_metrics: dict):
    """The respo-verl trainer class without verl's set-up: verl's own metrics for a step are ``step_metrics``, its
    Tracking a recorder of what each backend would get."""
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from respo_verl.run.respo_trainer import RespoTrainer

    def verl_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
        metrics.update(step_metrics)

    monkeypatch.setattr(PPOTrainerSync, "_compute_metrics", verl_metrics)
    trainer = RespoTrainer.__new__(RespoTrainer)  # its __init__ would build verl's whole trainer
    trainer._guards = StepGuards(GuardConfig())
    trainer._unmarked_step, trainer._stopping = None, False
    trainer.config = OmegaConf.create({"data": {"train_batch_size": 2}, "actor_rollout_ref": {"rollout": {"n": 2}}})

    class Tracking:
        logged, finished = [], []

        def log(self, data, step):
            self.logged.append((step, data))

        def finish(self, exit_code=0):
            self.finished.append(exit_code)

    trainer.logger = Tracking()
    return trainer


def test_a_guard_logs_the_step_it_stops_in_marked_and_leaves_its_checkpoint_unmarked(monkeypatch):
    trainer = _bare_trainer(monkeypatch, {"actor/respo/clamp_frac": 0.75, "_dapo_filtered_reward_counts": {"x": 1}})
    trainer._unmarked_step = 1  # the step was saved; verl writes the marker once its line is logged
    batch = type("Batch", (), {"tags": [{}] * 4})()
    with pytest.raises(RunStopped, match=r"step 1: actor/respo/clamp_frac=0.750 > run_guard.max_clamp_share=0.1"):
        trainer._compute_metrics(batch, {}, {}, global_steps=1, epoch=0)
    expected = {"actor/respo/clamp_frac": 0.75, FAILED_SAMPLES_KEY: 0.0, FAILED_SHARE_KEY: 0.0, STOPPED_KEY: 1.0}
    assert trainer.logger.logged == [(1, expected)] and trainer.logger.finished == [1]
    trainer._mark_saved_step(1)  # the run stops after this step: a relaunch must not resume after it
    assert trainer._unmarked_step == 1

    healthy = _bare_trainer(monkeypatch, {"actor/respo/clamp_frac": 0.0})
    metrics = {}
    healthy._compute_metrics(batch, metrics, {}, global_steps=1, epoch=0)
    assert healthy.logger.logged == [] and STOPPED_KEY not in metrics  # verl's loop logs a step that goes on


def test_non_finite_rewards_stop_the_run_naming_the_step_and_log_it_marked(monkeypatch):
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    def advantage(self, batch, metrics):
        raise ValueError("token_level_rewards holds non-finite values in 1 of 4 responses")

    monkeypatch.setattr(PPOTrainerSync, "_compute_advantage", advantage)
    trainer = _bare_trainer(monkeypatch, {})
    trainer.global_steps = 3
    with pytest.raises(RunStopped, match=r"^step 3: token_level_rewards holds non-finite values in 1 of 4 responses$"):
        trainer._compute_advantage(None, {"timing_s/gen": 2.0})
    # the step is in the log like every guard's stop: its metrics so far, marked
    assert trainer.logger.logged == [(3, {"timing_s/gen": 2.0, STOPPED_KEY: 1.0})] and trainer.logger.finished == [1]


def test_disabled_guards_never_stop():
    StepGuards(GuardConfig(enable=False)).check({FAILED_SHARE_KEY: 1.0, "actor/respo/clamp_frac": 1.0}, step=1)


@pytest.mark.parametrize(
    ("node", "match"),
    [
        ({"max_failed_share": 2}, r"run_guard.max_failed_share must be in \[0, 1\], got 2"),
        ({"collapse_steps": 0}, r"run_guard.collapse_steps must be >= 1, got 0"),
        ({"min_entropy": -1}, r"run_guard.min_entropy must be >= 0, got -1"),
        ({"max_clamp": 0.1}, r"run_guard has no key\(s\) \['max_clamp'\]"),
    ],
)
def test_bad_guard_settings_are_refused(node, match):
    with pytest.raises(ValueError, match=match):
        GuardConfig.from_config(node)


def test_the_shipped_guard_defaults_are_valid():
    from pathlib import Path

    node = OmegaConf.load(Path(__file__).resolve().parents[1] / "configs/respo_verl/run_guard.yaml")
    assert node.trainer.v1.trainer_mode == "respo_sync"
    assert GuardConfig.from_config(node.run_guard) == GuardConfig()
