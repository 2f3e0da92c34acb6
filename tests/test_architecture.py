"""The package's shape, checked: no import cycle, short functions, a loop that fits a screen."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "flashdraft"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, ast.Module]:
    return {_module_name(p): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def module_imports(name: str, tree: ast.Module, modules) -> set[str]:
    """The package modules ``name`` imports, anywhere in its body (a function-level import is a
    dependency too; ``from pkg import name`` counts as pkg.name when that is a module)."""
    is_package = (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()
    edges = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        edges |= {t for t in targets if t in modules and t != name}
    return edges


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (``module_imports``)."""
    modules = _modules()
    return {name: module_imports(name, tree, modules) for name, tree in modules.items()}


def imports_of(graph: dict[str, set[str]], importer: str, imported: str) -> list[str]:
    """'a imports b' for every module a in package ``importer`` (or that module) that imports
    package ``imported`` or one of its modules."""
    def within(module: str, package: str) -> bool:
        return module == package or module.startswith(package + ".")

    return sorted(f"{a} imports {b}" for a, edges in graph.items() if within(a, importer)
                  for b in edges if within(b, imported))


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "flashdraft.train.trainer" in graph and graph["flashdraft.train.trainer"]  # the walk sees imports
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_feed_never_imports_the_trainer():
    """flashdraft.feed produces a step's features for whoever consumes them: the trainer imports
    the feed, never the other way round (a disaggregated target rank runs the feed alone)."""
    graph = import_graph()
    assert any(m.startswith("flashdraft.feed.") for m in graph)  # the walk sees the package
    assert imports_of(graph, "flashdraft.train", "flashdraft.feed")  # and the trainer's use of it
    found = imports_of(graph, "flashdraft.feed", "flashdraft.train")
    assert not found, found


def test_the_trainer_sees_the_feed_through_its_face_only():
    """One builder picks the topology (feed.open_feed / feed.serve): nothing in flashdraft.train
    imports a module of flashdraft.feed, only the package's face (its ``__all__``)."""
    import flashdraft.feed

    graph = import_graph()
    inside = [edge for edge in imports_of(graph, "flashdraft.train", "flashdraft.feed")
              if not edge.endswith(" imports flashdraft.feed")]
    assert not inside, inside
    for name, tree in _modules().items():
        if name.startswith("flashdraft.train"):
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module == "flashdraft.feed":
                    names = {a.name for a in node.names}
                    assert names <= set(flashdraft.feed.__all__), (name, names)


def test_the_feed_check_sees_function_level_and_type_checking_imports():
    modules = {"flashdraft.feed.x": None, "flashdraft.train": None, "flashdraft.train.runtime": None,
               "flashdraft.metrics": None}
    cases = {
        "def stop():\n    from flashdraft.train.runtime import GracefulStop\n": ["flashdraft.train.runtime"],
        "if TYPE_CHECKING:\n    from flashdraft.train import runtime\n": ["flashdraft.train.runtime"],
        "def f():\n    import flashdraft.train\n": ["flashdraft.train"],
        "from flashdraft.metrics import StageTimer\n": [],
    }
    for source, imported in cases.items():
        graph = {"flashdraft.feed.x": module_imports("flashdraft.feed.x", ast.parse(source), modules)}
        assert imports_of(graph, "flashdraft.feed", "flashdraft.train") == \
            [f"flashdraft.feed.x imports {m}" for m in imported], source


