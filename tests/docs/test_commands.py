"""The commands a user copies from the pages run here, each as far as a CPU machine lets it.

The pages are docs/cluster-quickstart.md and README.md (every fenced ``bash`` block) and the comment lines of
examples/*.sh that hold a command (``#   <command>``). Each command is run from the repository root with ``HOME`` in a
temporary folder, in order, page by page, so a page's data, model and sweep folders are there for its later commands:

- ``respo-verl plan``, ``prepare-data`` and ``report`` for real: the data from small local files in the published
  datasets' columns (``--source``), the report over logs written for the runs of the page's sweep;
- ``respo-verl sweep`` with ``--print`` in place of ``--ray ADDRESS`` (it composes and checks every run);
- the examples and ``scripts/launch/ray_cluster.sh`` with ``DRY_RUN=1``;
- ``scripts/install_gpu_env.sh`` with its own arguments, up to its refusal of ``--venv .venv`` (it takes its
  arguments first);
- ``sbatch TEMPLATE``: its options against sbatch's, and the layout check the template starts with;
- ``python -m respo_verl.main_ppo`` / ``verl.trainer.main_ppo``: the job composed and checked as the run does first;
- ``make TARGET``: ``make -n``; ``hf``: its flags against its ``--help``; ``tail``: for real.

A command of a program without a rule here fails, and so does a script, subcommand, flag or knob (a ``NAME=value``
in front of a script of the repository that the script never reads) that the repository lacks.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ("docs/cluster-quickstart.md", "README.md")
EXAMPLES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "examples").glob("*.sh"))
SHELL_FENCES = ("bash", "sh", "shell")
TIMEOUT_S = 120
DRY_RUNS_PASSED: set[tuple] = set()  # see run_script

# A command in a page outside a fenced block would escape this test: an indented line that starts like one.
COMMAND_START = re.compile(
    r"^(?: {4}|\t)\s*(?:[A-Z_]+=\S*\s+)*(?:respo-verl|python3? -m|make|pip|scripts/|examples/)\b"
)
# A command line in a comment of an example: `#   <command>` (the knob block's comments are not commands).
EXAMPLE_COMMAND = re.compile(r"^#\s{2,}((?:[A-Z_]+=\S*\s+)*(?:respo-verl|examples/|scripts/|sbatch)\b.*)$")
ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)

# sbatch's options that a page may pass (``sbatch --help``); the template sets the rest itself.
SBATCH_OPTIONS = {
    "--nodes", "-N", "--time", "-t", "--partition", "-p", "--account", "-A", "--qos", "-q", "--job-name", "-J",
    "--gpus-per-node", "--cpus-per-task", "-c", "--mem", "--exclusive", "--output", "-o", "--dependency", "-d",
    "--reservation", "--constraint", "-C",
}  # fmt: skip
# What the DAPO-Math-17k (processed) and the evaluation sets hold, one row each (tests/data/test_data.py has more).
DAPO_ROW = {
    "prompt": "What is $1+1$?",
    "solution": "2",
    "data_source": "math_dapo",
    "ability": "MATH",
    "reward_model": {"ground_truth": "2", "style": "rule-lighteval/MATH_v2"},
    "extra_info": {"index": "a"},
}
EVAL_ROW = {"problem": "Find $x$ if $2x = 6$.", "answer": "3"}


# --- reading the pages -------------------------------------------------------------------------------------------


def _join_continued(lines: list[str]) -> list[str]:
    """Lines with a trailing backslash joined to the next."""
    joined, pending = [], ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined.append(pending + line)
        pending = ""
    assert not pending, f"a command ends with a backslash: {pending!r}"
    return [line for line in joined if line.strip() and not line.lstrip().startswith("#")]


def page_commands(page: str) -> list[str]:
    """The commands of a page's fenced shell blocks, in order; other fences hold output or text."""
    commands, block, fence = [], None, None
    for line in (ROOT / page).read_text().splitlines():
        stripped = line.strip()
        if block is None and stripped.startswith("```"):
            fence, block = stripped[3:].strip(), []
        elif block is not None and stripped.startswith("```"):
            if fence in SHELL_FENCES:
                commands += _join_continued(block)
            block = None
        elif block is not None:
            block.append(line)
    assert block is None, f"{page}: a fenced block is not closed"
    return commands


def commands_outside_fences(page: str) -> list[str]:
    lines, inside = [], False
    for line in (ROOT / page).read_text().splitlines():
        if line.strip().startswith("```"):
            inside = not inside
        elif not inside and COMMAND_START.match(line):
            lines.append(line.strip())
    return lines


