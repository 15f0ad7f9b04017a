"""`respo-verl sweep`: the paper grid expands, composes and prints; bad input and a reused --out are refused before
anything starts. The sweeps that run are in test_sweep_cpu.py (on a stand-in run program) and, with verl's trainer,
the demo's in tests/cpu/test_demo.py."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from support.ranks import free_port

from respo_verl.cli import main as cli_main
from respo_verl.run.compose import compose_job
from respo_verl.tools.runs.manifest import read_manifest
from respo_verl.tools.sweep.grid import SweepSpec, expand
from respo_verl.tools.sweep.runner import replace_sweep

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def paper_grid(tmp_path_factory):
    """The paper's grid (4 algorithms × N ∈ {8, 16, 32} × 3 seeds), every run composed in-process."""
    out = tmp_path_factory.mktemp("sweep")
    spec = SweepSpec(
        model="qwen3-30b-a3b",
        preset="qwen3_30b_a3b_h200_1x8",
        out_dir=out,
        base_overrides=("actor_rollout_ref.model.path=/models/q",),
    )
    return expand(spec)


def test_paper_grid_runs_differ_only_in_the_swept_keys(paper_grid):
    records = paper_grid
    assert len(records) == 36
    assert len({r.name for r in records}) == 36
    by_group = defaultdict(set)
    for r in records:
        overrides = dict(o.split("=", 1) for o in r.command[3:])
        assert overrides["+cluster"] == "qwen3_30b_a3b_h200_1x8"
        assert overrides["data.train_batch_size"] == str(32 * r.reuse)
        assert overrides["actor_rollout_ref.actor.ppo_mini_batch_size"] == "32"
        assert int(overrides["trainer.total_training_steps"]) * r.reuse == 1024
        assert overrides["algorithm"] == r.algorithm and overrides["data.seed"] == str(r.seed)
        assert r.env["VERL_FILE_LOGGER_PATH"].endswith(f"logs/{r.name}.jsonl")
        by_group[(r.algorithm, r.reuse)].add(r.config_hash)
    # Seeds of one setting share the configuration hash; different settings do not.
    assert all(len(h) == 1 for h in by_group.values())
    assert len({next(iter(h)) for h in by_group.values()}) == 12