def test_no_function_is_over_80_lines():
    long = [f"{name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for name, tree in _modules().items() for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno - node.lineno >= 80]
    assert not long, long


def test_no_class_is_over_300_lines():
    """CheckpointManager was 325: the directory's housekeeping is CheckpointDir's now."""
    long = [f"{name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for name, tree in _modules().items() for node in ast.walk(tree)
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno >= 300]
    assert not long, long


def test_the_training_loop_fits_in_300_lines():
    tree = _modules()["flashdraft.train.trainer"]
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    assert trainer.end_lineno - trainer.lineno < 300


def outside_imports(tree: ast.Module) -> list[str]:
    """Every import in ``tree``, anywhere in its body, of something but the standard library and
    yaml (a package import included, relative or absolute), and every dynamic import (by name)."""
    allowed = sys.stdlib_module_names | {"yaml", "__future__"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = ["." * node.level + (node.module or "")]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
                "import_module", "__import__"):
            found.append(f"line {node.lineno}: {ast.unparse(node)} (a dynamic import)")
            continue
        else:
            continue
        found += [f"line {node.lineno}: {n}" for n in names if n.split(".")[0] not in allowed]
    return found


def test_the_config_imports_only_the_standard_library_and_yaml():
    """The config is the leaf every module may import: an import of the package from it (for a
    choice list, a rule, a constructor) would run an arrow back up the tree."""
    assert not outside_imports(_modules()["flashdraft.config"])


def test_the_config_import_check_finds_package_imports():
    source = ("import os\nimport yaml\nfrom flashdraft.objective import LOSSES\nfrom . import metrics\n"
              "def f():\n    import flashdraft.drafter\n    import torch\n"
              "    return importlib.import_module('x')\n")
    assert outside_imports(ast.parse(source)) == [
        "line 3: flashdraft.objective", "line 4: .", "line 6: flashdraft.drafter", "line 7: torch",
        "line 8: importlib.import_module('x') (a dynamic import)"]


def identifiers(tree: ast.Module) -> set[str]:
    """Every name ``tree`` uses or defines: variables, attributes, imports, functions, classes,
    arguments and keywords (comments and strings aside)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.alias):
            found |= {*node.name.split("."), node.asname or node.name}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= set(node.module.split("."))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.add(node.name)
        elif isinstance(node, ast.arg):
            found.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            found.add(node.arg)
    return found


def naming(modules: dict[str, ast.Module], names: list[str], words: tuple[str, ...]) -> list[str]:
    """'module: identifier' for each identifier of ``names``' modules containing one of ``words``
    (case-insensitive)."""
    return sorted(f"{name}: {ident}" for name in names for ident in identifiers(modules[name])
                  if any(w in ident.lower() for w in words))


# The training path: everything a step or an eval runs through but the strategy
STEP_PATH = ["flashdraft.train.step", "flashdraft.train.backend", "flashdraft.train.validation",
             "flashdraft.train.log"]


def test_only_the_strategy_names_dflash2s_selector_on_the_training_path():
    """The selector term (its schedule, its loss, its stats, the freeze of a selector no objective
    trains) lives in train/strategy.py; the step, the backend, the validator, the log and the loop
    are handed a strategy."""
    modules = _modules()
    assert naming(modules, ["flashdraft.train.strategy"], ("selector",))  # the check sees the strategy's
    found = naming(modules, [*STEP_PATH, "flashdraft.train.trainer"], ("selector",))
    assert not found, found


def test_the_step_the_backend_the_validator_and_the_log_never_pick_a_drafter_family():
    """The family is picked once (strategy_for, called by the trainer): none of these names a
    family, its strategy or its modules."""
    modules = _modules()
    found = naming(modules, STEP_PATH, ("dflash2", "strategy_for", "candidate"))
    assert not found, found
    graph = import_graph()
    assert not [edge for m in STEP_PATH for edge in imports_of(graph, m, "flashdraft.drafter.dflash2")]


def test_the_backend_knows_no_loss_and_the_strategy_no_ddp():
    """One owner per concern: the backend (DDP, the optimizer) imports neither the objective, the
    strategy nor the drafter; the strategy (blocks, loss) neither the backend nor DDP."""
    graph = import_graph()
    found = [e for pkg in ("flashdraft.objective", "flashdraft.train.strategy", "flashdraft.drafter")
             for e in imports_of(graph, "flashdraft.train.backend", pkg)]
    found += imports_of(graph, "flashdraft.train.strategy", "flashdraft.train.backend")
    assert not found, found
    assert "DistributedDataParallel" in identifiers(_modules()["flashdraft.train.backend"])
    strategy = identifiers(_modules()["flashdraft.train.strategy"])
    assert not strategy & {"DistributedDataParallel", "DDP", "no_sync"}


def test_the_identifier_check_sees_attributes_keywords_imports_and_arguments():
    source = ("from flashdraft.drafter.dflash2 import DFlash2Modules as M\n"
              "def f(selector_loss, x=None):\n    return g(x.candidate_selector, alpha=x.SelectorLoss)\n"
              "# a selector in a comment\ny = 'selector'\n")
    assert identifiers(ast.parse(source)) >= {"dflash2", "DFlash2Modules", "M", "selector_loss",
                                              "candidate_selector", "alpha", "SelectorLoss",
                                              "f", "g", "x", "y"}
    assert naming({"m": ast.parse(source)}, ["m"], ("selector",)) == [
        "m: SelectorLoss", "m: candidate_selector", "m: selector_loss"]


def patched_imports(tree: ast.Module) -> list[str]:
    """Assignments to an attribute of something imported from the package (``module.name = ...``,
    ``Class.method = ...``): run-time patching of another module's code."""
    imported = {alias.asname or alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import | ast.ImportFrom)
                and (getattr(node, "module", None) or "").startswith("flashdraft") | any(
                    a.name.startswith("flashdraft") for a in node.names) for alias in node.names}
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AugAssign | ast.AnnAssign) else []
        for target in (t for outer in targets
                       for t in (outer.elts if isinstance(outer, ast.Tuple) else [outer])):
            base = target
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(target, ast.Attribute) and isinstance(base, ast.Name) and base.id in imported:
                found.append(f"line {target.lineno}: {ast.unparse(target)}")
    return found


