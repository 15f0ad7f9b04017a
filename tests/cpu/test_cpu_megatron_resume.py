"""A Megatron run that survives a stop, end to end on CPU: ``python -m respo_verl.main_ppo`` with ``+device=cpu_megatron
model_engine=megatron routing=r2`` on the kit's tiny Qwen3-MoE (megatron-core's dist checkpointing, mbridge's HF
export, verl's resume). Apart from test_cpu_megatron.py so that the two files run side by side on two test workers.
"""

from __future__ import annotations

import json
import shutil

import pytest
from support import cpu_runs

from respo_verl.cpu.kit.build import KitSpec, build_kit
from respo_verl.run.checkpoint import TRACKER

MEGATRON_JOB = ["algorithm=respo", "routing=r2", "model_engine=megatron", "+device=cpu_megatron"]


@pytest.fixture(scope="module")
def moe_kit():
    return build_kit(KitSpec(moe=True), progress=False)


# Wall-clock figures; every other metric of a resumed run must equal the uninterrupted run's to the last bit.
_UNTIMED = ("timing_s/", "timing_per_token_ms/", "perf/")


@pytest.mark.slow
def test_megatron_checkpoints_save_on_cpu_and_a_relaunch_resumes_exactly_with_r2(tmp_path, moe_kit):
    """megatron-core's dist-checkpointing saves on CPU (its torch.cuda.synchronize and the CUDA RNG tracker's state are
    handled by the CPU patch); a run stopped after its checkpoint of step 2 and relaunched resumes from it, loading the
    model, the optimizer and the RNG states (verl's own log lines say so), appends to the log, goes on replaying
    routes, and logs steps 3 and 4 exactly as an uninterrupted run of 4 steps does (verl's rollout.full_determinism):
    step 4's metrics come from weights that the resumed optimizer state updated.

    The stopped run is the uninterrupted run itself, taken back to what it had on disk right after its checkpoint of
    step 2 (that checkpoint, the tracker naming step 2, the log's lines of steps 1 and 2): one Megatron run fewer than
    a separate 2-step run, and the same files such a run leaves (the FSDP tests in test_cpu_resume.py stop real runs
    with SIGTERM and SIGKILL)."""

    def launch(folder, steps: int) -> tuple[str, list[dict]]:
        overrides = [
            *MEGATRON_JOB,
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "data.train_batch_size=4",
            f"trainer.total_training_steps={steps}",
            "trainer.save_freq=2",
            "trainer.experiment_name=resume",
            f"trainer.default_local_dir={folder / 'ckpt'}",
            "actor_rollout_ref.rollout.full_determinism=true",
        ]
        rc, out = cpu_runs.launch(folder, cpu_runs.main_ppo(*overrides), timeout=1200)
        assert rc == 0, out[-5000:]
        return out, cpu_runs.log_lines(folder)

    run = tmp_path / "run"
    _, reference = launch(run, 4)
    # R2 at N = 2: the drift of each update index j on its own (j = 0 replays π_old's own routes), and their mean.
    for line in reference:
        per_j = [line["data"].get(f"actor/routing/by_update/j{j}/flip_frac") for j in range(3)]
        assert per_j[0] == 0.0 and per_j[2] is None and line["data"]["actor/routing/flip_frac"] == per_j[1] / 2, line
    assert (run / "ckpt" / "global_step_2" / "actor" / "optimizer").is_dir()
    # Back to the moment after step 2's checkpoint: global_step_4 and the log's steps 3 and 4 were not written yet.
    assert (run / "ckpt" / TRACKER).read_text().strip() == "4"
    shutil.rmtree(run / "ckpt" / "global_step_4")
    (run / "ckpt" / TRACKER).write_text("2")
    log = run / "log.jsonl"
    log.write_text("".join(line + "\n" for line in log.read_text().splitlines()[:2]))
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2]
    out, lines = launch(run, 4)
    assert "Resuming from" in out and "global_step_2" in out, out[-5000:]
    # The model comes back through the bridge's HF export (verl's choice with mbridge), or as its dist checkpoint.
    assert "Loaded HF model checkpoint" in out or "Loaded sharded model checkpoint" in out, out[-5000:]
    for what in ("Loaded optimizer checkpoint", "Loaded RNG states"):
        assert what in out, what
    assert [line.get("step", line.get("event")) for line in lines] == [1, 2, "resume", 3, 4]
    assert lines[-1]["data"]["actor/routing/replayed_tokens"] > 0
    resumed = {line["step"]: line["data"] for line in lines if "step" in line}
    # The comparison tests the restored weights and optimizer state only if the run trains after the checkpoint.
    assert any(line["data"]["actor/grad_norm"] > 0 for line in reference if line["step"] > 2), [
        line["data"]["actor/grad_norm"] for line in reference
    ]
    for line in reference:
        step, want = line["step"], line["data"]
        got = resumed[step]
        keys = {k for k in want if not any(part in k for part in _UNTIMED)}
        assert keys == {k for k in got if not any(part in k for part in _UNTIMED)}, step
        differing = {k: (got[k], want[k]) for k in sorted(keys) if got[k] != want[k]}
        assert not differing, (step, differing)
