"""Two Ray nodes on one host, started by scripts/launch/ray_cluster.sh with the real ``ray`` (docs/cluster.md, "Two
nodes on one host").

The head runs at this host's address (Ray's choice for a head started at 127.0.0.1) and the worker at 127.0.0.2
(Linux routes all of 127.0.0.0/8 to loopback), one fake GPU slot and 8 logical CPUs each, so that verl's one
placement group per node must land on different raylets. Both use the token file the script makes; a third node
started with another token is refused. The worker runs in a mount namespace of its own (``unshare --mount``) where a
folder of the host is an empty tmpfs: a node-local folder, which the head sees and the worker does not (without root,
in a user namespace of its own too, which the kernel must allow: ``unshare --user`` as this user).

On that cluster: the node preflight refuses a checkpoint root that only the head sees, naming the worker and the
path (no verl driver: the preflight itself, as the driver runs it before the TaskRunner); then one Megatron R3 run
with verl's vLLM server, one rank and one server per node, expert parallel 2 across the nodes (gloo between the two
addresses), submitted by ``respo-verl sweep --ray`` into a fresh ``--out``, its TaskRunner on the worker. After its
trainer generates step 4, the worker's raylet and its process tree are SIGKILLed: the run stops in one line naming the
node, its roles and the step. The worker comes back and the same run, its TaskRunner now on the head, resumes from its
checkpoint of step 2; the worker is SIGKILLed again while the update of step 3 runs, and the driver's look at the
cluster stops the run within a minute, the trainer waiting on the lost rank. The same once more, the worker lost
while step 3 generates, the trainer waiting on the lost rollout server. The worker comes back once more and the same
sweep, run again unchanged, resubmits the run: it resumes from step 2 and its step 3 equals the lost run's step 3 to
the last bit (verl's full determinism), but for vLLM's own log-probs of the same tokens, which a fresh engine repeats
to about 1e-9 only. After each loss no process of the job is left on either node. Four verl drivers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from support import cpu_runs, procs, ray_auth
from support.ranks import free_port
from support.trainer_checks import RESPO_KEYS, assert_trains, assert_weights_synced

from respo_verl.checkpoint import TRACKER
from respo_verl.run.nodes import MARKER, SharedFolders, unseen
from respo_verl.run.reaper import reap
from respo_verl.run.roles import PROCESS_TITLES
from respo_verl.run.stops import EXIT_ACTOR_DIED

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts/launch/ray_cluster.sh"
BIN = Path(sys.executable).parent
HEAD_IP, WORKER_IP, REFUSED_IP = "127.0.0.1", "127.0.0.2", "127.0.0.3"
# Ports a node takes by default: a second node on the host needs its own (the head's are taken).
NODE_PORTS = (
    "node-manager-port",
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "runtime-env-agent-port",
    "metrics-export-port",
)
START_S = 180  # a node's start on a busy 2-core machine
TRAINER_RESOURCE = "trainer_node"  # a custom resource of the worker only: the job's TaskRunner runs there
HEAD_RESOURCE = "head_node"  # a custom resource of the head only: the resubmitted job's TaskRunner runs there
ON_HEAD_PHASES = ("update", "generation")  # the phases in which the runs with their TaskRunner on the head are lost


def _ports(*names: str) -> list[str]:
    return [f"--{name}={free_port()}" for name in names]


class TwoNodes:
    """A head and a worker started by the script; ``stop()`` reaps every process of both."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.temp = tempfile.mkdtemp(prefix="rv2n-", dir="/tmp")  # Ray's socket paths must stay short
        self.local = root / "node-local"  # an empty tmpfs on the worker
        self.local.mkdir()
        self.token = root / "token"
        self.gcs, self.dashboard_port = free_port(), free_port()
        self.address = f"{HEAD_IP}:{self.gcs}"
        self.dashboard = f"http://{HEAD_IP}:{self.dashboard_port}"
        self.worker: subprocess.Popen | None = None
        self.head_node, self.refused = HEAD_IP, (None, "")
        self.worker_out = root / "worker.txt"
        self.trace = root / "watchdog.jsonl"

    def env(self, **extra: str) -> dict[str, str]:
        """The nodes' environment: this interpreter's ``python3`` and ``ray`` first on PATH, the token in its file."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "VERL_FILE_LOGGER"))}
        env.update(cpu_runs.run_env(None))
        env = {k: v for k, v in env.items() if not k.startswith("RAY_")}
        env.update(
            PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}",
            RAY_AUTH_TOKEN_PATH=str(self.token),
            RAY_PORT=str(self.gcs),
            NUM_GPUS="1",
            NUM_CPUS="8",
            RAY_TMPDIR=self.temp,
            DASHBOARD_PORT=str(self.dashboard_port),
            RESPO_VERL_WATCHDOG_TRACE=str(self.trace),  # the job's driver, on the head, appends what it reads there
        )
        return {**env, **extra}

    def client_env(self) -> dict[str, str]:
        """A client's environment (the sweep, a driver): token auth with the cluster's token."""
        return {**self.env(), "RAY_AUTH_MODE": "token", "RAY_ADDRESS": self.address}

    def start_head(self) -> None:
        # The session's token in the file, so that this test process's clients (ray_auth) hold it too.
        self.token.write_text(ray_auth.env()[ray_auth.TOKEN] + "\n")
        self.token.chmod(0o600)
        command = ["bash", str(SCRIPT), "head", "--include-dashboard=true", "--disable-usage-stats"]
        command += [f"--resources={json.dumps({HEAD_RESOURCE: 1})}"]
        command += _ports("dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port")
        command += _ports("metrics-export-port", "ray-client-server-port")
        done = subprocess.run(
            command,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=START_S,
            start_new_session=True,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    def worker_command(self, ip: str) -> list[str]:
        script = f"bash {SCRIPT} worker {HEAD_IP} " + " ".join(_ports(*NODE_PORTS))
        script += f" --resources='{{\"{TRAINER_RESOURCE}\": 1}}'"  # the node the job's TaskRunner asks for
        # Its own mount namespace: the node-local folder is an empty tmpfs there. Without root, the namespace comes
        # with a user namespace of its own (this user as its root), which may mount a tmpfs.
        inner = f"mount -t tmpfs tmpfs {self.local} && exec {script}"
        user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
        return ["unshare", *user, "--mount", "--propagation", "private", "bash", "-c", inner]

    def start_worker(self, ip: str = WORKER_IP, token: Path | None = None, out: Path | None = None):
        env = self.env(NODE_IP=ip, **({"RAY_AUTH_TOKEN_PATH": str(token)} if token else {}))
        with (out or self.worker_out).open("a") as fh:
            proc = subprocess.Popen(
                self.worker_command(ip), env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
            )
        if token is None:
            self.worker = proc
            self.wait_for_nodes(2)
        return proc

    def alive_nodes(self) -> list[str]:
        # Marked: Ray prints warnings of its own on stdout when the machine is busy ("lagging heartbeats").
        code = "import json, ray; ray.init(); "
        code += "print('alive:', json.dumps(sorted(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive'])))"
        done = subprocess.run(
            [sys.executable, "-c", code], env=self.client_env(), capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr[-3000:]
        (alive,) = [line for line in done.stdout.splitlines() if line.startswith("alive: ")]
        return json.loads(alive.removeprefix("alive: "))

    def wait_for_nodes(self, count: int) -> None:
        deadline = time.monotonic() + START_S
        while len(self.alive_nodes()) != count:
            assert self.worker is None or self.worker.poll() is None, self.worker_out.read_text()[-3000:]
            assert time.monotonic() < deadline, f"{count} nodes not alive after {START_S} s"
            time.sleep(2)

    def kill_worker(self) -> list[str]:
        """SIGKILL the worker node, its raylet and every process below it, at once; each of them is gone after it.
        Returns them as ``pid command line``."""
        top = psutil.Process(self.worker.pid)
        tree, killed = [top, *top.children(recursive=True)], []
        for proc in tree:  # first every command line: a raylet ends with the `ray start` above it
            try:
                killed.append((proc.pid, proc.cmdline()))
            except psutil.Error:
                killed.append((proc.pid, []))
        for proc in tree:
            try:
                proc.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
        self.worker.wait(timeout=60)
        self.worker = None
        assert any(argv and argv[0].endswith("/raylet") for _, argv in killed), killed
        left = procs.wait_gone(tree, 60)
        assert not left, [p.pid for p in left]
        return [f"{pid} {' '.join(argv)}" for pid, argv in killed]

    def stop(self) -> None:
        if self.worker is not None:
            self.kill_worker()
        # The head's Ray client server names only the cluster's address, not its temp dir.
        gcs = re.compile(rf"--address=\S+:{self.gcs}( |$)")
        strays = [p for p in psutil.process_iter(["cmdline"]) if gcs.search(" ".join(p.info["cmdline"] or ()))]
        reap(strays, self.temp)
        shutil.rmtree(self.temp, ignore_errors=True)


def test_a_node_that_does_not_see_the_marker_or_the_data_says_what_it_misses(tmp_path):
    root, data = tmp_path / "ckpt", tmp_path / "train.parquet"
    root.mkdir()
    data.write_bytes(b"rows")
    folders = SharedFolders(str(root / MARKER), "t0ken", ((str(data), 4),))
    (root / MARKER).write_text("t0ken")
    assert unseen(folders) == []
    (root / MARKER).write_text("other")
    data.write_bytes(b"row")
    assert unseen(folders) == [
        f"does not see the checkpoint root {root} (the driver's marker {MARKER} holds another run's token)",
        f"does not see the data file {data} (3 bytes here)",
    ]
    (root / MARKER).unlink()
    data.unlink()
    assert unseen(folders) == [
        f"does not see the checkpoint root {root} (the driver's marker {MARKER} is not there)",
        f"does not see the data file {data}",
    ]


# --- the cluster and its runs (slow) ------------------------------------------------------------------------------

RUN = "cpu-moe-respo-n2-s0-r3"  # the sweep's one run: <model>-<algorithm>-n<N>-s<seed>[-<routing>]
STEPS, KILL_AFTER_STEP = 4, 3  # a checkpoint every 2 steps: the lost run resumes from step 2 and redoes step 3
LOST_WITHIN_S = 60  # from the SIGKILL of the worker to the job's end
TIMEOUT_S = 1200
# The same job on one node or two: a Megatron rank and a vLLM server per node, expert parallel 2 across them.
TWO_NODE_JOB = (
    "model_engine=megatron",
    "+device=cpu_megatron",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.actor.optim.lr=1e-4",
    "trainer.nnodes=2",
    "trainer.n_gpus_per_node=1",
    "~ray_kwargs.ray_init.num_cpus",  # the job joins the cluster: its nodes say what they have
    "~ray_kwargs.ray_init.num_gpus",
    *(f"actor_rollout_ref.{role}.megatron.expert_model_parallel_size=2" for role in ("actor", "ref")),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    *(f"actor_rollout_ref.{role}.log_prob_micro_batch_size_per_gpu=4" for role in ("ref", "rollout")),
    "trainer.save_freq=2",
    "actor_rollout_ref.rollout.full_determinism=true",
    "data.shuffle=false",
    # The TaskRunner on the worker, the driver (a Ray job's) on the head: the watchdog and the stop request cross.
    f"+ray_kwargs.task_runner_resources={{{TRAINER_RESOURCE}:1}}",
)
_UNTIMED = ("timing_s/", "timing_per_token_ms/", "perf/")
# The route-drift engine's keys of both passes (docs/routing-replay.md).
DRIFT = ("flip_frac", "overlap", "prob_mass_delta", "any_layer_flip_frac", "replayed_tokens")
DRIFT += ("flip_frac/layer_0", "flip_frac/layer_1")
ROUTE_DRIFT_KEYS = tuple(f"actor/routing/{p}{k}" for p in ("", "compute_log_prob/") for k in DRIFT)
ROUTE_IDS_PER_TOKEN = 2 * 2  # the kit's MoE: 2 layers, top-2
# Metrics of vLLM's log-probs against the trainer's, and their bound across a resume (seen: 4.7e-10).
SAMPLER_KEYS, SAMPLER_GAP = ("rollout_corr/", "training/rollout_"), 1e-6


def _sweep(cluster: TwoNodes, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "respo_verl.cli", "sweep", "--ray", cluster.dashboard, "--out", str(out),
        "--model", "cpu-moe", "--algos", "respo", "--reuse", "2", "--seeds", "0", "--mini-batch", "2",
        "--optimizer-steps", str(2 * STEPS), "--routing", "r3", "--", *TWO_NODE_JOB,
    ]  # fmt: skip


def _ray_python(cluster: TwoNodes, code: str) -> str:
    """``code`` in a fresh client of the cluster (so that this test process never joins it); its output."""
    done = subprocess.run(
        [sys.executable, "-c", "import ray\nray.init()\n" + code],
        env=cluster.client_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _job_processes(cluster: TwoNodes) -> list[str]:
    """The processes of the cluster's jobs on either node, orphans included: every process of this host whose title is
    an actor role's (:data:`PROCESS_TITLES`) and whose environment holds the cluster's Ray temp dir (each node's
    processes inherit it from their raylet, a vLLM engine core from its server)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        line = " ".join(proc.info["cmdline"] or ())
        if not PROCESS_TITLES.match(line):
            continue
        try:
            if proc.environ().get("RAY_TMPDIR") == cluster.temp:
                found.append(f"{proc.pid} {line[:80]}")
        except psutil.Error:
            continue
    return sorted(found)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from respo_verl.cpu.kit.build import KitSpec, build_kit

    build_kit(KitSpec(moe=True), progress=False)
    root = Path(tempfile.mkdtemp(prefix="rv2n-", dir="/tmp"))
    nodes = TwoNodes(root)
    try:
        nodes.start_head()
        # A node with another token, started beside the real worker: the head refuses it.
        other = root / "other-token"
        other.write_text("0" * 64 + "\n")
        other.chmod(0o600)
        refused = nodes.start_worker(REFUSED_IP, token=other, out=root / "refused.txt")
        nodes.start_worker()
        refused.wait(timeout=START_S)
        nodes.refused = (refused.returncode, (root / "refused.txt").read_text(errors="replace"))
        # Ray advertises a head at 127.0.0.1 under this host's own address (127.0.0.1 where it has none).
        nodes.head_node = next(ip for ip in nodes.alive_nodes() if ip != WORKER_IP)
        yield nodes
    finally:
        nodes.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