def test_no_module_patches_another_at_run_time():
    """The memory plan used to swap the drafter's attention plan and kernels for stand-ins in every
    training process; its stand-ins are now named implementations the drafter registers."""
    patches = {name: found for name, tree in _modules().items() if (found := patched_imports(tree))}
    assert not patches, patches


def test_the_patch_check_finds_a_patch():
    tree = ast.parse("from flashdraft.drafter import model as m\nimport flashdraft.x\n"
                     "m.DFlashDrafter.attend, y = f, 1\nflashdraft.x.z = 2\nlocal = object()\nlocal.a = 1\n")
    assert patched_imports(tree) == ["line 3: m.DFlashDrafter.attend", "line 4: flashdraft.x.z"]


def test_the_engine_environment_has_one_owner_below_the_judges_and_the_target():
    """flashdraft.vllm_env picks the engine's interpreter for the judges and the vLLM target alike:
    it imports nothing of flashdraft, so the target uses it without an arrow up to the judges;
    nothing below the commands imports flashdraft.judge, and the judges' workers import no
    flashdraft at all (they run under the engine's interpreter)."""
    graph = import_graph()
    assert graph["flashdraft.vllm_env"] == set(), graph["flashdraft.vllm_env"]
    assert "flashdraft.vllm_env" in graph["flashdraft.target.engine"]
    assert "flashdraft.vllm_env" in graph["flashdraft.judge.engine"]
    for low in ("flashdraft.target", "flashdraft.train", "flashdraft.feed", "flashdraft.drafter",
                "flashdraft.data"):
        found = imports_of(graph, low, "flashdraft.judge")
        assert not found, found
    for worker in ("engine_worker", "reference_worker", "worker_io"):
        tree = _modules()[f"flashdraft.judge.workers.{worker}"]
        assert not [n for n in outside_imports(tree) if "flashdraft" in n], worker


def rooms(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between the package's top-level parts (a subpackage or a module): an
    arrow that runs back up the floors is a cycle here, even when the modules have none."""
    def room(module: str) -> str:
        return ".".join(module.split(".")[:2])

    out: dict[str, set[str]] = {}
    for module, edges in graph.items():
        out.setdefault(room(module), set()).update(room(e) for e in edges if room(e) != room(module))
    return out


def test_no_top_level_part_imports_one_that_imports_it_back():
    """train/ imported plan.py, which imported train/ back; the judge imported train/, which
    imported it for a warning: the house's arrows back up. Each part now sits above what it uses."""
    graph = rooms(import_graph())
    graph.pop("flashdraft", None)  # the package's face hands names on
    assert find_cycle(graph) is None, find_cycle(graph)


def test_the_top_level_holds_at_most_15_modules():
    modules = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(modules) <= 15, modules


# ---- each part takes its own config section -------------------------------------------------------
# The composition reads the whole run config and hands each part its section (or the values it
# needs): the rank's start-up and its checks, the memory plan, the trainer, a target rank, the
# feed's builders. Commands and benchmarks compose runs too. Everyone else takes a section.
COMPOSITION = {"flashdraft.config", "flashdraft.train.startup", "flashdraft.train.checks",
               "flashdraft.train.plan", "flashdraft.train.trainer", "flashdraft.train.target_rank",
               "flashdraft.feed"}
COMMANDS = ("flashdraft.cli", "flashdraft.quickstart", "flashdraft.train.cli", "flashdraft.bench")
# section -> the packages or modules that may take it (its owners), beyond the composition
SECTION_OWNERS = {
    "TargetConfig": ("flashdraft.target",),
    "DrafterConfig": ("flashdraft.drafter", "flashdraft.data.inspect"),  # inspect: the block size's default
    "DataConfig": ("flashdraft.data",),
    "ObjectiveConfig": ("flashdraft.objective", "flashdraft.train.strategy"),
    "OptimConfig": ("flashdraft.train.optim",),
    "TrainConfig": ("flashdraft.train.log",),
    "CheckpointConfig": ("flashdraft.train.state",),
    "EvalConfig": ("flashdraft.train.validation",),
    "PipelineConfig": ("flashdraft.feed",),
}
SECTIONS = {"target", "drafter", "data", "objective", "optim", "train", "checkpoint", "eval", "pipeline"}
CONFIG_NAMES = ("cfg", "config")  # what a whole config is called where it is passed on


def _config_name(node: ast.AST) -> bool:
    name = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else "")
    return name.lstrip("_") in CONFIG_NAMES


