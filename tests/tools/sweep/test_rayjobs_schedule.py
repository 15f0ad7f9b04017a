"""``respo-verl sweep --ray`` never overfills the cluster: the scheduling of :mod:`respo_verl.tools.sweep.rayjobs`
against a stand-in job client (no Ray), and how the sweep learns each run's GPU slots.

The same on a real Ray head with real jobs holding their slots (3 runs of 1 slot on 2 slots):
tests/tools/sweep/test_sweep_ray.py.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from respo_verl.tools.sweep import rayjobs
from respo_verl.tools.sweep.cli import main as sweep_main
from respo_verl.tools.sweep.grid import SweepSpec, expand_with_gpus, job_gpus, overrides_gpus
from respo_verl.tools.sweep.runner import ClusterError, Status

ADDRESS = "http://head:8265"


class Jobs:
    """Ray's job client as the sweep uses it: jobs with a status and metadata, submitted PENDING."""

    def __init__(self, others: list[dict] | None = None):
        self.jobs = [self._job(f"other-{i}", metadata) for i, metadata in enumerate(others or [])]

    @staticmethod
    def _job(submission_id: str, metadata: dict, status: str = "RUNNING"):
        return types.SimpleNamespace(submission_id=submission_id, metadata=metadata, status=status, start_time=0)

    def list_jobs(self):
        return list(self.jobs)

    def submit_job(self, entrypoint: str, submission_id: str, metadata: dict) -> str:
        self.jobs.append(self._job(submission_id, metadata, "PENDING"))
        return submission_id

    def get_address(self) -> str:
        return ADDRESS

    def end(self, run: str) -> None:
        for job in self.jobs:
            if job.metadata.get(rayjobs.RUN_KEY) == run:
                job.status = "SUCCEEDED"

    def active_runs(self) -> list[str]:
        return [
            j.metadata[rayjobs.RUN_KEY]
            for j in self.jobs
            if j.status in rayjobs.ACTIVE and rayjobs.RUN_KEY in j.metadata
        ]


def _records(out: Path, seeds: int = 3):
    spec = SweepSpec(algorithms=("respo",), reuse=(2,), seeds=tuple(range(seeds)), optimizer_steps=4, out_dir=out)
    records, _ = expand_with_gpus(spec, compose=False)
    return records


@pytest.fixture
def cluster(monkeypatch):
    """The cluster's GPUs, as the test sets them (``cluster["gpus"]``)."""
    state = {"gpus": 2}
    monkeypatch.setattr(rayjobs, "cluster_gpus", lambda client: state["gpus"])
    return state


def _sweep(records, client, out, slots=1, max_running=None):
    return rayjobs.RaySweep(records, {r.name: slots for r in records}, out, client, max_running)


def test_runs_wait_while_their_slots_are_taken_and_start_as_runs_end(tmp_path, cluster):
    records, client = _records(tmp_path), Jobs()
    sweep = _sweep(records, client, tmp_path)
    assert sweep.find() == []
    first = sweep.submit_fitting()
    assert [o.name for o in first] == [r.name for r in records[:2]] and [r.name for r in sweep.waiting] == [
        records[2].name
    ]
    assert all(o.status is Status.SUBMITTED and o.line.startswith("submitted as job ") for o in first)
    assert [j.metadata[rayjobs.GPUS_KEY] for j in client.jobs] == ["1", "1"]
    assert sweep.submit_fitting() == []  # nothing has ended: the third still waits
    client.end(records[0].name)
    assert [o.name for o in sweep.submit_fitting()] == [records[2].name] and sweep.waiting == []
    assert client.active_runs() == [records[1].name, records[2].name]


def test_max_running_caps_it_below_what_the_gpus_hold(tmp_path, cluster):
    cluster["gpus"] = 8
    records, client = _records(tmp_path), Jobs()
    sweep = _sweep(records, client, tmp_path, max_running=1)
    sweep.find()
    assert len(sweep.submit_fitting()) == 1 and len(sweep.waiting) == 2
    client.end(records[0].name)
    assert [o.name for o in sweep.submit_fitting()] == [records[1].name]


def test_the_jobs_of_other_sweeps_count_and_other_jobs_do_not(tmp_path, cluster):
    cluster["gpus"] = 3
    others = [{rayjobs.RUN_KEY: "x", rayjobs.OUT_KEY: "/elsewhere", rayjobs.GPUS_KEY: "2"}, {"not": "a sweep's"}]
    records, client = _records(tmp_path), Jobs(others)
    sweep = _sweep(records, client, tmp_path)
    sweep.find()
    assert [o.name for o in sweep.submit_fitting()] == [records[0].name]