def test_dry_run_prints_every_run_and_writes_the_manifest(tmp_path, capsys):
    argv = ["sweep", "--print", "--out", str(tmp_path), "--algos", "respo,vespo", "--reuse", "8,32", "--seeds", "0"]
    assert cli_main([*argv, "--", "actor_rollout_ref.model.path=/m"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 4
    assert all("-m respo_verl.main_ppo" in line for line in lines)
    assert [r.name for r in read_manifest(tmp_path / "manifest.jsonl")] == [
        "model-respo-n8-s0", "model-respo-n32-s0", "model-vespo-n8-s0", "model-vespo-n32-s0",
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["respo", "verl"])
def test_a_printed_command_composes_under_cfg_job(tmp_path, capsys, entry):
    argv = ["sweep", "--print", "--entry", entry, "--out", str(tmp_path), "--algos", "gspo", "--reuse", "16"]
    argv += ["--preset", "qwen3_1p7b_h100_2x8"]
    assert cli_main([*argv, "--seeds", "2", "--", "actor_rollout_ref.rollout.name=vllm"]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    words = shlex.split(line)
    command = [w for w in words if "=" not in w or not w.split("=", 1)[0].isupper()]
    assert command[0] == "python"  # the cluster's interpreter; here, this environment's
    out = subprocess.run([sys.executable, *command[1:], "--cfg", "job"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    job = OmegaConf.create(out.stdout)
    assert job.actor_rollout_ref.actor.policy_loss.loss_mode == "gspo"
    assert job.data.train_batch_size == 512 and job.trainer.total_training_steps == 64
    assert job.trainer.experiment_name == "model-gspo-n16-s2" and job.data.seed == 2
    assert job.actor_rollout_ref.actor.fsdp_config.seed == 2 and job.actor_rollout_ref.rollout.seed == 2
    assert job.trainer.nnodes == 2 and job.actor_rollout_ref.rollout.tensor_model_parallel_size == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--algos", "respo,ppo"], "unknown algorithm 'ppo'"),
        (["--reuse", "24"], "N = 24 must be >= 1 and divide optimizer_steps = 1024"),
        (["--seeds", ""], "expected a comma-separated list of integers"),
        (["--preset", "no_such_cluster"], "run model-respo-n8-s0: cannot compose the 'respo' job"),
        (["--reuse", "8", "16"], "unexpected argument(s) '16': lists are comma-separated (--reuse 8,16"),
        (["--reuse", "8,,16"], "expected a comma-separated list of integers such as 8,16,32, got '8,,16'"),
        (["--seeds", "0;1"], "got '0;1'"),
        (["--reuse", "0"], "must be >= 1"),
        (["--seeds", "1,1"], "repeats a value"),
        (["--routing", "r4"], "invalid choice: 'r4'"),
        (["--", "actor_rollout_ref.actor.policy_loss.respo.alpha_pos=0.5"],
         "run model-respo-n8-s0: actor_rollout_ref.actor.policy_loss.respo: ReSPOConfig.alpha_pos must be >= 1"),
        (["--algos", "vespo", "--", "actor_rollout_ref.actor.policy_loss.vespo.lambda_neg=-2"],
         "VESPOConfig.lambda_neg must be >= 0, got -2.0"),
        (["--routing", "r2", "--", "model_engine=dp"], "routing replay needs model_engine=megatron"),
    ],
)  # fmt: skip
def test_bad_input_is_reported_before_anything_runs(tmp_path, capsys, argv, message):
    assert cli_main(["sweep", "--print", "--out", str(tmp_path), *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert captured.out == ""
    assert not (tmp_path / "manifest.jsonl").exists()


def test_each_algorithm_is_composed_once_and_equals_composing_each_n(tmp_path, monkeypatch):
    import respo_verl.tools.sweep.grid as grid

    calls = []

    def counting(entry, overrides):
        calls.append(overrides)
        return compose_job(entry, overrides)

    monkeypatch.setattr(grid, "compose_job", counting)
    spec = SweepSpec(algorithms=("respo", "gspo"), out_dir=tmp_path, base_overrides=("trainer.nnodes=2",))
    records = expand(spec)
    assert len(records) == 18 and len(calls) == 2
    for r in records:
        if r.seed == 1:  # composing the run itself gives the hash the grid derived
            assert r.config_hash == grid.config_hash(compose_job("respo", r.command[3:]))


def test_other_errors_are_not_reported_as_composition_failures(tmp_path, monkeypatch):
    import respo_verl.tools.sweep.grid as grid

    def broken(entry, overrides):
        raise RuntimeError("a bug")

    monkeypatch.setattr(grid, "compose_job", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        cli_main(["sweep", "--print", "--out", str(tmp_path)])


@pytest.mark.parametrize("scheme", ["", "http://"])
def test_an_unreachable_ray_address_is_one_line_and_exit_2(tmp_path, capsys, scheme):
    address = f"{scheme}127.0.0.1:{free_port()}"  # nothing listens: refused at once
    argv = ["sweep", "--ray", address, "--no-compose", "--out", str(tmp_path), "--algos", "respo", "--reuse", "8"]
    start = time.monotonic()
    assert cli_main([*argv, "--seeds", "0", "--", "trainer.nnodes=1", "trainer.n_gpus_per_node=1"]) == 2
    assert time.monotonic() - start < 10  # the probe, not Ray's 40 s of GCS retries
    err = capsys.readouterr().err
    assert err.strip() == f"respo-verl sweep: cannot reach the Ray cluster at {address}: Connection refused"


def test_printed_lines_can_be_pasted_on_the_cluster(tmp_path, capsys):
    argv = ["sweep", "--print", "--no-compose", "--out", str(tmp_path), "--algos", "vespo", "--reuse", "8"]
    assert cli_main([*argv, "--seeds", "0,1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    for line in lines:
        words = shlex.split(line)
        assert words[0].startswith("VERL_FILE_LOGGER_PATH=") and words[1:4] == ["python", "-m", "respo_verl.main_ppo"]
        assert sys.executable not in line
    assert all(r.command[0] == "python" for r in read_manifest(tmp_path / "manifest.jsonl"))


def _example_seed_keys(script: Path) -> tuple[str, set[str]]:
    """An example's default preset and the keys it sets to $SEED (its SEED_KEY and scripts/launch/launch_common.sh)."""
    text = script.read_text()
    preset = re.search(r"^PRESET=\$\{PRESET:-(\w+)\}", text, re.M)[1]
    seed_key = re.search(r"^SEED_KEY=(\S+)", text, re.M)[1]
    common = (REPO / "scripts" / "launch" / "launch_common.sh").read_text()
    keys = {key.replace("$SEED_KEY", seed_key) for key in re.findall(r'"([\w.$]+)=\$SEED"', common)}
    return preset, keys


@pytest.mark.parametrize("script", sorted((REPO / "examples").glob("run_*.sh")), ids=lambda p: p.name)
def test_the_sweep_seeds_the_keys_the_examples_seed(tmp_path, script):
    preset, example_keys = _example_seed_keys(script)
    assert "data.seed" in example_keys and len(example_keys) == 3
    spec = SweepSpec(algorithms=("respo",), reuse=(8,), seeds=(7,), preset=preset, out_dir=tmp_path)
    (record,) = expand(spec)
    swept = {o.split("=", 1)[0] for o in record.command[3:] if o.split("=", 1)[1] == "7"}
    assert swept == example_keys
    # Without composing, a model_engine= override names the engine (otherwise its seed key is not set).
    spec = SweepSpec(algorithms=("respo",), reuse=(8,), seeds=(7,), base_overrides=("model_engine=megatron",))
    (record,) = expand(spec, compose=False)
    assert "actor_rollout_ref.actor.megatron.seed=7" in record.command


SMALL_GRID = ["sweep", "--print", "--algos", "respo", "--reuse", "8", "--seeds", "0"]


@pytest.mark.parametrize("routing, suffix", [("r3", "-r3"), ("r2", "-r2"), ("off", "")])
def test_a_run_name_carries_routing_replay_when_it_is_on(tmp_path, capsys, routing, suffix):
    """The one scheme (respo_verl.run.resolvers.run_name): in the manifest, the experiment name, the log and the
    checkpoint folder alike."""
    out = tmp_path / "out"
    argv = [*SMALL_GRID, "--no-compose", "--model", "cpu-moe", "--routing", routing, "--out", str(out)]
    assert cli_main([*argv, "--checkpoints", str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()
    (record,) = read_manifest(out / "manifest.jsonl")
    name = f"cpu-moe-respo-n8-s0{suffix}"
    assert record.name == name and record.log == f"logs/{name}.jsonl"
    assert f"trainer.experiment_name={name}" in record.command
    assert f"trainer.default_local_dir={tmp_path / 'ckpt' / name}" in record.command


def test_checkpoint_folders_are_per_run_and_set_by_the_sweep_only(tmp_path, capsys):
    argv = [*SMALL_GRID[:-1], "0,1", "--no-compose", "--out", str(tmp_path / "out")]
    assert cli_main([*argv, "--checkpoints", str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()
    folders = [
        a.split("=", 1)[1]
        for r in read_manifest(tmp_path / "out" / "manifest.jsonl")
        for a in r.command
        if a.startswith("trainer.default_local_dir=")
    ]
    assert folders == [str(tmp_path / "ckpt" / "model-respo-n8-s0"), str(tmp_path / "ckpt" / "model-respo-n8-s1")]
    assert cli_main([*argv, "--", "trainer.default_local_dir=/shared/ckpt"]) == 2
    assert capsys.readouterr().err.strip() == (
        "respo-verl sweep: trainer.default_local_dir is set per run by the sweep (<checkpoint root>/<run name>, so "
        "that a run resumes from its own checkpoints only): choose the root with --checkpoints DIR instead"
    )


@pytest.mark.parametrize(
    ("override", "told"),
    [
        ("data.train_batch_size=8", "--mini-batch x N"),
        ("trainer.total_training_steps=5", "--optimizer-steps / N"),
        ("actor_rollout_ref.actor.ppo_mini_batch_size=4", "--mini-batch"),
        ("+algorithm=vespo", "--algos"),
        ("actor_rollout_ref.actor.fsdp_config.seed=3", "--seeds"),
        ("routing=r2", "--routing"),
    ],
)
def test_a_shared_override_of_a_key_each_run_sets_is_refused_naming_what_sets_it(tmp_path, capsys, override, told):
    """Each run's own overrides come after the shared ones, and Hydra keeps the last value: without the refusal the
    shared value would be dropped without a word."""
    argv = [*SMALL_GRID, "--no-compose", "--routing", "r3", "--out", str(tmp_path / "out")]
    assert cli_main([*argv, "--", override]) == 2
    key = override.split("=", 1)[0].lstrip("+")
    assert capsys.readouterr().err.strip() == (
        f"respo-verl sweep: {override}: {key} is set per run by the sweep ({told}); drop it from the shared overrides"
    )
    assert not (tmp_path / "out" / "manifest.jsonl").exists()


def test_a_reused_out_with_other_settings_or_another_grid_is_refused_in_one_line(tmp_path, capsys):
    out = tmp_path / "out"
    argv = [*SMALL_GRID, "--out", str(out), "--", "actor_rollout_ref.model.path=/m"]
    assert cli_main(argv) == 0
    (before,) = read_manifest(out / "manifest.jsonl")
    capsys.readouterr()
    assert cli_main(argv) == 0  # the same sweep again: accepted
    capsys.readouterr()

    assert cli_main([*argv, "actor_rollout_ref.actor.optim.lr=3e-6"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    changed = expand(
        SweepSpec(algorithms=("respo",), reuse=(8,), seeds=(0,), out_dir=out,
                  base_overrides=("actor_rollout_ref.model.path=/m", "actor_rollout_ref.actor.optim.lr=3e-6"))
    )[0]  # fmt: skip
    assert changed.config_hash != before.config_hash
    assert line == (
        f"respo-verl sweep: --out {out} holds run model-respo-n8-s0 with configuration hash "
        f"{before.config_hash[:12]}, this sweep's is {changed.config_hash[:12]} (there: none; here: "
        "actor_rollout_ref.actor.optim.lr=3e-6); use --force to replace it (the runs that differ start afresh), "
        "or another --out"
    )
    assert read_manifest(out / "manifest.jsonl") == [before]  # untouched

    grid_argv = [*SMALL_GRID[:-1], "0,1", "--out", str(out), "--", "actor_rollout_ref.model.path=/m"]
    assert cli_main(grid_argv) == 2
    assert capsys.readouterr().err.strip() == (
        f"respo-verl sweep: --out {out} holds another grid (runs only there: none; only in this sweep: "
        "model-respo-n8-s1); use --force to replace it (the runs that differ start afresh), or another --out"
    )


def test_force_moves_the_files_of_the_runs_that_differ_aside(tmp_path, capsys):
    """The log, output and checkpoint folder here are plain files standing for a run's: only their place matters."""
    out = tmp_path / "out"
    base = [*SMALL_GRID[:-1], "0,1", "--no-compose", "--out", str(out), "--"]
    assert cli_main([*base, "trainer.nnodes=1"]) == 0
    for seed in (0, 1):
        name = f"model-respo-n8-s{seed}"
        (out / "logs").mkdir(exist_ok=True)
        (out / "logs" / f"{name}.jsonl").write_text(json.dumps({"step": 1, "data": {"x": 1.0}}) + "\n")
        (out / "logs" / f"{name}.out").write_text("output\n")
        (out / "checkpoints" / name / "global_step_1").mkdir(parents=True)
    # What `sweep --force` does before it runs the changed grid (a sweep that runs is test_sweep_cpu.py's; --print
    # moves nothing, test_sweep_safety.py)
    changed = SweepSpec(
        algorithms=("respo",), reuse=(8,), seeds=(0,), out_dir=out, base_overrides=("trainer.nnodes=2",)
    )
    moved = replace_sweep(expand(changed, compose=False), out)
    assert [moved] == list(out.glob("replaced-*"))
    for seed in (0, 1):  # seed 1 is no longer in the grid, seed 0 has another configuration
        name = f"model-respo-n8-s{seed}"
        assert sorted(p.name for p in (moved / name).iterdir()) == [name, f"{name}.jsonl", f"{name}.out"]
        assert (moved / name / name / "global_step_1").is_dir()
        assert not (out / "logs" / f"{name}.jsonl").exists() and not (out / "checkpoints" / name).exists()


def test_a_second_sweep_in_a_folder_a_live_sweep_holds_is_refused(tmp_path, capsys):
    """The lock is held by this test's process, a live process standing for a sweep; nothing is started."""
    import fcntl
    import os

    out = tmp_path / "out"
    out.mkdir()
    fd = os.open(out / "sweep.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps({"sweep_pid": os.getpid()}).encode())
        argv = ["sweep", "--no-compose", "--algos", "respo", "--reuse", "8", "--seeds", "0", "--out", str(out)]
        assert cli_main(argv) == 2
    finally:
        os.close(fd)
    assert capsys.readouterr().err.strip() == (
        f"respo-verl sweep: another sweep (pid {os.getpid()}) is running in {out}; wait for it or stop it"
    )
    assert not (out / "logs").exists()
