"""The shape of the house: one direction of dependency between the package's folders, no cycle, the research code
apart, and importing any module of the package changes nothing in verl, megatron-core, mbridge or transformers."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "respo_verl"
# Folders and top-level modules of respo_verl by layer: a module may import its own layer and those below it only.
LAYERS = (
    {"algorithms", "entry_points", "protocol", "core"},  # imports nothing of the package but its own layer
    {"patches"},  # the one patch helper and the patched libraries
    {"routing"},  # route drift, HF and megatron-core replay, the route-drift engine
    # a job's parallel layout and the rules it is held to; its data, and their check; its checkpoints' identity, layout
    # and resume plan
    {"layout", "data", "checkpoint"},
    {"run"},  # a run's lifecycle: composition, checks before Ray, preflight, the trainer, stops, the reaper
    {"verl"},  # verl glue: losses, estimator, config, the plugin that registers them (and the run's trainer)
    {"cpu"},  # verl on a CPU machine
    {"tools"},  # plan, sweep, report, runs, demo
    {"cli", "main_ppo"},  # the entry points
)
# The modules whose import is a switch: verl imports them (VERL_USE_EXTERNAL_MODULES) and nothing else calls them.
ACTIVATION_MODULES = ("respo_verl.cpu.activate",)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports (at module level or inside functions), by absolute name."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def _modules() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_folder_and_module_of_the_package_has_a_layer():
    parts = {_part(m) for m in _modules()} - {""}
    assert parts == set().union(*LAYERS), parts ^ set().union(*LAYERS)


def test_no_module_imports_a_higher_layer():
    layer = {part: i for i, parts in enumerate(LAYERS) for part in parts}
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in _modules().items()
        for target in targets
        if target.startswith("respo_verl.") and _part(module) and layer[_part(target)] > layer[_part(module)]
    )
    assert not upward


def test_the_folders_form_no_cycle():
    graph = defaultdict(set)
    for module, targets in _modules().items():
        for target in targets:
            if target.startswith("respo_verl.") and _part(module) and _part(target) != _part(module):
                graph[_part(module)].add(_part(target))
    seen, stack = set(), []

    def visit(node: str) -> None:
        assert node not in stack, f"cycle: {' -> '.join([*stack, node])}"
        if node in seen:
            return
        stack.append(node)
        for nxt in sorted(graph[node]):
            visit(nxt)
        stack.pop()
        seen.add(node)

    for node in sorted(graph):
        visit(node)


def test_nothing_in_the_package_imports_the_research_code():
    leaks = sorted(f"{m} -> {t}" for m, targets in _modules().items() for t in targets if t.startswith("experiments"))
    assert not leaks
    assert not list(PACKAGE.rglob("*.pt")), "the research code's base models do not ship in the package"


def test_core_imports_only_torch_and_the_standard_library():
    allowed = {"torch", "__future__", *sys.stdlib_module_names}
    foreign = sorted(
        f"{m} -> {t}"
        for m, targets in _modules().items()
        if m.startswith("respo_verl.core")
        for t in targets
        if not t.startswith("respo_verl.core") and t.split(".")[0] not in allowed
    )
    assert not foreign


# A fresh interpreter imports the libraries first, records every attribute of their modules (and of the classes
# defined there) by identity, imports every module of respo_verl, and reports what differs. Attributes that are
# modules are left out: importing a submodule binds it in its parent, which changes nothing that runs.
SNAPSHOT = r"""
import importlib, json, pkgutil, sys, types
LIBS = ("verl", "megatron", "mbridge", "transformers")
for name in ("verl.trainer.main_ppo", "verl.workers.engine_workers", "verl.workers.engine.megatron.transformer_impl",
             "verl.models.mcore.model_forward", "megatron.core.transformer.moe.token_dispatcher",
             "megatron.core.optimizer.optimizer", "mbridge.core.bridge", "mbridge.core.llm_bridge",
             "transformers.models.qwen3_moe.modeling_qwen3_moe"):
    importlib.import_module(name)

def snapshot():
    state = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(LIBS):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, types.ModuleType):
                continue
            state[f"{name}.{attr}"] = id(value)
            if isinstance(value, type) and value.__module__ == name:
                for key, member in list(vars(value).items()):
                    state[f"{name}.{attr}.{key}"] = id(member)
    return state

def changed(before, after):
    return sorted(k for k in before if k in after and before[k] != after[k])

before = snapshot()
skip = set(sys.argv[1].split(","))
import respo_verl
for info in pkgutil.walk_packages(respo_verl.__path__, "respo_verl."):
    if info.name not in skip and not info.name.endswith(".__main__"):
        importlib.import_module(info.name)
plain = changed(before, snapshot())
activated = []
if sys.argv[2] == "activate":
    import respo_verl.cpu.activate
    from respo_verl.cpu.runtime import RUNTIME
    activated = changed(before, snapshot())
    RUNTIME.remove()