def test_runs_of_this_folder_already_running_are_waited_on_and_counted(tmp_path, cluster):
    records, client = _records(tmp_path), Jobs()
    client.submit_job("true", "earlier-1", {rayjobs.RUN_KEY: records[1].name, rayjobs.OUT_KEY: str(tmp_path.resolve()),
                                           rayjobs.GPUS_KEY: "1"})  # fmt: skip
    sweep = _sweep(records, client, tmp_path)
    found = sweep.find()
    assert [(o.name, o.line) for o in found] == [(records[1].name, "already PENDING as job earlier-1")]
    assert [o.name for o in sweep.submit_fitting()] == [records[0].name]
    assert [r.name for r in sweep.waiting] == [records[2].name]


def test_a_run_larger_than_the_cluster_is_an_error_naming_it(tmp_path, cluster):
    records = _records(tmp_path, seeds=2)
    sweep = _sweep(records, Jobs(), tmp_path, slots=16)
    with pytest.raises(ClusterError) as info:
        sweep.find()
    assert str(info.value) == (
        f"run {records[0].name} (and 1 more runs) needs 16 GPU slots (trainer.nnodes x trainer.n_gpus_per_node), but "
        f"the Ray cluster at {ADDRESS} has 2: choose a preset for this cluster"
    )


def test_no_wait_submits_what_fits_and_names_the_runs_left_waiting(tmp_path, cluster):
    records, client, lines = _records(tmp_path), Jobs(), []
    gpus = {r.name: 1 for r in records}
    outcomes = rayjobs.run_on_ray(records, gpus, tmp_path, client, wait=False, echo=lines.append)
    assert [o.status for o in outcomes] == [Status.SUBMITTED, Status.SUBMITTED, Status.WAITING]
    assert lines[2] == (
        f"{records[2].name}: waiting: its 1 GPU slots are not free (2 of the cluster's 2 are taken by sweeps' jobs) or "
        "--max-running is reached; the same command submits it once a run has ended"
    )
    client.end(records[0].name)  # the same command, once the first run is done, submits the waiting one
    log = tmp_path / records[0].log
    log.write_text(
        "".join(
            json.dumps({"step": s, "data": {"critic/score/mean": 0.0}}) + "\n"
            for s in range(1, records[0].last_log_step + 1)
        )
    )
    again = rayjobs.run_on_ray(records, gpus, tmp_path, client, wait=False, echo=lines.append)
    assert [(o.name, o.status) for o in again] == [
        (records[0].name, Status.SKIPPED),
        (records[1].name, Status.SUBMITTED),
        (records[2].name, Status.SUBMITTED),
    ]
    assert lines[-1] == f"{records[2].name}: submitted as job {client.jobs[-1].submission_id}"


def test_the_gpu_slots_of_a_composed_run_are_its_pools():
    from conftest import compose

    job = compose(["algorithm=respo", "trainer.nnodes=2", "trainer.n_gpus_per_node=4"])
    assert job_gpus(job) == 8
    pooled = compose(
        [
            "algorithm=respo", "trainer.nnodes=2", "trainer.n_gpus_per_node=4",
            "reward.reward_model.enable_resource_pool=true", "reward.reward_model.nnodes=1",
            "reward.reward_model.n_gpus_per_node=2",
        ]
    )  # fmt: skip
    assert job_gpus(pooled) == 10


def test_without_composing_the_overrides_say_the_slots():
    assert overrides_gpus(["trainer.nnodes=2", "x=1", "trainer.n_gpus_per_node=8"]) == 16
    assert overrides_gpus(["trainer.nnodes=2"]) is None
    with pytest.raises(ValueError, match=r"trainer.n_gpus_per_node=0: a run needs a whole number of at least 1"):
        overrides_gpus(["trainer.nnodes=2", "trainer.n_gpus_per_node=0"])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--ray", ADDRESS, "--no-compose"], "--ray --no-compose: the sweep cannot tell how many GPU slots run "),
        (["--max-running", "2"], "--max-running goes with --slurm or --ray"),
        (["--ray", ADDRESS, "--sbatch=--nodes=2"], "--sbatch goes with --slurm"),
        (["--ray", ADDRESS, "--max-running", "0", "--no-compose"], "--max-running must be at least 1 (got 0)"),
    ],
)
def test_the_command_line_refuses_what_cannot_schedule(tmp_path, capsys, options, message):
    argv = [*options, "--out", str(tmp_path / "out"), "--algos", "respo", "--reuse", "2", "--seeds", "0"]
    argv += ["--optimizer-steps", "4", "--no-compose"] if "--no-compose" not in options else ["--optimizer-steps", "4"]
    assert sweep_main([*argv, "--", "trainer.nnodes=1"]) == 2
    assert message in capsys.readouterr().err