def example_commands(script: str) -> list[str]:
    return [m.group(1) for line in (ROOT / script).read_text().splitlines() if (m := EXAMPLE_COMMAND.match(line))]


# --- running one command -------------------------------------------------------------------------------------------


class Session:
    """The shell of one page: its environment (``export`` adds to it) and its temporary home."""

    def __init__(self, home: Path):
        self.home = home
        venv_bin = str(Path(sys.executable).parent)
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "VIRTUAL_ENV", "RAY_AUTH_TOKEN")}
        self.env = {**env, "HOME": str(home), "PATH": venv_bin + os.pathsep + env.get("PATH", ""),
                    "PYTHON": sys.executable, "RAY_AUTH_TOKEN_PATH": str(home / ".ray" / "auth_token")}  # fmt: skip
        self.base = dict(self.env)
        self.ran: list[str] = []

    def settings(self, knobs: dict[str, str]) -> tuple:
        """What a command's environment sets beyond the session's start (exports and knobs), its home apart."""
        env = {**self.env, **knobs}
        return tuple(sorted((k, v) for k, v in env.items() if self.base.get(k) != v))

    def expand(self, word: str) -> str:
        """``$NAME``, ``${NAME}`` and a leading ``~`` as the shell would expand them in this session."""
        word = re.sub(r"^~(?=/|$)", str(self.home), word)
        return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: self.env.get(m.group(1), ""), word)

    def shell(self, words: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", "-c", shlex.join(words)],
            cwd=ROOT,
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )


