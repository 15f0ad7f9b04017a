"""``respo-verl demo``: where the logs go, the jobs it launches, the per-step lines, bad input, the figure's two kernels
on the same sequences, and (slow) the demo itself end to end: verl's trainer on the chain task, ReSPO then VESPO, and
the figure of both kernels' φ on their stale sequences.

The demo's two runs are the runs of one ``respo-verl sweep``, and its end-to-end test is the suite's one real sweep of
verl runs (tests/tools/sweep/test_sweep_cpu.py tests the sweep's mechanics on a stand-in run program): it checks what
the sweep does with verl's trainer (the runs' output in their files, their logs, the user's trackers beside the file
log the report reads, the manifest's commands and hashes, the report over the folder) besides what the demo shows."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
from support import cpu_runs
from support.trainer_checks import RESPO_KEYS, assert_trains

from respo_verl.run.compose import compose_job
from respo_verl.tools import demo
from respo_verl.tools.runs.logs import read_log
from respo_verl.tools.runs.manifest import read_manifest
from respo_verl.tools.sweep.grid import expand


def test_log_path_follows_verls_file_logger_variables(tmp_path, monkeypatch):
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)
    monkeypatch.delenv("VERL_FILE_LOGGER_ROOT", raising=False)
    assert demo.log_path(tmp_path, "respo_n4") == tmp_path.resolve() / demo.PROJECT / "respo_n4.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(tmp_path / "root"))
    assert demo.log_path(tmp_path, "x") == (tmp_path / "root").resolve() / demo.PROJECT / "x.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "exact.jsonl"))
    assert demo.log_path(tmp_path, "x") == (tmp_path / "exact.jsonl").resolve()


def test_the_launched_job_has_rollout_reuse_n_and_composes():
    cmd = demo.command(
        "respo", reuse=4, steps=8, experiment="respo_n4", overrides=["actor_rollout_ref.actor.optim.lr=1e-4"]
    )
    assert cmd[1:4] == ["-m", "respo_verl.main_ppo", "algorithm=respo"]
    cfg = compose_job("respo", cmd[3:])
    reuse = cfg.data.train_batch_size // cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    assert (reuse, cfg.trainer.total_training_steps, cfg.actor_rollout_ref.rollout.name) == (4, 8, "hf_cpu")
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(1e-4)
    assert "file" in cfg.trainer.logger


def test_follow_prints_one_line_per_logged_step(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    lines = [{"step": s, "data": {"critic/score/mean": -0.5, "actor/respo/pos/log_w_mean": -0.25}} for s in (1, 2)]
    log.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"step": 3, "da')  # a line being written
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert demo.follow(proc, log, steps=2) == 2
    out = capsys.readouterr().out.splitlines()
    assert out == ["step 1/2  reward -0.50  log W+ -0.250", "step 2/2  reward -0.50  log W+ -0.250"]


@pytest.mark.parametrize(
    "args",
    [
        ["--reuse", "0"],
        ["--steps", "0"],
        ["--algorithm", "ppo"],
        ["--quick", "--force"],
        ["trainer.default_local_dir=/tmp/elsewhere"],  # the sweep sets it per run
    ],
)
def test_bad_options_exit_2(args, capsys, tmp_path):
    """In-process: the console script's ``main``; a refusal comes before anything is launched."""
    from respo_verl import cli

    try:
        status = cli.main(["demo", "--out", str(tmp_path / "out"), *args])
    except SystemExit as exc:  # argparse's refusal of a choice
        status = exc.code
    err = capsys.readouterr().err
    assert status == 2 and err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_the_regime_line_reports_the_starved_positives_from_the_step_s_counts():
    data = {
        "critic/score/mean": -0.25,
        "actor/vespo/pos_count": 2.0,
        "actor/vespo/starved_count": 0.5,
        "actor/vespo/starved_phi_sum": 0.2,
        "actor/vespo/starved_mass_share": 0.1,
    }
    line = demo._step_line(1, 3, data, "vespo", "vespo")
    assert line == (
        "vespo  step 1/3  score -0.25  positives with log W < -1: 25%  their mean φ 0.40  their gradient mass 10%"
    )
    assert demo.starvation({}, "respo") is None


