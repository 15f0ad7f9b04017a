"""``respo-verl demo`` without running verl: where the log goes, the job it launches, the per-step lines, bad input.

The demo's real run (``make demo``) is the same ``main_ppo`` job that ``test_cpu_trainer.py`` runs end to end.
"""

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
