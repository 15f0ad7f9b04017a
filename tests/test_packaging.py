"""Packaging: the Hydra presets live in the top-level ``configs/`` folder and ship inside the wheel as
``respo_verl.configs``, so that both entry points find them after ``pip install respo-verl``.

The wheel test builds the wheel from a copy of the sources, installs it (without dependencies) into a scratch venv
that sees the test environment's site-packages but not the editable install of this checkout, and composes jobs
there with both entry points, from a working directory outside the checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
SOURCES = ("pyproject.toml", "README.md", "respo_verl", "hydra_plugins", "configs")
WHERE = "import respo_verl.configs as c, hydra_plugins.respo_verl as h; print(c.__file__, h.__file__)"
GROUPS = ("algorithm", "cluster", "device", "respo_verl", "routing", "task")


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _source_packages() -> set[str]:
    """Every package of the source tree, named as it is installed."""
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "respo_verl").rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    found |= {"hydra_plugins", "hydra_plugins.respo_verl", "respo_verl.configs"}
    found |= {f"respo_verl.configs.{d.name}" for d in CONFIGS.iterdir() if d.is_dir() and d.name != "__pycache__"}
    return found


def test_configs_are_a_top_level_folder_with_every_group():
    assert (CONFIGS / "respo_trainer.yaml").is_file()
    assert not (ROOT / "respo_verl" / "verl" / "conf").exists()
    for group in GROUPS:
        assert sorted((CONFIGS / group).glob("*.yaml")), group


def test_listed_packages_are_the_packages_of_the_source_tree():
    setuptools = _pyproject()["tool"]["setuptools"]
    assert set(setuptools["packages"]) == _source_packages()
    assert setuptools["package-dir"] == {"respo_verl.configs": "configs"}


def test_the_configs_package_is_the_top_level_folder():
    from importlib import resources

    from respo_verl.run.compose import CONFIG_PACKAGE, package_dir

    assert package_dir(CONFIG_PACKAGE).resolve() == CONFIGS.resolve()
    assert Path(str(resources.files(CONFIG_PACKAGE))).resolve() == CONFIGS.resolve()


def _build_wheel(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(path, src / name)
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(dist), "."],
        cwd=src, check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    (wheel,) = dist.glob("respo_verl-*.whl")
    return wheel


def _scratch_venv(tmp_path: Path, wheel: Path) -> Path:
    """A venv holding only the wheel; the test environment's site-packages come after it through a .pth line."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()
    )  # fmt: skip
    (site / "test_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", str(wheel)],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return python


@pytest.mark.slow
def test_the_installed_wheel_composes_the_presets_with_both_entry_points(tmp_path):
    wheel = _build_wheel(tmp_path)
    python = _scratch_venv(tmp_path, wheel)
    work = tmp_path / "work"  # not the checkout: `python -m` puts the working directory first on sys.path
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TORCH_COMPILE_DISABLE="1", OMP_NUM_THREADS="1")

    names = zipfile.ZipFile(wheel).namelist()
    # The miniature is research code: neither it nor its base models are in the wheel.
    assert not [n for n in names if n.startswith("experiments/") or n.endswith(".pt")], "research code in the wheel"
    assert (ROOT / "experiments" / "mini" / "base_models").is_dir()

    where = subprocess.run(
        [str(python), "-c", WHERE],
        cwd=work, env=env, check=True, capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    site = str(python.parent.parent)
    assert all(path.startswith(site) for path in where), where  # the wheel's files, not the checkout's

    jobs = {
        "ours, cluster": ["-m", "respo_verl.main_ppo", "algorithm=vespo", "+cluster=qwen3_30b_a3b_h100_2x8"],
        "verl, cluster": ["-m", "verl.trainer.main_ppo", "+algorithm=vespo", "+cluster=qwen3_30b_a3b_h100_2x8"],
        "ours, cpu": ["-m", "respo_verl.main_ppo", "algorithm=vespo", "+device=cpu"],
        "verl, cpu": ["-m", "verl.trainer.main_ppo", "+algorithm=vespo", "+device=cpu"],
    }
    procs = {
        name: subprocess.Popen(
            [str(python), *argv, "--cfg", "job"],
            cwd=work,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, argv in jobs.items()
    }
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name}: {stderr[-3000:]}"
        job = OmegaConf.create(stdout)
        assert job.actor_rollout_ref.actor.policy_loss.loss_mode == "vespo", name
        if name.endswith("cluster"):
            assert job.trainer.nnodes == 2 and job.actor_rollout_ref.actor.strategy == "megatron", name
        else:
            assert job.trainer.device == "cpu" and job.actor_rollout_ref.rollout.name == "hf_cpu", name

    plan = subprocess.run(
        [str(python.parent / "respo-verl"), "plan", "qwen3_30b_a3b_h100_2x8"],
        cwd=work, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stdout[-2000:] + plan.stderr[-2000:]