def test_the_regime_jobs_run_the_chain_task_at_the_regime_s_n_and_compose(tmp_path, capsys):
    """The sweep the demo starts, given to the sweep's own command line with ``--print`` (which composes and checks
    each run and writes the manifest): its runs are the demo's, and each composes to the chain task at N = 16 with its
    kernel trace beside its own log."""
    from respo_verl.tools.sweep import cli as sweep_cli

    out = tmp_path / "out"
    spec = demo.sweep_spec(out, demo.REGIME_REUSE, 3, ["actor_rollout_ref.actor.optim.lr=1e-4"])
    cmd = demo.sweep_command(spec)
    assert cmd[:4] == [sys.executable, "-m", "respo_verl.cli", "sweep"]
    cut = cmd.index("--")
    assert sweep_cli.main([*cmd[4:cut], "--print", *cmd[cut:]]) == 0, capsys.readouterr().err
    records = read_manifest(out / "manifest.jsonl")
    fields = [(r.name, r.algorithm, r.log, r.env, r.last_log_step) for r in records]  # what the demo follows
    assert fields == [(r.name, r.algorithm, r.log, r.env, r.last_log_step) for r in expand(spec, compose=False)]
    assert [r.name for r in records] == ["cpu-chain-respo-n16-s0", "cpu-chain-vespo-n16-s0"]
    for record, algorithm in zip(records, demo.REGIME_ALGORITHMS, strict=True):
        assert record.algorithm == algorithm and record.config_hash
        cfg = compose_job("respo", record.command[3:])  # our entry point's composition
        reuse = cfg.data.train_batch_size // cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        assert reuse == demo.REGIME_REUSE == 16 and cfg.trainer.total_training_steps == 3
        assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == algorithm
        assert cfg.actor_rollout_ref.rollout.n == demo.SAMPLES_PER_PROMPT
        assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(1e-4)
        assert cfg.actor_rollout_ref.rollout.custom.stop_rule == "respo_verl.cpu.kit.chain:ends_answer"
        assert cfg.data.max_response_length == 51 and cfg.actor_rollout_ref.model.path.endswith("/chain/model")
        assert cfg.ray_kwargs.ray_init.runtime_env.env_vars[demo.TRACE_ENV] == demo.TRACE_BESIDE_LOG
        log = (out / "logs" / f"{record.name}.jsonl").resolve()
        assert record.env == {"VERL_FILE_LOGGER_PATH": str(log)}
        assert demo.trace_of(log) == log.parent / f"{record.name}.trace.jsonl"


def test_the_regime_demo_prints_each_run_s_logged_steps_in_turn(tmp_path, capsys):
    """After the sweep has ended (a rerun whose runs were skipped, or a failed sweep): every logged step of each run,
    in the sweep's order, labelled with its method; a line still being written is not printed."""
    out = tmp_path / "out"
    records = expand(demo.sweep_spec(out, 4, 2, []), compose=False)
    (out / "logs").mkdir(parents=True)
    for record in records:
        prefix = f"actor/{record.algorithm}/"
        data = {prefix + "pos_count": 4.0, prefix + "starved_count": 1.0, prefix + "starved_phi_sum": 0.5,
                prefix + "starved_mass_share": 0.25}  # fmt: skip
        lines = [json.dumps({"step": s, "data": data}) + "\n" for s in (1, 2)]
        (out / record.log).write_text("".join(lines) + '{"step": 3, "da')
    sweep = subprocess.Popen([sys.executable, "-c", "pass"])
    sweep.wait()
    demo.follow_sweep(sweep, records, out)
    tail = "positives with log W < -1: 25%  their mean φ 0.50  their gradient mass 25%"
    assert capsys.readouterr().out.splitlines() == [
        f"{algorithm:<6} step {step}/2  {tail}" for algorithm in demo.REGIME_ALGORITHMS for step in (1, 2)
    ]