def _result(command: str, res: subprocess.CompletedProcess, expect: int = 0) -> None:
    assert res.returncode == expect, (
        f"`{command}` exited {res.returncode} (expected {expect}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    )


def _knobs_read(script: Path) -> set[str]:
    """The environment variables a repository script (and what it sources or runs) reads."""
    texts = [script.read_text()]
    if script.parts[-2] == "examples":
        texts.append((ROOT / "scripts/launch/launch_common.sh").read_text())
    return {name for text in texts for name in re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", text)}


def _check_knobs(command: str, script: Path, knobs: dict[str, str], extra: set[str] = frozenset()) -> None:
    read = _knobs_read(script) | extra | {"RAY_ADDRESS", "RAY_AUTH_MODE"}  # read by Ray in the run itself
    unknown = sorted(set(knobs) - read)
    assert not unknown, f"`{command}`: {script.relative_to(ROOT)} reads no {', '.join(unknown)}"


def run_command(session: Session, command: str) -> None:
    words = shlex.split(command, comments=True)
    knobs = {}
    while words and (m := ASSIGNMENT.match(words[0])):
        knobs[m.group(1)] = session.expand(m.group(2))
        words = words[1:]
    assert words, f"`{command}`: no command"
    program, args = words[0], [session.expand(w) for w in words[1:]]
    runner = RUNNERS.get(program)
    if runner is None and (ROOT / program).is_file():
        runner = run_script
    assert runner is not None, (
        f"`{command}`: {program!r} is neither a command this test knows nor a file of the repository"
    )
    runner(session, command, program, args, knobs)
    session.ran.append(command)


def run_export(session, command, program, args, knobs):
    for arg in args:
        m = ASSIGNMENT.match(arg)
        assert m, f"`{command}`: export NAME=value"
        session.env[m.group(1)] = m.group(2)


def run_source(session, command, program, args, knobs):
    # Activating an environment the page made (scripts/install_gpu_env.sh's .venv-gpu, make setup's .venv).
    assert len(args) == 1 and args[0] in (".venv-gpu/bin/activate", ".venv/bin/activate"), f"`{command}`"


def _fixture(session: Session, name: str, rows: list[dict]) -> str:
    path = session.home / "fixtures" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _write_logs_of_sweep(out: Path) -> None:
    """Each run of the sweep's manifest gets the log a finished run leaves (one line per training step)."""
    from respo_verl.tools.runs.manifest import read_manifest

    for i, record in enumerate(read_manifest(out / "manifest.jsonl")):
        log = Path(record.log) if Path(record.log).is_absolute() else out / record.log
        log.parent.mkdir(parents=True, exist_ok=True)
        steps = record.optimizer_steps // record.reuse
        lines = [
            json.dumps({"step": s, "data": {"critic/score/mean": -0.5 + (s + i % 3) / (steps + 3)}})
            for s in range(1, steps + 1)
        ]
        log.write_text("\n".join(lines) + "\n")


def _option_value(args: list[str], option: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == option and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(option + "="):
            return arg.split("=", 1)[1]
    return None


def run_respo_verl(session, command, program, args, knobs):
    from respo_verl.cli import SUBCOMMANDS

    assert args and args[0] in SUBCOMMANDS, f"`{command}`: respo-verl has no command {args[:1]}"
    sub, rest = args[0], args[1:]
    env = dict(knobs)
    if sub == "sweep":
        options = rest[: rest.index("--")] if "--" in rest else rest
        address = _option_value(options, "--ray")
        rest = [a for a in rest if a not in ("--ray", address, "--no-wait")]
        rest = ["--print", *rest]
        res = session.shell(["respo-verl", sub, *rest], env)
        _result(command, res)
        out = Path(_option_value(options, "--out") or "runs")
        assert out.is_absolute() and session.home in out.parents, f"`{command}`: put --out under $HOME"
        _write_logs_of_sweep(out)
        return
    if sub == "prepare-data":
        dataset = rest[0] if rest else ""
        if dataset == "dapo-math":
            rest = [*rest, "--source", _fixture(session, "dapo.parquet", [DAPO_ROW])]
        elif dataset == "eval-math":
            rest = [*rest, "--benchmark", "aime24", "--source", _fixture(session, "aime24.parquet", [EVAL_ROW])]
    if sub == "demo":
        pytest.fail(f"`{command}`: the demo trains; name it through `make demo` in a page")
    res = session.shell(["respo-verl", sub, *rest], env)
    _result(command, res)
    if sub == "report":
        out = Path(_option_value(rest, "--out"))
        assert (out / "report.md").is_file(), f"`{command}` wrote no report.md"


def run_python(session, command, program, args, knobs):
    assert args[:1] == ["-m"] and len(args) > 1, f"`{command}`: python -m MODULE ..."
    module, overrides = args[1], [a for a in args[2:]]
    entries = {"respo_verl.main_ppo": "respo", "verl.trainer.main_ppo": "verl"}
    assert module in entries, f"`{command}`: no rule for python -m {module}"
    for flag in ("--cfg", "job"):
        if flag in overrides:
            overrides.remove(flag)
    assert all("=" in o for o in overrides), f"`{command}`: Hydra overrides are key=value"
    from respo_verl.run.compose import compose_job
    from respo_verl.run.jobcheck import check_job

    try:
        check_job(compose_job(entries[module], overrides))
    except ValueError as err:
        pytest.fail(f"`{command}`: {err}")


def run_script(session, command, program, args, knobs):
    script = ROOT / program
    assert os.access(script, os.X_OK), f"`{command}`: {program} is not executable"
    if program == "scripts/install_gpu_env.sh":
        # Its arguments are parsed and checked first; .venv (the CPU environment) is then refused before anything.
        _check_knobs(command, script, knobs)
        res = session.shell([program, *args, "--venv", ".venv"], knobs)
        _result(command, res, expect=1)  # its refusal (an argument it does not take would be exit 2)
        assert ".venv is the CPU environment" in res.stderr, res.stderr
        return
    _check_knobs(command, script, knobs)
    assert "DRY_RUN" in _knobs_read(script), f"`{command}`: {program} has no DRY_RUN mode to run it here"
    # The same script with the same arguments and settings on two pages (the quick start and an example's comment)
    # is run once: an example's dry run composes the whole job, about 12 CPU seconds.
    key = (program, tuple(args), session.settings(knobs))
    if key in DRY_RUNS_PASSED:
        return
    res = session.shell([program, *args], {**knobs, "DRY_RUN": "1"})
    _result(command, res)
    if program.startswith("examples/"):
        assert "\ncommand:\n" in res.stdout, res.stdout[-2000:]
    DRY_RUNS_PASSED.add(key)


def run_sbatch(session, command, program, args, knobs):
    scripts = [a for a in args if a.endswith(".sbatch")]
    assert len(scripts) == 1, f"`{command}`: sbatch OPTIONS TEMPLATE"
    template = ROOT / scripts[0]
    assert template.is_file(), f"`{command}`: no {scripts[0]}"
    options = args[: args.index(scripts[0])]
    for option in options:
        assert option.split("=", 1)[0] in SBATCH_OPTIONS or not option.startswith("-"), f"`{command}`: {option}"
    # The template's knobs, and those of the example it runs, pass through the environment.
    example = ROOT / knobs.get("SCRIPT", "examples/run_qwen3_30b_a3b_megatron.sh")
    _check_knobs(command, template, knobs, _knobs_read(example))
    assert subprocess.run(["bash", "-n", str(template)]).returncode == 0
    # What the template runs first: the layout check of its preset on the allocation's node count.
    nodes = _option_value(options, "--nodes") or _option_value(options, "-N") or "2"
    preset = knobs.get("PRESET", "qwen3_30b_a3b_h100_2x8")
    _result(command, session.shell(["respo-verl", "plan", preset, f"trainer.nnodes={nodes}"]))


def run_make(session, command, program, args, knobs):
    assert args, f"`{command}`: make TARGET"
    _result(command, session.shell(["make", "-n", *args], knobs))


def run_hf(session, command, program, args, knobs):
    res = session.shell(["hf", args[0], "--help"])
    _result(command, res)
    unknown = [a.split("=")[0] for a in args if a.startswith("--") and a.split("=")[0] not in res.stdout]
    assert not unknown, f"`{command}`: hf {args[0]} takes no {unknown}"


def run_tail(session, command, program, args, knobs):
    _result(command, session.shell(["tail", *args]))


def run_pip(session, command, program, args, knobs):
    # Installing is what make setup does here; what is checked: the target is this checkout and its extras exist.
    import tomllib

    assert args[:1] == ["install"], f"`{command}`: pip install ..."
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    targets = [a for a in args[1:] if not a.startswith("-")]
    for target in targets:
        m = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", target)
        assert m, f"`{command}`: install this checkout (`.` or `.[extra]`), not {target!r}"
        missing = [e for e in (m.group(1) or "").split(",") if e and e not in extras]
        assert not missing, f"`{command}`: pyproject.toml has no extra {missing}"


RUNNERS = {
    "export": run_export,
    "source": run_source,
    "respo-verl": run_respo_verl,
    "python": run_python,
    "python3": run_python,
    "sbatch": run_sbatch,
    "make": run_make,
    "hf": run_hf,
    "tail": run_tail,
    "pip": run_pip,
}


def _model_config(home: Path) -> None:
    """Step 4 of the quick start downloads Qwen3-30B-A3B-Base; its config.json is what the later steps read."""
    from respo_verl.layout.models import QWEN3_30B_A3B
    from respo_verl.tools.plan.build import hf_config_from_shape

    folder = home / "models" / "Qwen3-30B-A3B-Base"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config_from_shape(QWEN3_30B_A3B)))


# --- the tests -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES)
def test_every_command_of_the_page_runs_here(page, tmp_path):
    commands = page_commands(page)
    assert commands, f"{page} has no fenced bash block"
    _model_config(tmp_path)
    session = Session(tmp_path)
    for command in commands:
        run_command(session, command)


@pytest.mark.parametrize("page", PAGES)
def test_no_command_of_the_page_is_outside_a_fenced_block(page):
    assert commands_outside_fences(page) == []


@pytest.mark.parametrize("script", EXAMPLES)
def test_the_commands_in_the_examples_comments_run_here(script, tmp_path):
    commands = example_commands(script)
    assert commands, f"{script}: no command line (`#   <command>`) in its comments"
    session = Session(tmp_path)
    for command in commands:
        run_command(session, command)


def test_the_quick_start_has_its_ten_steps_in_order():
    headings = re.findall(r"^## (\d+)\. ", (ROOT / "docs/cluster-quickstart.md").read_text(), re.M)
    assert headings == [str(i) for i in range(1, 11)]


def test_an_unknown_command_a_bad_flag_and_an_unread_knob_fail(tmp_path):
    """The checks above can fail: each of these is refused."""
    session = Session(tmp_path)
    bad = [
        "respo-verl prepare-dataset dapo-math --output x.parquet",  # no such subcommand
        "respo-verl plan qwen3_30b_a3b_h100_2x8 --gpus 8",  # no such flag
        "NO_SUCH_KNOB=1 scripts/launch/ray_cluster.sh head",  # a knob the script never reads
        "scripts/prepare_eval_math.py --output-dir x",  # a file the repository lacks
        "hf download Qwen/Qwen3-30B-A3B-Base --local-folder x",  # not a flag of hf download
    ]
    for command in bad:
        with pytest.raises((AssertionError, pytest.fail.Exception)):
            run_command(session, command)