def test_the_script_starts_two_nodes_with_token_auth_and_refuses_another_token(cluster):
    alive = cluster.alive_nodes()
    assert len(alive) == 2 and WORKER_IP in alive and REFUSED_IP not in alive, alive
    rc, out = cluster.refused
    assert rc != 0, out[-3000:]
    assert "AuthenticationError" in out and "Authentication token is missing or incorrect" in out, out[-3000:]


@pytest.mark.slow
def test_a_node_that_does_not_see_the_checkpoint_root_stops_the_preflight_naming_it(cluster):
    """The node preflight as the driver runs it before the TaskRunner, with the job's folders: a checkpoint root in
    the worker's node-local folder stops it in one line naming the worker and the path; shared folders pass."""
    data = cluster.root / "train.parquet"
    data.write_bytes(b"rows")
    code = f"""
from omegaconf import OmegaConf
from respo_verl.run.nodes import shared_folders
from respo_verl.run.preflight import check_ray_nodes

def job(root):
    return OmegaConf.create({{"trainer": {{"default_local_dir": root}}, "data": {{"train_files": [{str(data)!r}]}}}})

check_ray_nodes(timeout_s=300, folders=shared_folders(job({str(cluster.root / "ckpt")!r})))
print("shared: passed")
try:
    check_ray_nodes(timeout_s=300, folders=shared_folders(job({str(cluster.local / "ckpt")!r})))
except RuntimeError as exc:
    print("local:", exc)
"""
    out = _ray_python(cluster, code)
    assert "shared: passed" in out, out
    (line,) = [line for line in out.splitlines() if line.startswith("local:")]
    assert line == (
        f"local: respo-verl preflight failed: node {WORKER_IP} ({os.uname().nodename}) does not see the checkpoint "
        f"root {cluster.local / 'ckpt'} (the driver's marker {MARKER} is not there): every node must see the "
        "checkpoint root and the data at the driver's paths (shared storage)"
    )
    assert not (cluster.local / "ckpt" / MARKER).exists()  # the driver's marker is removed afterwards