print(json.dumps({"plain": plain, "activated": activated, "after_remove": changed(before, snapshot())}))
"""


def _snapshot(activate: bool) -> dict:
    mode = "activate" if activate else "plain"
    proc = subprocess.run(
        [sys.executable, "-c", SNAPSHOT, ",".join(ACTIVATION_MODULES), mode],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**__import__("os").environ, "VERL_USE_EXTERNAL_MODULES": ""},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_importing_every_module_changes_no_attribute_of_the_libraries_and_the_cpu_switch_is_undone():
    result = _snapshot(activate=True)
    assert result["plain"] == []
    # The CPU switch does change verl (the gloo default, the fp32 Megatron config, the current platform) ...
    assert "verl.utils.distributed.initialize_global_process_group_ray" in result["activated"]
    assert "verl.workers.config.engine.McoreEngineConfig.__post_init__" in result["activated"]
    # ... and its Patch puts every attribute back.
    assert result["after_remove"] == []


# `docs/<page>.md` in code, optionally followed by `, "<heading>"` (a section named by its title, not its number).
DOCS_REFERENCE = __import__("re").compile(r'docs/([a-z0-9-]+\.md)(?:, "([^"]+)")?')
CODE_FOLDERS = ("respo_verl", "experiments", "scripts", "configs", "examples", "hydra_plugins")


def test_every_docs_reference_in_code_names_a_page_and_heading_that_exist():
    import re

    missing = []
    for folder in CODE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in (".py", ".yaml", ".sh", ".sbatch") or "__pycache__" in path.parts:
                continue
            for page, heading in DOCS_REFERENCE.findall(path.read_text()):
                doc = ROOT / "docs" / page
                if not doc.is_file():
                    missing.append(f"{path.relative_to(ROOT)}: docs/{page}")
                    continue
                titles = {re.sub(r"^#+\s*([0-9.]+\s+)?", "", line).strip() for line in doc.read_text().splitlines()}
                if heading and heading not in titles:
                    missing.append(f'{path.relative_to(ROOT)}: docs/{page}, "{heading}"')
    assert not missing


# Names of the package in the project's text: a dotted module path (``respo_verl.run.guards.STOPPED_KEY``), a file
# path (``respo_verl/run/trainer.py``) or a command (``respo-verl plan``). After a move or a removal, text that still
# names the old place sends a reader nowhere.
TEXT_FOLDERS = (*CODE_FOLDERS, "tests", "docs", "patches")
TEXT_FILES = ("README.md", "Makefile")
# Names as the text quotes them, in backticks (also ``:mod:``/``:func:``); a name in a string of code is data.
DOTTED = __import__("re").compile(r"`~?(respo_verl(?:\.[A-Za-z_]\w*)+)")
FILE_PATH = __import__("re").compile(
    r"`((?:respo_verl|experiments|scripts|tests|configs)/[\w/.-]*\w\.(?:py|yaml|sh))\b"
)
# ``respo-verl reaper: ...`` and ``respo-verl preflight failed ...`` start lines the package prints: not commands.
COMMAND = __import__("re").compile(r"`respo-verl ([a-z][a-z-]*)\b(?!:| failed)")


def _text_files():
    for folder in TEXT_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".yaml", ".sh", ".sbatch", ".md") and "__pycache__" not in path.parts:
                yield path
    yield from (ROOT / name for name in TEXT_FILES)


def _top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                names.update(ast.literal_eval(node.value))  # a package's lazy exports
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


def _module_file(parts: list[str]) -> Path | None:
    folder = ROOT / "configs" if parts[:2] == ["respo_verl", "configs"] else ROOT.joinpath(*parts[:1])
    rest = parts[2:] if parts[:2] == ["respo_verl", "configs"] else parts[1:]
    base = folder.joinpath(*rest)
    for candidate in (base.with_suffix(".py"), base / "__init__.py", base.with_suffix(".yaml"), base):
        if candidate.exists():
            return candidate
    return None


def _dotted_name_exists(name: str) -> bool:
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        found = _module_file(parts[:end])
        if found is None:
            continue
        if end == len(parts):
            return True
        return found.suffix == ".py" and (parts[end].startswith("__") or parts[end] in _top_level_names(found))
    return False


def test_the_text_names_only_modules_files_and_commands_that_exist():
    from respo_verl.cli import MOVED, SUBCOMMANDS

    wrong = []
    for path in _text_files():
        text = path.read_text()
        where = path.relative_to(ROOT)
        wrong += [f"{where}: {n}" for n in sorted(set(DOTTED.findall(text))) if not _dotted_name_exists(n)]
        wrong += [f"{where}: {p}" for p in sorted(set(FILE_PATH.findall(text))) if not (ROOT / p).exists()]
        commands = set(COMMAND.findall(text)) - set(SUBCOMMANDS) - {"verl"}
        wrong += [f"{where}: respo-verl {c}" for c in sorted(commands) if c not in MOVED or path.suffix != ".md"]
    assert not wrong, "\n".join(wrong)


def test_no_script_or_example_reaches_into_the_tests():
    """Scripts and examples stand on the package: the tiny MoE model they use is respo_verl.cpu.kit.megatron_moe."""
    import re

    into_tests = re.compile(r"^\s*(?:from|import)\s+(?:support|tests|conftest)\b|/tests\b|\"tests\"", re.M)
    found = [
        f"{path.relative_to(ROOT)}: {match.group(0).strip()}"
        for folder in ("scripts", "examples")
        for path in sorted((ROOT / folder).rglob("*"))
        if path.suffix in (".py", ".sh", ".sbatch")
        for match in into_tests.finditer(path.read_text())
    ]
    assert not found, found
