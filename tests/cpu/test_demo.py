"""``respo-verl demo``: where the logs go, the jobs it launches, the per-step lines, bad input, and (slow) the demo
itself end to end: verl's trainer on the chain task, ReSPO then VESPO, and the figure of the φ their stale positives
received."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from respo_verl.tools import demo
from respo_verl.verl.compose import compose_job


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


@pytest.mark.parametrize("args", [["--reuse", "0"], ["--steps", "0"], ["--algorithm", "ppo"]])
def test_bad_options_exit_2(args):
    proc = subprocess.run([sys.executable, "-m", "respo_verl.cli", "demo", *args], capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr


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


def test_the_regime_jobs_run_the_chain_task_at_the_regime_s_n_and_compose():
    cmd = demo.command("vespo", demo.REGIME_REUSE, 3, "vespo_n16", [], task="cpu_chain")
    cfg = compose_job("respo", cmd[3:])  # our entry point's composition
    reuse = cfg.data.train_batch_size // cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    assert reuse == demo.REGIME_REUSE == 16
    assert cfg.actor_rollout_ref.rollout.custom.stop_rule == "respo_verl.cpu.kit.chain:ends_answer"
    assert cfg.data.max_response_length == 51 and cfg.actor_rollout_ref.model.path.endswith("/chain/model")


@pytest.mark.slow
def test_make_demo_shows_starved_positives_weighted_under_respo_and_not_under_vespo(tmp_path):
    """The demo end to end, 2 steps per method. The thresholds come from the kernels, fixed before any run: a
    positive with log W < -1 gets φ above ReSPO's φ(-1) = 1.287 and below VESPO's φ(-1) = 0.902, so the starved
    positives' mean φ must be on those sides; and at least 10 % of the stale positives of each run must be starved
    (the regime, a threshold set before looking at scores)."""
    import torch

    from respo_verl.core.config import ReSPOConfig, VESPOConfig
    from respo_verl.core.kernels import respo_phi, vespo_phi

    env = {**__import__("os").environ, "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"}
    env.pop("VERL_FILE_LOGGER_PATH", None)
    env.pop("VERL_FILE_LOGGER_ROOT", None)
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "respo_verl.cli", "demo", "--steps", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    lines = proc.stdout.splitlines()
    for algorithm in demo.REGIME_ALGORITHMS:
        assert sum(line.startswith(f"{algorithm}  step ") for line in lines) == 2, proc.stdout
    assert "respo-verl demo:" in lines[-1] and "s in all" in lines[-1]

    minus_one = torch.tensor([-1.0], dtype=torch.float64)
    yes = torch.tensor([True])
    bound = {
        "respo": float(respo_phi(minus_one, yes, ReSPOConfig())[0]),
        "vespo": float(vespo_phi(minus_one, yes, VESPOConfig())[0]),
    }
    assert bound["respo"] == pytest.approx(1.287, abs=1e-3) and bound["vespo"] == pytest.approx(0.902, abs=1e-3)
    runs = {}
    for algorithm in demo.REGIME_ALGORITHMS:
        log = out / demo.PROJECT / f"{algorithm}_n16.jsonl"
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
    assert len(titles) == 3 and titles[0].startswith("respo: ") and titles[1].startswith("vespo: ")
    assert "stale positives below log W = -1" in titles[0] and titles[2].startswith("score per step")
    report = (out / "report" / "report.md").read_text()
    assert "ReSPO" in report and "VESPO" in report