@pytest.fixture(scope="module")
def lost_and_resumed(cluster):
    """Three attempts of the sweep's one run on two nodes, one checkpoint folder:

    1. the sweep's; its TaskRunner on the worker, which is lost (SIGKILL of its raylet and tree) in step 4;
    2. the node back, the same run submitted as a Ray job with its TaskRunner on the head (nothing else differs:
       ``ray_kwargs`` is no part of the run's identity); it resumes from step 2, and the worker is lost again while
       the update of step 3 runs, the trainer waiting on the lost rank;
    3. the same as 2, the worker lost while step 3 generates, the trainer waiting on the lost rollout server;
    4. the node back, the same sweep again, unchanged: it resumes from step 2, and its driver gets SIGTERM.
    """
    from respo_verl.tools.runs.manifest import MANIFEST_NAME, read_manifest
    from respo_verl.tools.sweep.runner import connect

    out = cluster.root / "sweep"  # fresh: the sweep makes its folders, the job's logger its log's
    log = out / "logs" / f"{RUN}.jsonl"
    client = connect(cluster.dashboard)
    result: dict = {"out": out}
    cpu_runs.record_drivers(1, "respo_verl.main_ppo (sweep --ray, two nodes, the node lost)")
    with (cluster.root / "sweep-1.txt").open("w") as fh:
        sweep = subprocess.Popen(
            _sweep(cluster, out), env=cluster.client_env(), stdout=fh, stderr=subprocess.STDOUT, cwd=cluster.root
        )
    deadline = time.monotonic() + TIMEOUT_S
    while sweep.poll() is None and max(cpu_runs.logged_steps(log), default=0) < 1:
        assert time.monotonic() < deadline, (cluster.root / "sweep-1.txt").read_text()[-3000:]
        time.sleep(1)
    jobs = [j for j in client.list_jobs() if (j.metadata or {}).get("respo_verl_run") == RUN]
    (job,) = jobs
    result["placement"] = _ray_python(
        cluster, f"from respo_verl.run.nodes import record_placement\nrecord_placement({job.job_id!r})"
    )
    result["running"] = _job_processes(cluster)  # the search finds the job's processes while they run
    # once the trainer generates step 4 (its record says so: the stop line names that step), its node is lost
    result["generation"], watcher = _wait_for_phase(cluster, job.job_id, KILL_AFTER_STEP + 1, "generation")
    killed_at = time.time()
    result["killed"] = cluster.kill_worker()
    watcher.wait(timeout=120)
    # What the driver asks when its run ends with an actor error, asked here too while the job ends.
    result["asked"] = _ray_python(
        cluster,
        "from ray.exceptions import ActorDiedError\nfrom respo_verl.run.nodes import lost_node_stop\n"
        f"print('asked:', lost_node_stop(ActorDiedError(), {KILL_AFTER_STEP + 1}, job={job.job_id!r}))",
    )
    sweep.wait(timeout=TIMEOUT_S)
    result["first"] = (sweep.returncode, (cluster.root / "sweep-1.txt").read_text())
    info = client.get_job_info(job.submission_id)
    result["lost_after_s"] = info.end_time / 1000 - killed_at if info.end_time else None
    result["status"] = str(info.status)
    time.sleep(5)  # Ray ends a finished job's actors at once; a leftover would be there for good
    result["leftovers"] = _job_processes(cluster)
    result["lost_lines"] = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    result["lost_out"] = (out / "logs" / f"{RUN}.out").read_text(errors="replace")
    # 2. The node comes back; the run's manifest line, its TaskRunner on the head, as a Ray job of its own, which
    # loses the worker in the update of step 3; 3. the same once more, lost in the generation of step 3.
    (record,) = read_manifest(out / MANIFEST_NAME)
    on_head = [
        f"+ray_kwargs.task_runner_resources={{{HEAD_RESOURCE}:1}}" if "task_runner_resources" in a else a
        for a in record.command
    ]
    assert on_head != record.command, record.command
    on_head = dataclasses.replace(record, command=on_head)
    result["on_head"] = {
        phase: _lose_worker_under_the_head(cluster, client, on_head, phase, deadline + (i + 1) * TIMEOUT_S)
        for i, phase in enumerate(ON_HEAD_PHASES)
    }
    resumes = log.read_text().count('"event":"resume"')
    # 4. The node comes back; the same sweep, run again unchanged, resubmits the run. Once the resumed attempt has
    # started (its log's resume line), its driver on the head gets SIGTERM: the TaskRunner on the worker saves
    # step 3 and ends the run.
    cluster.start_worker()
    cpu_runs.record_drivers(1, "respo_verl.main_ppo (sweep --ray, two nodes, resumed)")
    with (cluster.root / "sweep-2.txt").open("w") as fh:
        again = subprocess.Popen(
            _sweep(cluster, out), env=cluster.client_env(), stdout=fh, stderr=subprocess.STDOUT, cwd=cluster.root
        )
    while again.poll() is None and log.read_text().count('"event":"resume"') == resumes:
        assert time.monotonic() < deadline + 3 * TIMEOUT_S, (cluster.root / "sweep-2.txt").read_text()[-3000:]
        time.sleep(0.5)
    assert again.poll() is None, (cluster.root / "sweep-2.txt").read_text()[-3000:]  # the sweep waits on its run
    driver = _driver(cluster)
    result["driver_on_worker"] = cluster.worker.pid in {p.pid for p in driver.parents()}
    driver.send_signal(signal.SIGTERM)
    again.wait(timeout=TIMEOUT_S)
    result["again"] = (again.returncode, (cluster.root / "sweep-2.txt").read_text())
    result["lines"] = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    result["out_text"] = (out / "logs" / f"{RUN}.out").read_text(errors="replace")
    result["tracker"] = (out / "checkpoints" / RUN / TRACKER).read_text().strip()
    return result


