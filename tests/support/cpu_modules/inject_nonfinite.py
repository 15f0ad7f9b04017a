"""Fault injection for the CPU end-to-end test: the registered ``respo`` loss receives a NaN log-probability.

Loaded in every Ray process of one test run through ``VERL_USE_EXTERNAL_MODULES`` (after the plugin). It wraps the
loss that the plugin registered, puts NaN on the first response token of every sequence, and calls the real loss,
which must refuse it with FloatingPointError. With ``INJECT_NONFINITE_AFTER=<log>@<k>`` in the run's Ray environment
it does so only once verl's file log ``<log>`` holds k steps, i.e. in the update of step k + 1
(tests/support/cpu_runs.py, ``after_steps``).
"""

import os
from pathlib import Path

from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

from respo_verl.verl import losses  # noqa: F401  (registers "respo" here whatever order verl loads modules in)

AFTER_ENV = "INJECT_NONFINITE_AFTER"
_respo = POLICY_LOSS_REGISTRY["respo"]


def _armed() -> bool:
    log, _, steps = os.environ.get(AFTER_ENV, "").rpartition("@")
    if not log:
        return True
    path = Path(log)
    logged = path.read_text().count('"step"') if path.is_file() else 0
    return logged >= int(steps)


def _respo_with_nan_log_prob(old_log_prob, log_prob, advantages, response_mask, *args, **kwargs):
    if _armed():
        log_prob = log_prob.clone()
        log_prob[:, 0] = float("nan")
    return _respo(old_log_prob, log_prob, advantages, response_mask, *args, **kwargs)


POLICY_LOSS_REGISTRY["respo"] = _respo_with_nan_log_prob
