"""verl's Megatron engine end to end on CPU: ``python -m respo_verl.main_ppo`` with ``+device=cpu_megatron
model_engine=megatron routing=r2`` on the kit's tiny Qwen3-MoE, two worker processes with expert parallel 2.

One uninterrupted run and its relaunch from the checkpoint of step 2 (two verl drivers) show R2's route drift, the
run guard's stop on a failed reward, megatron-core's dist checkpointing with expert-parallel shards in both of verl's
optimizer formats (``dp_reshardable``, and ``fully_reshardable`` through ``+respo_verl=fully_reshardable``), mbridge's
HF export (the experts gathered back for the rollout), verl's resume, the refusal before Ray of a relaunch on expert
parallel 1 from either checkpoint, and the non-finite stop on the Megatron engine. Each is a real subprocess started
by tests/support/cpu_runs.py (Ray, TransferQueue, the agent loop, the hf_cpu rollout, verl's
``MegatronEngineWithLMHead`` with megatron-core on gloo, verl's naive weight sync, router replay and file logger).
"""

from __future__ import annotations

import json
import shutil

import pytest
from support import cpu_runs

from respo_verl.checkpoint import DP_RESHARDABLE, FULLY_RESHARDABLE, MARKER, TRACKER, CheckpointError, plan_resume
from respo_verl.cpu.kit.build import KIT_ENV, KitSpec, build_kit, kit_root
from respo_verl.entry_points import CPU_MODULE, PLUGIN_MODULE
from respo_verl.run.compose import compose_job
from respo_verl.run.stops import EXIT_GUARD
from respo_verl.tools.runs.logs import STOPPED_KEY, read_log

MEGATRON_JOB = ["algorithm=respo", "routing=r2", "model_engine=megatron", "+device=cpu_megatron"]


def _expert_parallel(size: int) -> list[str]:
    """``size`` worker processes with expert parallel ``size`` (data parallel ``size`` for the dense parameters, 1
    for the experts), the per-process micro-batches as the fingerprint has them."""
    return [
        f"trainer.n_gpus_per_node={size}",
        f"ray_kwargs.ray_init.num_gpus={size}",
        *(f"actor_rollout_ref.{role}.megatron.expert_model_parallel_size={size}" for role in ("actor", "ref")),
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        *(f"actor_rollout_ref.{role}.log_prob_micro_batch_size_per_gpu=4" for role in ("ref", "rollout")),
    ]


# Two worker processes with expert parallel 2 on gloo: each holds 2 of the 4 experts, tokens travel between them by
# megatron's all-to-all dispatcher, and the rollout gets the experts gathered back by mbridge's export.
EXPERT_PARALLEL_2 = _expert_parallel(2)
# The layout change a relaunch asks for: one process with all 4 experts.
EXPERT_PARALLEL_1 = _expert_parallel(1)
# The switch of configs/respo_verl/fully_reshardable.yaml: the checkpoints a run saves from then on are
# fully_reshardable.
FULLY_RESHARDABLE_SWITCH = "+respo_verl=fully_reshardable"
RESPO_KEYS = ("actor/respo/pos/log_w_mean", "actor/respo/neg/phi_mean", "actor/respo/starved_mass_share")
ROUTING_KEYS = (
    "actor/routing/flip_frac",
    "actor/routing/overlap",
    "actor/routing/prob_mass_delta",
    "actor/routing/any_layer_flip_frac",
    "actor/routing/replayed_tokens",
    "actor/routing/flip_frac/layer_0",
    "actor/routing/flip_frac/layer_1",
)
# The hf_cpu rollout (transformers, fp32) and the Megatron actor (megatron-core's local layers, fp32) score the same
# tokens with the same synced weights: any layout error in the weight mapping, the expert fusion or the attention
# mask shows up as a gap of order 1.
SYNCED_LOG_PROB_GAP = 1e-3
PROMPTS, SAMPLES = 4, 4  # data.train_batch_size below; the preset's rollout.n
# The step in which the raising reward strikes (tests/support/cpu_modules/raising_reward.py), the last of both runs,
# and the prompt whose group fails: the data loader's first of that step (data.shuffle=false: step k takes rows
# (k - 1) * PROMPTS onwards), the same group in both runs whatever order its responses are scored in.
FAILING_STEP = 4
FAILING_PROMPT = (FAILING_STEP - 1) * PROMPTS
# Wall-clock figures; every other metric of a resumed run must equal the uninterrupted run's to the last bit.
_UNTIMED = ("timing_s/", "timing_per_token_ms/", "perf/")