def _lose_worker_under_the_head(cluster: TwoNodes, client, record, phase: str, deadline: float) -> dict:
    """The worker back, ``record`` (its TaskRunner on the head) as a Ray job of its own; the worker is lost once the
    trainer's record names ``phase`` of step 3 or a later one. The job's status, output and leftovers, the record read
    (``kill_after_s``: from that read to the kill), and seconds from the kill to the job's end."""
    from respo_verl.tools.sweep.runner import shell_line

    cluster.start_worker()
    cpu_runs.record_drivers(1, f"respo_verl.main_ppo (Ray job, two nodes, its TaskRunner on the head, lost in {phase})")
    submitted = client.submit_job(entrypoint=shell_line(record), submission_id=f"{RUN}-trainer-on-head-{phase}")
    while (job_id := client.get_job_info(submitted).job_id) is None:  # the driver has started
        assert time.monotonic() < deadline, client.get_job_logs(submitted)[-3000:]
        time.sleep(0.5)
    seen, watcher = _wait_for_phase(cluster, job_id, KILL_AFTER_STEP, phase)
    killed_at, seen["kill_after_s"] = time.time(), time.monotonic() - seen["read_at"]
    killed = cluster.kill_worker()
    watcher.wait(timeout=120)
    while client.get_job_info(submitted).end_time is None:
        assert time.monotonic() < deadline, client.get_job_logs(submitted)[-3000:]
        time.sleep(0.5)
    info = client.get_job_info(submitted)
    time.sleep(5)  # as above: a leftover would be there for good
    return {
        "seen": seen,
        "killed": killed,
        "status": str(info.status),
        "lost_after_s": info.end_time / 1000 - killed_at,
        "out": client.get_job_logs(submitted),
        "leftovers": _job_processes(cluster),
    }