def test_a_rerun_starts_afresh_only_the_runs_the_sweep_will_run(tmp_path):
    """Whose kernel traces the demo clears before its sweep: none when the sweep will refuse ``--out`` (other settings
    without ``--force``), only the incomplete runs when nothing changed, and with ``--force`` the runs that differ."""
    from respo_verl.tools.runs.manifest import write_manifest

    out = tmp_path / "out"
    done = expand(demo.sweep_spec(out, 4, 2, []), compose=False)
    write_manifest(done, out)
    (out / "logs").mkdir()
    steps = "".join(json.dumps({"step": s, "data": {"critic/score/mean": 0.5}}) + "\n" for s in (1, 2))
    (out / done[0].log).write_text(steps)  # ReSPO's run complete, VESPO's not started
    assert [r.name for r in demo._started_afresh(done, out, force=False)] == [done[1].name]
    longer = expand(demo.sweep_spec(out, 4, 3, []), compose=False)
    assert demo._started_afresh(longer, out, force=False) == []
    assert [r.name for r in demo._started_afresh(longer, out, force=True)] == [r.name for r in longer]


# The demo's trackers in its end-to-end test: the user's override through the demo (passed to its sweep), with
# TensorBoard, whose event files the test reads back.
TRACKED_LOGGERS = ("console", "file", "tensorboard")
# Where verl's TensorBoard logger writes when set; unset, it writes to tensorboard_log/<project>/<experiment> under
# the run's directory (verl.utils.tracking).
TENSORBOARD_DIR_ENV = "TENSORBOARD_DIR"
# A scalar verl logs at every step, in the file log and to every other tracker.
STEP_SCALAR = "critic/score/mean"


def _assert_tensorboard_matches_the_file_log(folder, entries: list[dict]) -> None:
    """The run's TensorBoard events are readable and hold what its file log holds: the same scalar tags, and
    :data:`STEP_SCALAR` once per logged step with the file log's value (TensorBoard keeps float32)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs_dir = folder.parents[2]  # <runs' directory>/tensorboard_log/<project>/<run>
    found = sorted(str(p.relative_to(runs_dir)) for p in runs_dir.rglob("events.out.tfevents.*"))
    assert list(folder.glob("events.out.tfevents.*")), (folder, found)
    events = EventAccumulator(str(folder))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert set(entries[0]["data"]) <= tags, sorted(set(entries[0]["data"]) - tags)
    scalars = events.Scalars(STEP_SCALAR)
    assert [e.step for e in scalars] == [entry["step"] for entry in entries]
    assert [e.value for e in scalars] == pytest.approx([entry["data"][STEP_SCALAR] for entry in entries], rel=1e-6)


def _respo(log_w: float, positive: bool) -> float:
    """ReSPO's default kernel by hand: φ+(W) = ((1 + W)/2)·e^(1 − W), φ−(W) = √W·e^(2(1 − √W)) (docs/method.md)."""
    w = math.exp(log_w)
    return (1 + w) / 2 * math.exp(1 - w) if positive else math.sqrt(w) * math.exp(2 * (1 - math.sqrt(w)))


def _vespo(log_w: float, positive: bool) -> float:
    """VESPO's default kernel by hand: W^k·e^(λ(1 − W)), k, λ = 2, 3 for positives and 3, 2 for negatives."""
    w = math.exp(log_w)
    k, lam = (2, 3) if positive else (3, 2)
    return w**k * math.exp(lam * (1 - w))