@pytest.fixture(scope="module")
def moe_kit():
    return build_kit(KitSpec(moe=True), progress=False)


# The relaunch's stop in step 4: the update's loss receives NaN log-probabilities (tests/support/cpu_modules/
# inject_nonfinite.py) before the run guard could see the failed reward.
NONFINITE_STOP = (
    rf"\(non-finite data, exit {EXIT_GUARD}\): step {FAILING_STEP}: FloatingPointError: respo loss received "
    r"non-finite values on valid response tokens.*"
)


def _job(folder, *extra: str, layout: list[str] = EXPERT_PARALLEL_2) -> list[str]:
    """The overrides of :func:`_launch`'s run (``layout``: its processes and expert parallel size)."""
    return [
        *MEGATRON_JOB,
        *layout,
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        f"data.train_batch_size={PROMPTS}",
        "trainer.total_training_steps=4",
        "trainer.save_freq=2",
        "trainer.experiment_name=resume",
        f"trainer.default_local_dir={folder / 'ckpt'}",
        "actor_rollout_ref.rollout.full_determinism=true",
        "data.shuffle=false",
        f"reward.custom_reward_function.path={cpu_runs.FAULTS / 'raising_reward.py'}",
        cpu_runs.after_steps("RAISING_REWARD_AFTER", folder, FAILING_STEP - 1),
        f"+ray_kwargs.ray_init.runtime_env.env_vars.RAISING_REWARD_INDEX='{FAILING_PROMPT}'",
        *extra,
    ]


def _launch(folder, *extra: str, stop: str | None = None) -> tuple[str, list[dict]]:
    """4 steps of R2 at N = 2 with expert parallel 2, a checkpoint every second step, verl's full determinism, and a
    reward function that raises in step 4 for one prompt's response; the run guard stops the run there (exit 3),
    or ``stop`` does (the pattern of its line)."""
    rc, out = cpu_runs.launch(folder, cpu_runs.main_ppo(*_job(folder, *extra)), timeout=1500)
    assert rc == EXIT_GUARD, out[-5000:]
    assert "raising_reward: the test's reward function fails for this response" in out, out[-4000:]
    guard = (
        rf"\(run guard, exit {EXIT_GUARD}\): step {FAILING_STEP}: respo_verl/failed_share=.* > "
        r"run_guard.max_failed_share=0.0"
    )
    cpu_runs.stop_line(out, stop or guard)
    return out, cpu_runs.log_lines(folder)