def _wait_for_phase(cluster: TwoNodes, job_id: str, step: int, phase: str) -> tuple[dict, subprocess.Popen]:
    """Wait until the trainer's phase record of job ``job_id`` (read from the cluster's store by a client process
    every 20 ms, which then exits at once) names ``phase`` of ``step`` or a later step; that record, with ``seen``
    (every (step, phase) read) and ``read_at`` (the host's monotonic clock), and the client process (to be waited
    for)."""
    code = f"""
import json, os, time
from respo_verl.run.watchdog import PHASE, Records
records, deadline, seen = Records({job_id!r}), time.monotonic() + {TIMEOUT_S}, []
while time.monotonic() < deadline:
    record = records.get(PHASE) or {{}}
    if (record.get("step"), record.get("phase")) != tuple(seen[-1] if seen else ()):
        seen.append((record.get("step"), record.get("phase")))
    if (record.get("step") or 0) >= {step} and record.get("phase") == {phase!r}:
        break
    if record.get("why") == "training ended":
        break
    time.sleep(0.02)
print("phase:", json.dumps({{**record, "seen": seen, "read_at": time.monotonic()}}), flush=True)
os._exit(0)
"""
    watcher = subprocess.Popen(
        [sys.executable, "-c", "import ray\nray.init()\n" + code],
        env=cluster.client_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    for line in watcher.stdout:
        if line.startswith("phase: "):
            return json.loads(line.removeprefix("phase: ")), watcher
    watcher.wait(timeout=120)
    raise AssertionError(f"the phase record of job {job_id} was never read")


def _driver(cluster: TwoNodes) -> psutil.Process:
    """The job's driver: the one ``python -m respo_verl.main_ppo`` process whose run's folders are the cluster's."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        line = proc.info["cmdline"] or []
        if line[1:3] == ["-m", "respo_verl.main_ppo"] and str(cluster.root) in " ".join(line):
            found.append(proc)
    assert len(found) == 1, [p.info["cmdline"][:4] for p in found]
    return found[0]


def _placement(text: str) -> dict[str, str]:
    """{role: node address} from the ``respo_verl placement: ...`` lines of ``text``."""
    return dict(re.findall(r"respo_verl placement: (.+?): node (\S+) ", text))  # after Ray's prefix, if any


@pytest.mark.slow
def test_ranks_and_vllm_servers_are_placed_one_per_node_and_the_run_says_where(cluster, lost_and_resumed):
    """The roles as Ray's actor table has them (the placement record), read while the run trains, and the run's own
    lines (the trainer logs them once its workers exist)."""
    for text in (lost_and_resumed["placement"], lost_and_resumed["lost_out"]):
        where = _placement(text)
        nodes = {cluster.head_node, WORKER_IP}
        assert {where.get("update worker rank 0"), where.get("update worker rank 1")} == nodes, text
        assert {where.get("rollout server 0"), where.get("rollout server 1")} == nodes, text
        assert where.get("trainer") == WORKER_IP, text  # ray_kwargs.task_runner_resources
    for run in lost_and_resumed["on_head"].values():
        assert _placement(run["out"]).get("trainer") == cluster.head_node


LOST = (
    r"step {step}: node " + re.escape(WORKER_IP) + r" \(Ray node [0-9a-f]{{12}}\) was lost with (.*); "
    r"once the node is back, submit the job again: it resumes from its last checkpoint"
)


def _on_worker(text: str) -> set[str]:
    """The roles the run's placement lines in ``text`` put on the worker."""
    return {role for role, ip in _placement(text).items() if ip == WORKER_IP}


@pytest.mark.slow
def test_a_lost_node_stops_the_run_in_one_line_naming_it_its_roles_and_the_step(lost_and_resumed):
    """The TaskRunner on the worker: it is lost with the node, and the driver's wait for it ends at once. The line
    names every role the run placed on the worker, the trainer among them."""
    result = lost_and_resumed
    rc, out = result["first"]
    assert rc != 0 and f"run {RUN} failed" in out, out[-3000:]
    lost = LOST.format(step=KILL_AFTER_STEP + 1)
    assert result["status"] == "FAILED" and result["lost_after_s"] is not None, result["status"]
    assert result["lost_after_s"] < LOST_WITHIN_S, result["lost_after_s"]
    # the search for leftovers finds the job's processes on both nodes while the job runs, and none once it ended
    running = " ".join(result["running"])
    assert all(f"ray::{cls}" in running for cls in ("TaskRunner", "WorkerDict", "vLLMHttpServer")), running
    assert "VLLM::EngineCore" in running, running
    assert result["leftovers"] == [], result["leftovers"]
    placed = _on_worker(result["placement"])
    assert "trainer" in placed and {r for r in placed if r.startswith(("update worker", "rollout server"))}, placed
    (asked,) = [line for line in result["asked"].splitlines() if line.startswith("asked: ")]
    found = re.fullmatch("asked: " + lost, asked)
    assert found and placed <= set(found.group(1).split(", ")), (asked, placed)
    stopped = cpu_runs.stop_line(result["lost_out"], rf"\(lost node, exit {EXIT_ACTOR_DIED}\): " + lost)
    assert placed <= set(stopped.group(1).split(", ")), (stopped.group(0), placed)
    assert _on_worker(result["lost_out"]) == placed  # the run's own placement lines say the same


def _attempts(result: dict) -> list[list[int]]:
    """The steps each attempt after the lost one logged, in order: the log's lines split at its resume lines."""
    attempts: list[list[int]] = []
    for line in result["lines"][len(result["lost_lines"]) :]:
        if line.get("event") == "resume":
            attempts.append([])
        elif "step" in line:
            attempts[-1].append(line["step"])
    return attempts


@pytest.mark.slow
@pytest.mark.parametrize("phase", ON_HEAD_PHASES)
def test_a_lost_node_stops_a_trainer_on_the_surviving_node_within_a_minute(lost_and_resumed, phase):
    """The TaskRunner on the head survives the worker, killed while step 3 (or a later one) generates or updates: the
    head waits on the lost rollout server or rank, or its request or collective fails. Either way the run stops, never
    leaving the phase, in the one line naming the node and every role the run placed on the worker, within a minute:
    the driver's look at the cluster, or the trainer's error for which the driver finds the node lost."""
    run = lost_and_resumed["on_head"][phase]
    seen = run["seen"]
    assert seen["phase"] == phase and seen["step"] >= KILL_AFTER_STEP, seen
    # the kill came right after the phase was read begun (one clock: CLOCK_MONOTONIC is the host's), and the step
    # never ended: no line of it in the log
    assert seen["kill_after_s"] < 1.0, seen
    assert seen["step"] not in _attempts(lost_and_resumed)[ON_HEAD_PHASES.index(phase)], _attempts(lost_and_resumed)
    assert run["status"] == "FAILED", run["out"][-3000:]
    assert run["lost_after_s"] < LOST_WITHIN_S, run["lost_after_s"]
    placed = _on_worker(run["out"])
    assert "trainer" not in placed and {r for r in placed if r.startswith("update worker")}, placed
    lost = LOST.format(step=seen["step"])
    stopped = cpu_runs.stop_line(run["out"], rf"\(lost node, exit {EXIT_ACTOR_DIED}\): " + lost)
    assert set(stopped.group(1).split(", ")) == placed, (stopped.group(0), placed)
    assert run["leftovers"] == [], run["leftovers"]
    print(f"{phase}: lost {run['lost_after_s']:.1f} s after the kill: {stopped.group(0)}")


@pytest.mark.slow
def test_sigterm_to_the_driver_on_the_head_saves_and_stops_the_trainer_on_the_worker(lost_and_resumed):
    """The stop request crosses nodes: the driver's SIGTERM reaches the TaskRunner on the other node through Ray,
    which saves the step it is in and ends the run; the sweep reports the run as not complete."""
    result = lost_and_resumed
    rc, out = result["again"]
    assert result["driver_on_worker"] is False
    assert "SIGTERM: the trainer saves at the end of this step and stops" in result["out_text"], out[-3000:]
    saved = f"respo-verl: stop requested (SIGTERM to the driver): saved global_step_{KILL_AFTER_STEP}, ending the run"
    assert saved in result["out_text"], result["out_text"][-3000:]
    assert result["tracker"] == str(KILL_AFTER_STEP)
    assert rc != 0 and f"run {RUN} failed: job " in out, out[-3000:]
    assert re.search(rf"job \S+ SUCCEEDED( \(.*\))?, {KILL_AFTER_STEP} of {STEPS} steps logged", out), out[-3000:]


@pytest.mark.slow
def test_the_watchdog_on_the_head_reads_the_phase_record_of_the_trainer_on_the_worker(cluster, lost_and_resumed):
    """The phase record crosses nodes: the driver's watchdog (its trace: each change it read, every 2 s) saw the
    trainer on the worker go through every step it ran, in phases of both bounds (run_guard.max_stall_s for
    generation, max_phase_s for the others), its progress count rising."""
    records = [json.loads(line) for line in cluster.trace.read_text().splitlines()]
    watched = [r for r in records if r.get("watched")]
    trainers = list(dict.fromkeys(r["pid"] for r in records))
    assert len(trainers) == 2 + len(ON_HEAD_PHASES), records  # the TaskRunners of the attempts
    killed = [lost_and_resumed["on_head"][phase]["seen"]["step"] for phase in ON_HEAD_PHASES]
    attempts = ((1, 2, 3), *(tuple(range(KILL_AFTER_STEP, step + 1)) for step in killed), (KILL_AFTER_STEP,))
    for pid, steps in zip(trainers, attempts, strict=True):
        seen = [r for r in watched if r["pid"] == pid]
        assert set(steps) <= {r["step"] for r in seen}, (pid, seen)
        assert [r["seq"] for r in seen] == sorted({r["seq"] for r in seen}), seen
    assert "generation" in {r["phase"] for r in watched}, watched
    assert {r["phase"] for r in watched} - {"generation", "validation"}, watched


@pytest.mark.slow
def test_the_resubmitted_run_resumes_and_repeats_the_lost_runs_step(lost_and_resumed):
    """The resumed run redoes step 3 from the checkpoint of step 2 and equals the lost run's step 3, except for
    vLLM's log-probs of the same tokens (bounded)."""
    result = lost_and_resumed
    assert "Resuming from" in result["out_text"] and "global_step_2" in result["out_text"], result["out_text"][-3000:]
    lost = [line for line in result["lost_lines"] if "step" in line]
    assert [line["step"] for line in lost] == list(range(1, KILL_AFTER_STEP + 1)), lost
    lines = result["lines"]
    # each attempt lost in step k logged the steps before it; then SIGTERM in the first step
    killed = [result["on_head"][phase]["seen"]["step"] for phase in ON_HEAD_PHASES]
    want_steps = [list(range(KILL_AFTER_STEP, step)) for step in killed]
    assert _attempts(result) == [*want_steps, [KILL_AFTER_STEP]], _attempts(result)
    resumed = {line["step"]: line["data"] for line in lines[len(result["lost_lines"]) :] if "step" in line}
    want, got = lost[KILL_AFTER_STEP - 1]["data"], resumed[KILL_AFTER_STEP]
    keys = {k for k in want if not any(part in k for part in _UNTIMED)}
    assert keys == {k for k in got if not any(part in k for part in _UNTIMED)}
    assert any(line["data"]["actor/grad_norm"] > 0 for line in lost), lost
    differing = {k: (got[k], want[k]) for k in sorted(keys) if got[k] != want[k]}
    # Tokens, rewards, advantages, the trainer's log-probs, the loss and the update: to the last bit. vLLM's own
    # log-probs of those tokens (what the sampler-agreement keys compare) do not repeat to the last bit between a
    # fresh engine and one that served the steps before: bounded.
    exact = {k: v for k, v in differing.items() if not k.startswith(SAMPLER_KEYS)}
    assert not exact, (sorted(differing), exact)
    gaps = {k: abs(a - b) for k, (a, b) in differing.items()}
    assert all(gap <= SAMPLER_GAP for gap in gaps.values()), gaps


@pytest.mark.slow
def test_every_step_on_two_nodes_replays_vllms_routes_and_agrees_with_the_sampler(lost_and_resumed):
    """The healthy Megatron R3 run with vLLM (tests/cpu/test_cpu_vllm.py has its faults), on two nodes: the loss's and
    the route-drift engine's keys in every step, routes replayed in both passes, each replayed route the trainer's
    router's own top-k at compute_log_prob, vLLM's routes received as uint8 at each sample's own length, sampler and
    trainer in agreement after every update, and no guard that warns or stops."""
    steps = [line for line in lost_and_resumed["lines"] if "step" in line]
    assert_weights_synced(steps)
    assert_trains(steps)
    grads = [line["data"]["actor/grad_norm"] for line in steps]
    assert any(grads[:-1]), "no step followed an update: the weight sync was never put to the test"
    for line in steps:
        data = line["data"]
        missing = [key for key in (*RESPO_KEYS, *ROUTE_DRIFT_KEYS) if key not in data]
        assert not missing, (line["step"], missing)
        assert data["training/rollout_probs_diff_valid"] == 1.0  # vLLM's log-probs reached the trainer
        assert data["actor/routing/compute_log_prob/replayed_tokens"] > 0, (line["step"], data)
        assert data["actor/routing/replayed_tokens"] > 0, (line["step"], data)
        flips = {k: v for k, v in data.items() if k.startswith("actor/routing/compute_log_prob/flip_frac/layer_")}
        assert len(flips) == 2 and set(flips.values()) == {0.0}, (line["step"], flips)
        assert data["actor/routing/compute_log_prob/any_layer_flip_frac"] == 0.0
        # vLLM's routes reached the trainer as uint8 (respo_verl/patches/verl_0_9_1_routes.py), each sample at its
        # own length: one byte per expert id of each prompt and response token, and no more
        tokens = data["prompt_length/mean"] + data["response_length/mean"]
        per_sample = data["actor/routing/compute_log_prob/route_bytes_per_sample"]
        assert per_sample == pytest.approx(tokens * ROUTE_IDS_PER_TOKEN), (line["step"], per_sample, tokens)
        assert "respo_verl/guard_warnings" not in data and "respo_verl/stopped" not in data
    for out in (lost_and_resumed["lost_out"], lost_and_resumed["out_text"]):
        assert "run_guard.max_probs" not in out and "run_guard.routing" not in out, out[-3000:]