def test_the_figure_puts_both_kernels_on_the_same_stale_sequences(tmp_path):
    """The stale sequences of both runs, pooled (on-policy ones, log W = 0 exactly, left out; negatives only above
    log W = +1), each evaluated under both kernels, whatever φ the run that made it traced."""
    rows = {
        "respo": {"log_w": [0.0, -2.0, 1.5, 0.5, -0.2], "phi": [1.0, 9.0, 9.0, 9.0, 9.0], "adv": [1, 1, -1, -1, 1]},
        "vespo": {"log_w": [0.0, -1.5, 3.0], "phi": [1.0, 9.0, 9.0], "adv": [-1, 1, -1]},
    }
    runs = {}
    for algorithm, row in rows.items():
        trace = tmp_path / f"{algorithm}.trace.jsonl"
        (tmp_path / f"{trace.name}.rank0").write_text(json.dumps(row) + "\n")
        runs[algorithm] = (tmp_path / f"{algorithm}.jsonl", trace)
    pooled = demo.stale_sequences([trace for _, trace in runs.values()])
    assert pooled == {"positives": [-2.0, -0.2, -1.5], "negatives_high": [1.5, 3.0]}
    for group, positive in (("positives", True), ("negatives_high", False)):
        phi = demo.both_kernels(pooled[group], positive)
        assert phi["respo"] == pytest.approx([_respo(w, positive) for w in pooled[group]], rel=1e-12)
        assert phi["vespo"] == pytest.approx([_vespo(w, positive) for w in pooled[group]], rel=1e-12)
    titles = demo.plot_mechanism(runs, tmp_path / "figure.png")
    starved = (-2.0, -1.5)
    assert titles[0] == (
        "the same 3 stale positives, 2 below log W = -1:\ntheir mean φ under ReSPO "
        f"{sum(_respo(w, True) for w in starved) / 2:.2f}, under VESPO {sum(_vespo(w, True) for w in starved) / 2:.2f}"
    )
    high = (1.5, 3.0)
    assert titles[1] == (
        "the same 2 stale negatives with log W > +1:\ntheir mean φ under ReSPO "
        f"{sum(_respo(w, False) for w in high) / 2:.2f}, under VESPO {sum(_vespo(w, False) for w in high) / 2:.2f}"
    )
    assert (tmp_path / "figure.png").stat().st_size > 0
    calm = {"log_w": [-2.0], "phi": [1.0], "adv": [1]}
    (tmp_path / "vespo.trace.jsonl.rank0").write_text(json.dumps(calm) + "\n")
    (tmp_path / "respo.trace.jsonl.rank0").write_text(json.dumps(calm) + "\n")
    assert demo.plot_mechanism(runs, tmp_path / "calm.png")[1] == "no stale negative with log W > +1 in these runs"