def _within(module: str, owners) -> bool:
    return any(module == o or module.startswith(o + ".") for o in owners)


def config_uses(tree: ast.Module) -> list[str]:
    """Where ``tree`` takes the whole run config: an import of ``Config`` or of the config module,
    a section read off a config (``cfg.train``, ``self.config.pipeline``,
    ``stages.config.pipeline``: any name or attribute called cfg / config) or got from one
    (``getattr(config, section)``), as 'line N: what'. A config under another name (``c =
    config``) passes: the names say what a value is, and the review keeps them so."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "flashdraft.config":
            found += [f"line {node.lineno}: imports Config" for a in node.names if a.name == "Config"]
        elif isinstance(node, ast.Import):
            found += [f"line {node.lineno}: imports {a.name}" for a in node.names if a.name == "flashdraft.config"]
        elif isinstance(node, ast.Attribute) and node.attr in SECTIONS and _config_name(node.value):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) > 1 and _config_name(node.args[0])):
            key = node.args[1]  # a section by name, or one a variable names (a model's config.json: neither)
            if not isinstance(key, ast.Constant) or key.value in SECTIONS:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return sorted(found, key=lambda line: int(line.split()[1].rstrip(":")))


def section_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, section class) of each config section ``tree`` imports."""
    return [(node.lineno, a.name) for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module == "flashdraft.config"
            for a in node.names if a.name in SECTION_OWNERS]


def test_only_the_composition_reads_the_whole_config():
    """The whole Config used to travel into the step, the validator, the stages, the links, the
    log and the checkpoints; each now takes its section (tests/test_architecture.py names who
    composes)."""
    found = {name: uses for name, tree in _modules().items()
             if not (name in COMPOSITION or _within(name, COMMANDS)) and (uses := config_uses(tree))}
    assert not found, found


def test_each_config_section_is_imported_by_its_owner_and_only_there():
    """Each section class is imported (to type what takes it) by its owner, and outside the
    composition by no one else; the tables above list every section the config has."""
    from flashdraft.config import _sections

    assert {name for name, _ in _sections()} == SECTIONS
    assert {cls.__name__ for _, cls in _sections()} == set(SECTION_OWNERS)
    imported = [(name, line, section) for name, tree in _modules().items() for line, section in section_imports(tree)]
    strays = [f"{name} line {line}: {section}" for name, line, section in imported
              if not (name in COMPOSITION or _within(name, COMMANDS) or _within(name, SECTION_OWNERS[section]))]
    assert not strays, strays
    unowned = sorted(set(SECTION_OWNERS) - {section for name, _, section in imported
                                            if _within(name, SECTION_OWNERS[section])})
    assert not unowned, f"no owner imports {unowned}"


def test_the_config_checks_see_a_whole_config_and_a_borrowed_section():
    tree = ast.parse("from flashdraft.config import Config, EvalConfig\nclass S:\n"
                     "    def f(self, stages):\n        a = stages.config.pipeline.capacity\n"
                     "        b = cfg.train\n        c = self.target.path\n"
                     "        d = getattr(self._config, 'eval')\nimport flashdraft.config\n")
    assert config_uses(tree) == ["line 1: imports Config", "line 4: stages.config.pipeline",
                                 "line 5: cfg.train", "line 7: getattr(self._config, 'eval')",
                                 "line 8: imports flashdraft.config"]
    assert section_imports(tree) == [(1, "EvalConfig")]