@pytest.mark.slow
def test_megatron_r2_with_expert_parallel_2_drifts_stops_on_a_failed_reward_and_resumes_exactly(tmp_path, moe_kit):
    """R2 at N = 2 on two processes with expert parallel 2, a reward that fails in step 4, and a relaunch.

    Route drift: the second update of each rollout batch (j = 1) replays π_old's routes while π_θ's router has moved;
    the first (j = 0, ``actor/routing/by_update/j0/...``) is the N = 1 case, where π_θ's router is π_old's, so R2
    replays the live routes exactly and nothing flips (the same exact replay is checked on a gloo world in
    tests/routing/test_megatron_routing.py); a step's value is the mean of its j. The rollout/actor log-prob gap shows
    that the experts gathered back for the rollout are right.

    The stop: in step 4 the reward function raises for a response to the step's first prompt
    (tests/support/cpu_modules/raising_reward.py); verl evicts that prompt group and fills its place with a fresh
    prompt (training/rollout_failure/evicted_samples), the step's batch is full, and only verl's count says that a
    reward failed. The preset's run guard (max_failed_share 0) stops the run in step 4 with one line and exit 3, and
    the step's line, with the failure counted, is in the file log, marked as the stop (the run guard's one end-to-end
    run: a collapsed policy takes the same path from a step's metrics, ``StepGuards``, unit-tested with the clamp
    metric in tests/test_checkpoint.py).

    The resume: megatron-core's dist checkpointing saves each process's expert shards on CPU (its
    torch.cuda.synchronize and the CUDA RNG tracker's state are handled by the CPU patch); a run stopped after its
    checkpoint of step 2 and relaunched resumes from it, loading the model, the optimizer and the RNG states (verl's
    own log lines say so), appends to the log, goes on replaying routes, and logs step 3 exactly as the uninterrupted
    run does (verl's rollout.full_determinism): step 3's second mini-batch runs on weights that the resumed optimizer
    state updated. The stopped run is the uninterrupted run itself, taken back to what it had
    on disk right after its checkpoint of step 2 (that checkpoint, the tracker naming step 2, the log's lines of
    steps 1 and 2): one Megatron run fewer than a separate 2-step run, and the same files such a run leaves (the FSDP
    tests in test_cpu_resume.py stop real runs with SIGTERM and SIGKILL).

    The layout: a relaunch on one process with expert parallel 1 is refused before Ray from step 2's checkpoint
    (verl's default ``dp_reshardable``, which megatron-core reshards in data parallel only). The relaunch on the saved
    layout turns ``+respo_verl=fully_reshardable`` on (with ``trainer.save_freq=1``: both per-attempt or layout keys,
    the same run) and saves step 3 ``fully_reshardable``, megatron-core's gather on gloo over the dense parameters'
    data-parallel group; expert parallel 1 is refused from that one too, because megatron-core 0.16.1 keeps the
    experts' optimizer apart only at EP > 1 (megatron-core's load of it stops with ``KeyError: 'optimizer'``). A
    layout change that resumes needs more than two processes here (EP 4 -> 2, or a change of data parallel at EP 2).

    The non-finite stop: in the relaunch's step 4 the registered loss receives NaN log-probabilities
    (tests/support/cpu_modules/inject_nonfinite.py), refuses them, and the run stops with one line naming the step and
    the loss's error, exit 3, no traceback after it, and no line of step 4 in the log (the run did not train on).
    """
    run = tmp_path / "run"
    out, reference = _launch(run)
    assert [line["step"] for line in reference] == list(range(1, FAILING_STEP + 1)), out[-3000:]
    data = [line["data"] for line in reference]
    for step in data:
        missing = [k for k in (*RESPO_KEYS, *ROUTING_KEYS) if k not in step]
        assert not missing, missing
        assert step["actor/routing/replayed_tokens"] > 0
    gaps = [step["training/rollout_probs_diff_max"] for step in data]
    assert max(gaps) < SYNCED_LOG_PROB_GAP, gaps

    flips = [step["actor/routing/flip_frac"] for step in data]  # per step: the mean over its 2 mini-batches
    assert all(0.0 <= f <= 1.0 for f in flips) and sum(flips) > 0, flips
    assert all(step["actor/routing/prob_mass_delta"] <= 0.0 for step in data)  # native top-k holds the most mass
    assert any(abs(step["actor/respo/pos/log_w_mean"]) > 1e-3 for step in data)  # stale mini-batches: log W != 0
    first = "actor/routing/by_update/j0/"
    for step in data:
        per_j = [step.get(f"actor/routing/by_update/j{j}/flip_frac") for j in range(3)]
        assert step[first + "flip_frac"] == 0.0, step
        assert step[first + "any_layer_flip_frac"] == 0.0, step
        assert step[first + "overlap"] == 1.0, step
        assert per_j[2] is None and step["actor/routing/flip_frac"] == per_j[1] / 2, step

    # One group evicted: its n = 4 samples, of the 4 × 4 + 4 the step generated.
    assert [STOPPED_KEY in step for step in data] == [False, False, False, True], data[-1]
    last = data[-1]
    assert last["training/rollout_failure/evicted_samples"] == 1.0, last
    assert last["respo_verl/failed_samples"] == SAMPLES, last
    assert last["respo_verl/failed_share"] == pytest.approx(SAMPLES / (PROMPTS * SAMPLES + SAMPLES)), last
    assert last[STOPPED_KEY] == 1.0 and read_log(run / "log.jsonl").stopped_at == FAILING_STEP

    assert (run / "ckpt" / "global_step_2" / "actor" / "optimizer").is_dir()
    # Back to the moment after step 2's checkpoint: global_step_4 and the log's steps 3 and 4 were not written yet.
    assert (run / "ckpt" / TRACKER).read_text().strip() == "4"
    shutil.rmtree(run / "ckpt" / "global_step_4")
    (run / "ckpt" / TRACKER).write_text("2")
    log = run / "log.jsonl"
    log.write_text("".join(line + "\n" for line in log.read_text().splitlines()[:2]))
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2]
    # The relaunch also gets NaN log-probabilities in step 4's update: the non-finite stop on the Megatron engine.
    nonfinite = (
        *cpu_runs.extra_modules("inject_nonfinite", preset=(CPU_MODULE, PLUGIN_MODULE)),
        cpu_runs.after_steps("INJECT_NONFINITE_AFTER", run, FAILING_STEP - 1),
    )
    # Before it, a relaunch on expert parallel 1 from step 2's dp_reshardable checkpoint: refused before Ray.
    refused = _refusal_on_expert_parallel_1(run)
    assert f"layout changed since {run / 'ckpt' / 'global_step_2'}: expert_model_parallel_size 2 -> 1, " in refused
    assert f"the optimizer was saved {DP_RESHARDABLE}, which megatron-core reshards in data parallel only" in refused
    # The relaunch saves step 3 fully_reshardable (verl reads step 2's format from the checkpoint when it loads).
    out, lines = _launch(run, *nonfinite, FULLY_RESHARDABLE_SWITCH, "trainer.save_freq=1", stop=NONFINITE_STOP)
    assert "Resuming from" in out and "global_step_2" in out, out[-5000:]
    # The model comes back through the bridge's HF export (verl's choice with mbridge), or as its dist checkpoint.
    assert "Loaded HF model checkpoint" in out or "Loaded sharded model checkpoint" in out, out[-5000:]
    for what in ("Loaded optimizer checkpoint", "Loaded RNG states"):
        assert what in out, what
    # no line of step 4: the run did not train on
    assert [line.get("step", line.get("event")) for line in lines] == [1, 2, "resume", 3]
    assert lines[-1]["data"]["actor/routing/replayed_tokens"] > 0
    resumed = {line["step"]: line["data"] for line in lines if "step" in line}
    # The comparison tests the restored weights and optimizer state only if the run trains after the checkpoint.
    assert any(line["data"]["actor/grad_norm"] > 0 for line in reference if line["step"] > 2), [
        line["data"]["actor/grad_norm"] for line in reference
    ]
    for line in reference[: FAILING_STEP - 1]:
        step, want = line["step"], line["data"]
        got = resumed[step]
        keys = {k for k in want if not any(part in k for part in _UNTIMED)}
        assert keys == {k for k in got if not any(part in k for part in _UNTIMED)}, step
        differing = {k: (got[k], want[k]) for k in sorted(keys) if got[k] != want[k]}
        assert not differing, (step, differing)

    # The relaunch, with the switch on the saved layout, saved step 3 fully_reshardable: its marker and megatron-core's
    # metadata (what verl reads back when it loads) say so. Expert parallel 1 is refused from it as well: megatron-core
    # keeps the experts' optimizer apart only at EP > 1.
    step_3 = run / "ckpt" / "global_step_3"
    assert (run / "ckpt" / TRACKER).read_text().strip() == "3"
    saved_layout = json.loads((step_3 / MARKER).read_text())["layout"]
    assert (saved_layout["optimizer_format"], saved_layout["expert_model_parallel_size"]) == (FULLY_RESHARDABLE, 2)
    assert _saved_format(step_3 / "actor") == FULLY_RESHARDABLE
    refused = _refusal_on_expert_parallel_1(run)
    assert f"layout changed since {step_3}: expert_model_parallel_size 2 -> 1, " in refused
    assert f"saved {FULLY_RESHARDABLE}, but megatron-core 0.16.1 gives the experts an optimizer of their own" in refused


def _refusal_on_expert_parallel_1(run) -> str:
    """The line that refuses a relaunch of the run in ``run`` on one process with expert parallel 1: the check the
    driver makes on its composed job before Ray starts (respo_verl.run.launch.check_resume)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv(KIT_ENV, str(kit_root()))  # the model path of the fingerprint, as the driver's environment has it
        with pytest.raises(CheckpointError) as refused:
            plan_resume(compose_job("respo", _job(run, layout=EXPERT_PARALLEL_1)))
    return str(refused.value)


def _saved_format(actor) -> str:
    """The optimizer format a Megatron checkpoint's own metadata names (what verl's load reads)."""
    from megatron.core import dist_checkpointing

    metadata = dist_checkpointing.load_content_metadata(checkpoint_dir=str(actor / "optimizer" / "dist_ckpt"))
    return metadata["distrib_optim_sharding_type"]