@pytest.mark.slow
def test_make_demo_shows_starved_positives_weighted_under_respo_and_not_under_vespo(tmp_path):
    """The demo end to end, 2 steps per method, through ``respo-verl sweep`` (the suite's one real sweep of verl runs,
    see the module docstring). The thresholds come from the kernels, fixed before any run: a positive with
    log W < -1 gets φ above ReSPO's φ(-1) = 1.287 and below VESPO's φ(-1) = 0.902, so the starved positives' mean φ
    must be on those sides; and at least 10 % of the stale positives of each run must be starved (the regime, a
    threshold set before looking at scores)."""
    import torch

    from respo_verl.core.config import ReSPOConfig, VESPOConfig
    from respo_verl.core.kernels import respo_phi, vespo_phi

    env = cpu_runs.run_env(None)  # no file-logger variables: the sweep sets each run's log
    env.pop(TENSORBOARD_DIR_ENV, None)  # verl's default folder, per run, under the runs' directory (tmp_path)
    out = tmp_path / "demo"
    ray_tmp = cpu_runs.ray_temp_dir()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "respo_verl.cli", "demo", "--steps", "2", "--out", str(out),
             f"+ray_kwargs.ray_init._temp_dir={ray_tmp}", f"trainer.logger=[{','.join(TRACKED_LOGGERS)}]"],
            capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path,
        )  # fmt: skip
    finally:  # one verl driver per attempt the sweep started, counted with the suite's (tests/support/cpu_runs.py)
        attempts = sum(path.read_text().count("=== respo-verl sweep") for path in (out / "logs").glob("*.out"))
        cpu_runs.record_drivers(attempts, "respo-verl demo")
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    lines = proc.stdout.splitlines()
    for algorithm in demo.REGIME_ALGORITHMS:
        assert sum(line.startswith(f"{algorithm}  step ") for line in lines) == 2, proc.stdout
    assert "respo-verl demo:" in lines[-1] and "s in all" in lines[-1]

    # The sweep: both runs done, their own output in their files, not in the sweep's.
    sweep = (out / demo.SWEEP_OUTPUT).read_text()
    assert sweep.rstrip().splitlines()[-1] == "2 done", sweep[-3000:]
    assert "TaskRunner" not in sweep and "TaskRunner" not in proc.stdout
    manifest = {r.name: r for r in read_manifest(out / "manifest.jsonl")}
    names = {algorithm: f"{demo.SWEEP_MODEL}-{algorithm}-n16-s0" for algorithm in demo.REGIME_ALGORITHMS}
    assert sorted(manifest) == sorted(names.values())
    for algorithm, name in names.items():
        log = read_log(out / "logs" / f"{name}.jsonl")
        assert log.steps == [1, 2] and log.continuity == [], (name, log.continuity)
        entries = [json.loads(line) for line in (out / "logs" / f"{name}.jsonl").read_text().splitlines()]
        assert_trains(entries)
        keys = RESPO_KEYS if algorithm == "respo" else ("actor/vespo/starved_mass_share",)
        for entry in entries:
            assert not [k for k in keys if k not in entry["data"]], (name, sorted(entry["data"]))
        assert "=== respo-verl sweep" in (out / "logs" / f"{name}.out").read_text()
        record = manifest[name]
        assert record.command[:3] == ["python", "-m", "respo_verl.main_ppo"] and record.config_hash
        assert f"trainer.logger=[{','.join(TRACKED_LOGGERS)}]" in record.command
        _assert_tensorboard_matches_the_file_log(
            tmp_path / "tensorboard_log" / demo.sweep_spec(out, demo.REGIME_REUSE, 2, []).project / name, entries
        )

    minus_one = torch.tensor([-1.0], dtype=torch.float64)
    yes = torch.tensor([True])
    bound = {
        "respo": float(respo_phi(minus_one, yes, ReSPOConfig())[0]),
        "vespo": float(vespo_phi(minus_one, yes, VESPOConfig())[0]),
    }
    assert bound["respo"] == pytest.approx(1.287, abs=1e-3) and bound["vespo"] == pytest.approx(0.902, abs=1e-3)
    runs = {}
    for algorithm, name in names.items():
        log = out / "logs" / f"{name}.jsonl"
        trace = log.with_suffix(".trace.jsonl")
        runs[algorithm] = (log, trace)
        stale = demo.stale_positives(trace)
        starved = [phi for log_w, phi in stale if log_w < -1.0]
        assert len(stale) > 0 and len(starved) >= 0.1 * len(stale), (algorithm, len(starved), len(stale))
        mean = sum(starved) / len(starved)
        if algorithm == "respo":
            assert mean >= bound["respo"], mean
        else:
            assert mean < bound["vespo"], mean
        # φ is the kernel of the log W the loss saw, for every traced positive (float32 in the trainer).
        kernel = respo_phi if algorithm == "respo" else vespo_phi
        config = ReSPOConfig() if algorithm == "respo" else VESPOConfig()
        log_w = torch.tensor([w for w, _ in stale], dtype=torch.float64)
        expected = kernel(log_w, torch.ones_like(log_w, dtype=torch.bool), config)
        torch.testing.assert_close(
            torch.tensor([p for _, p in stale], dtype=torch.float64), expected, rtol=1e-5, atol=1e-6
        )
    figure = out / "report" / demo.FIGURE
    assert figure.is_file()
    titles = demo.plot_mechanism(runs, tmp_path / "again.png")
    pooled = demo.stale_sequences([trace for _, trace in runs.values()])
    n_pos = len(demo.stale_positives(runs["respo"][1])) + len(demo.stale_positives(runs["vespo"][1]))
    assert len(titles) == 2 and titles[0].startswith(f"the same {n_pos} stale positives, ") == (n_pos > 0)
    assert len(pooled["positives"]) == n_pos
    assert titles[1].startswith(f"the same {len(pooled['negatives_high'])} stale negatives with log W > +1") or (
        not pooled["negatives_high"] and titles[1] == "no stale negative with log W > +1 in these runs"
    )
    report = (out / "report" / "report.md").read_text()
    assert "| ReSPO | 16 | 0 |" in report and "| VESPO | 16 | 0 |" in report, report
