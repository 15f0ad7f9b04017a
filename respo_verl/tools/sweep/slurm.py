"""The Slurm executor of ``respo-verl sweep --slurm``: the sweep's incomplete runs as one Slurm job array, each task
one run through the Slurm template (scripts/launch/slurm/respo_verl.sbatch: Ray over the task's allocation, the run
on its first node, requeue on pre-emption).

The manifest decides which runs are incomplete; task i runs the i-th of them, through a script written to
``<out>/slurm/array-<time>/`` (the template's ``SCRIPT``) that sends the run's output to its ``<name>.out`` and
runs its manifest line. ``--max-running K`` is the array's ``%K``; ``--sbatch "<options>"`` goes to sbatch as it is
(nodes, GPUs, time, partition). The sweep then waits with one progress line and reports a failed run with the last
lines of its output and the task's exit status, as the other executors do. The array's id is kept in
``<out>/slurm/array.json``: the same command run again waits for that array while it has tasks, and otherwise
submits only what is still incomplete. Ctrl-C stops the waiting, not the array, as with ``--ray``: the runs belong
to the cluster, not to the shell that submitted them; the line printed names the ``scancel`` that ends them.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

from respo_verl.tools.runs.manifest import RunRecord
from respo_verl.tools.sweep.local import failure_report, logged_steps, output_path
from respo_verl.tools.sweep.progress import SweepProgress
from respo_verl.tools.sweep.runner import ClusterError, Outcome, Status, ended_outcomes, is_complete, shell_line

CHECKOUT = Path(__file__).resolve().parents[3]
TEMPLATE = CHECKOUT / "scripts/launch/slurm/respo_verl.sbatch"
STATE = "array.json"
POLL_S = 2.0
UNKNOWN_POLLS = 5  # an array Slurm does not know for this many polls in a row has ended (MinJobAge passed)
ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING",
          "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT")  # fmt: skip
TASK_SCRIPT = """#!/usr/bin/env bash
# respo-verl sweep --slurm: array task i runs the i-th line of runs (written by the sweep; its output to its .out)
set -euo pipefail
RUNS=({runs})
OUTPUTS=({outputs})
i=${{SLURM_ARRAY_TASK_ID:?run by the job array of respo-verl sweep --slurm}}
exec >> "${{OUTPUTS[i]}}" 2>&1
cd {cwd}  # where the sweep ran: its manifest's paths are relative to it
echo "=== respo-verl sweep, Slurm job ${{SLURM_ARRAY_JOB_ID}}_$i on $(hostname), started $(date -u '+%F %T UTC')"
exec bash -c "${{RUNS[i]}} \\"\\$@\\"" run "$@"
"""


def _slurm(cmd: list[str]) -> str:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise ClusterError(f"--slurm: {cmd[0]} not found: run the sweep where Slurm's commands are") from None
    if res.returncode != 0:
        raise ClusterError(f"--slurm: {shlex.join(cmd)} failed (exit {res.returncode}): {res.stderr.strip()}")
    return res.stdout


def _tasks(job_id: str) -> dict[int, dict[str, str]]:
    """The array's tasks that Slurm still knows (``scontrol show job``: running, pending, or ended within
    MinJobAge), by task id: their JobState, ExitCode and Reason."""
    res = subprocess.run(["scontrol", "show", "job", "--oneliner", job_id], capture_output=True, text=True, timeout=60)
    tasks = {}
    for line in res.stdout.splitlines():
        fields = dict(item.partition("=")[::2] for item in line.split() if "=" in item)
        task = fields.get("ArrayTaskId", "")
        if task.isdigit():
            tasks[int(task)] = fields
        elif task:  # pending tasks grouped in one record: "2-5%1", "3,5"
            for part in task.split("%")[0].split(","):
                first, _, last = part.partition("-")
                for i in range(int(first), int(last or first) + 1):
                    tasks[i] = fields
    return tasks


def _state_file(out_dir: Path) -> Path:
    return out_dir / "slurm" / STATE


def _active_array(out_dir: Path) -> dict | None:
    """The array of an earlier ``--slurm`` sweep of this folder while it has tasks that are not over."""
    path = _state_file(out_dir)
    if not path.is_file():
        return None
    state = json.loads(path.read_text())
    tasks = _tasks(state["job_id"])
    if any(fields.get("JobState") in ACTIVE for fields in tasks.values()):
        return state
    return None


def submit_array(
    records: list[RunRecord], out_dir: Path, max_running: int | None, sbatch_options: str, env: dict[str, str]
) -> dict | None:
    """Submit the incomplete runs as one array; its state (job id, run per task), or None when all are complete."""
    todo = [r for r in records if not is_complete(r, out_dir)]
    if not todo:
        return None
    if not TEMPLATE.is_file():
        raise ClusterError(f"--slurm needs the Slurm template {TEMPLATE}, which this installation lacks")
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    folder = out_dir.resolve() / "slurm" / f"array-{stamp}"
    folder.mkdir(parents=True, exist_ok=True)
    outputs = [output_path(r, out_dir).resolve() for r in todo]
    for output in outputs:
        output.parent.mkdir(parents=True, exist_ok=True)
    script = folder / "task.sh"
    script.write_text(
        TASK_SCRIPT.format(
            runs=" ".join(shlex.quote(shell_line(r)) for r in todo),
            outputs=" ".join(shlex.quote(str(o)) for o in outputs),
            cwd=shlex.quote(os.getcwd()),
        )
    )
    array = f"0-{len(todo) - 1}" + (f"%{max_running}" if max_running else "")
    cmd = ["sbatch", "--parsable", f"--array={array}", f"--output={folder}/%A_%a.out", "--job-name=respo-sweep"]
    cmd += [*shlex.split(sbatch_options), str(TEMPLATE)]
    try:
        # from the checkout, whose scripts the template runs by their relative paths (it starts in the submit folder)
        res = subprocess.run(
            cmd, capture_output=True, text=True, timeout=120, env={**env, "SCRIPT": str(script)}, cwd=CHECKOUT
        )
    except FileNotFoundError:
        raise ClusterError("--slurm: sbatch not found: run the sweep where Slurm's commands are") from None
    if res.returncode != 0:
        raise ClusterError(f"--slurm: {shlex.join(cmd)} failed (exit {res.returncode}): {res.stderr.strip()}")
    state = {"job_id": res.stdout.strip().split(";")[0], "runs": [r.name for r in todo], "folder": str(folder)}
    _state_file(out_dir).write_text(json.dumps(state) + "\n")
    return state


def wait_for_array(
    records: list[RunRecord], out_dir: Path, state: dict, stream=None, interactive=None
) -> list[Outcome]:
    """Wait for the array's tasks with a progress line; one outcome per run of ``records``."""
    by_name = {r.name: r for r in records}
    job_id, runs = state["job_id"], state["runs"]
    progress = SweepProgress(records, sum(logged_steps(r, out_dir) for r in records), stream, interactive)
    ended: dict[str, Outcome] = {}
    unknown = 0  # polls in a row where Slurm knew no task of the array (slurmctld busy, or the array forgotten)
    try:
        while True:
            tasks = _tasks(job_id)
            unknown = 0 if tasks else unknown + 1
            if 0 < unknown < UNKNOWN_POLLS:
                time.sleep(POLL_S)
                continue
            running = []
            for i, name in enumerate(runs):
                if name in ended or name not in by_name:
                    continue
                record, fields = by_name[name], tasks.get(i, {})
                job_state = fields.get("JobState", "")
                logged = logged_steps(record, out_dir)
                if job_state in ACTIVE:
                    if job_state == "RUNNING":
                        running.append(f"{name} step {logged} of {record.last_log_step}")
                    continue
                if job_state == "COMPLETED" and is_complete(record, out_dir):
                    line = f"ran as Slurm job {job_id}_{i}: {record.last_log_step} steps"
                    ended[name] = Outcome(name, Status.RAN, line)
                    progress.write(f"{name}: Slurm job {job_id}_{i} completed")
                    continue
                how = f"Slurm job {job_id}_{i} {job_state or 'no longer known to Slurm'}"
                if fields.get("ExitCode"):
                    how += f", exit status {fields['ExitCode'].split(':')[0]}"
                ended[name] = Outcome(name, Status.FAILED, f"failed: {how}")
                output = output_path(record, out_dir)
                text = output.read_text(errors="replace") if output.is_file() else ""
                progress.write(failure_report(record, how, logged, text, output))
                progress.drop(record.last_log_step - logged)
            done = sum(is_complete(r, out_dir) for r in records)
            failed = sum(o.status is Status.FAILED for o in ended.values())
            desc = f"{done} done, {len(running)} running, {failed} failed of {len(records)} runs"
            if running:
                desc += f" ({'; '.join(running)})"
            progress.show(desc, sum(logged_steps(r, out_dir) for r in records))
            if all(name in ended for name in runs if name in by_name):
                break
            time.sleep(POLL_S)
    finally:
        progress.close()
    return ended_outcomes(records, ended, out_dir)


def run_on_slurm(
    records: list[RunRecord], out_dir: Path, max_running: int | None, sbatch_options: str, echo=print
) -> list[Outcome]:
    """Submit the sweep's incomplete runs as one job array (or find the array a sweep of this folder submitted,
    while it has tasks) and wait for it (see the module docstring)."""
    state = _active_array(out_dir)
    if state is not None:
        echo(f"Slurm job array {state['job_id']} of this folder still runs: waiting for it")
    else:
        state = submit_array(records, out_dir, max_running, sbatch_options, dict(os.environ))
        if state is None:
            return [Outcome(r.name, Status.SKIPPED, "skipped: log complete") for r in records]
        echo(f"submitted {len(state['runs'])} runs as Slurm job array {state['job_id']}")
    try:
        return wait_for_array(records, out_dir, state)
    except KeyboardInterrupt:
        echo(
            f"respo-verl sweep: stopped waiting; Slurm job array {state['job_id']} goes on (the same command waits "
            f"for it again; scancel {state['job_id']} ends its runs)"
        )
        raise
