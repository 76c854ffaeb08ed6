"""The controller's layout: the recipe at the top, the rest in wings by job,
and a pipeline extended through its hooks, never by replacing its methods.

`services/controller/` keeps at its top level only the RL loop and its wiring
(`loop.py`, `pipeline.py`, `assemble.py`), the domain, the protocols, the run
config and the service frame; everything else lives in a subpackage named for
its job, so the flat folder does not grow back.

Nothing under services/ or tests/ assigns to an attribute named like one of
`Pipeline`'s methods (`p.record = ...`, `pipeline._resume = ...`,
`setattr(p, "start", ...)`): a verb replaced at run time hides what a run
does from whoever reads the pipeline; `Pipeline.hooks` is the way in. A
class's own attributes (`self.summary = ...` outside Pipeline) are its
business. Checked on the source (ast).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.unit.layout_checks import top_level_strays as strays

ROOT = Path(__file__).resolve().parents[2]
CONTROLLER = ROOT / "services" / "controller"

TOP_LEVEL = {
    "__init__.py", "__main__.py", "app.py", "config.py", "servicer.py",  # the service frame
    "loop.py", "pipeline.py", "assemble.py",  # the recipe: the loop, its verbs, its wiring
    "domain.py", "protocols.py",  # what every wing speaks (and run_config/, the run file by section)
}
SUBPACKAGES = {
    "run_config", "tasks", "rollouts", "workers", "batches", "weights", "adapters", "telemetry", "ops", "launcher",
    "testing",
}
#: Where code that could patch a pipeline lives.
SEARCHED = ("services", "tests", "bench", "scripts")


def top_level_strays(package: Path) -> list[str]:
    return strays(package, TOP_LEVEL, SUBPACKAGES)


def pipeline_methods(source: str) -> set[str]:
    """The names of the methods `class Pipeline` defines in `source` (pipeline.py)."""
    tree = ast.parse(source)
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Pipeline"]
    return {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


class _Patches(ast.NodeVisitor):
    """Assignments to an attribute named `methods`, and setattr calls naming one."""

    def __init__(self, methods: set[str]) -> None:
        self.methods, self.classes, self.found = methods, [], []

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.classes.append(node.name)
        self.generic_visit(node)
        self.classes.pop()

    def _own(self, target: ast.expr) -> bool:
        # `self.x = ...` in a class of its own sets that class's attribute; in Pipeline it replaces a verb.
        return (isinstance(target, ast.Name) and target.id == "self" and bool(self.classes)
                and self.classes[-1] != "Pipeline")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.ctx, ast.Store) and node.attr in self.methods and not self._own(node.value):
            self.found.append((node.lineno, ast.unparse(node)))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
        if (name == "setattr" and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in self.methods and not self._own(node.args[0])):
            self.found.append((node.lineno, ast.unparse(node)))
        self.generic_visit(node)


def method_patches(source: str, methods: set[str]) -> list[tuple[int, str]]:
    visitor = _Patches(methods)
    visitor.visit(ast.parse(source))
    return sorted(visitor.found)


def test_the_top_level_holds_only_the_recipe_and_the_service_frame() -> None:
    assert top_level_strays(CONTROLLER) == []


def test_every_wing_is_there() -> None:
    assert {p.name for p in CONTROLLER.iterdir() if (p / "__init__.py").is_file()} == SUBPACKAGES


def test_no_code_replaces_a_pipeline_method() -> None:
    methods = pipeline_methods((CONTROLLER / "pipeline.py").read_text())
    assert {"start", "_resume", "record"} <= methods
    bad = []
    for root in SEARCHED:
        for path in sorted((ROOT / root).rglob("*.py")):
            bad += [f"{path.relative_to(ROOT)}:{line} {what}" for line, what in method_patches(path.read_text(), methods)]
    assert bad == []


def test_the_checks_see_violations(tmp_path: Path) -> None:
    package = tmp_path / "controller"
    for sub in ("rollouts", "misc"):
        (package / sub).mkdir(parents=True)
    (package / "rollouts" / "__init__.py").write_text("")
    (package / "loop.py").write_text("")
    (package / "balancer.py").write_text("")  # a wing's module back at the top
    (package / "misc" / "x.py").write_text("")  # a folder that is no wing (no __init__, not allowed)
    assert top_level_strays(package) == ["balancer.py", "misc/"]

    methods = pipeline_methods(
        "class RunState:\n"
        "    def describe(self): ...\n"
        "class Pipeline:\n"
        "    async def start(self): ...\n"
        "    async def _resume(self, source): ...\n"
        "    def record(self, batch, result): ...\n"
        "    def summary(self): ...\n"
    )
    assert methods == {"start", "_resume", "record", "summary"}
    source = (
        "def wire(pipeline, p, launcher, monkeypatch):\n"
        "    start = pipeline.start\n"  # reading a method: fine
        "    pipeline.start = start\n"
        "    p._resume = lambda source: None\n"
        "    launcher.pipeline.record = print\n"
        "    setattr(p, 'summary', None)\n"
        "    monkeypatch.setattr(p, 'record', print)\n"
        "    p.hooks.on_record.append(print)\n"  # the way in: fine
        "    p.state.steps_done = 3\n"  # run state: fine
        "class RunManager:\n"
        "    def ended(self, task):\n"
        "        self.summary = task.result()\n"  # its own attribute: fine
        "class Pipeline:\n"
        "    def start(self):\n"
        "        self.record = print\n"  # a verb replaced from inside
    )
    assert method_patches(source, methods) == [
        (3, "pipeline.start"),
        (4, "p._resume"),
        (5, "launcher.pipeline.record"),
        (6, "setattr(p, 'summary', None)"),
        (7, "monkeypatch.setattr(p, 'record', print)"),
        (15, "self.record"),
    ]


def weight_moves(package: Path) -> list[str]:
    """Places under `package` that name the RPCs (or their client calls) that move weights."""
    import re

    pattern = re.compile(r"\b(export_weights|update_weights|ExportWeights|UpdateWeights)\b")
    return [f"{p.relative_to(package.parent)}:{i}" for p in sorted(package.rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]


def test_one_road_the_controller_moves_no_weights() -> None:
    """The trainer publishes, the replicas follow the synchronizer: the controller neither exports
    nor loads a version (ExportWeights and UpdateWeights are operator RPCs)."""
    assert weight_moves(CONTROLLER) == []


def test_the_weight_move_check_sees_one(tmp_path: Path) -> None:
    package = tmp_path / "controller"
    package.mkdir()
    (package / "m.py").write_text("async def f(trainer):\n    await trainer.export_weights('memory')\n")
    assert weight_moves(package) == ["controller/m.py:2"]


def test_no_trainer_or_rollout_request_names_a_synchronizer() -> None:
    """Each service knows its synchronizer from its own config; a request never carries one."""
    from flywheel.rollout.v1 import rollout_pb2
    from flywheel.trainer.v1 import trainer_pb2

    def fields(descriptor, seen=None):
        seen = seen if seen is not None else set()
        if descriptor.full_name in seen:
            return []
        seen.add(descriptor.full_name)
        out = [f"{descriptor.full_name}.{f.name}" for f in descriptor.fields]
        for f in descriptor.fields:
            if f.message_type is not None:
                out += fields(f.message_type, seen)
        return out

    names = [name for module in (trainer_pb2, rollout_pb2) for message in module.DESCRIPTOR.message_types_by_name.values()
             for name in fields(message)]
    assert names and not [n for n in names if "synchronizer" in n.rsplit(".", 1)[1]]


# -- one holder of the newest committed version ---------------------------------

#: The one holder (its own attributes are the fact), and the one place that makes it.
NEWEST_HOLDER = "services/controller/weights/newest.py"
NEWEST_WRITER = "services/controller/weights/fleet.py"
#: Simulations of other services: the simulated synchronizer's newest version is the synchronizer's own.
NOT_THE_CONTROLLERS = ("services/controller/testing/",)
_VERSION_NAME = re.compile(r"^(latest|newest)$|(latest|newest).*version|version.*(latest|newest)", re.IGNORECASE)


class _Holders(ast.NodeVisitor):
    """Stores that keep a copy of the synchronizer's newest version, and constructions of NewestVersion."""

    def __init__(self) -> None:
        self.found: list[tuple[int, str]] = []
        self.made: list[int] = []
        self._params: list[dict[str, str]] = [{}]

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        self._params.append({a.arg: ast.unparse(a.annotation) if a.annotation else "" for a in args})
        self.generic_visit(node)
        self._params.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _visit_function

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for item in node.body:  # class fields (dataclasses): `latest_version: int = 0`
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                self._check(item.lineno, item.target.id, item.value, ast.unparse(item.target))
        self.generic_visit(node)

    def _holds_the_holder(self, value: ast.expr | None) -> bool:
        """`self.newest = newest` with `newest: NewestVersion` passed in: a reference, read."""
        return isinstance(value, ast.Name) and "NewestVersion" in self._params[-1].get(value.id, "")

    def _check(self, line: int, name: str, value: ast.expr | None, text: str) -> None:
        if isinstance(value, ast.Call) and ast.unparse(value.func).split(".")[-1] == "NewestVersion":
            return  # counted by visit_Call
        reads_the_wire = value is not None and any(
            isinstance(n, ast.Attribute) and n.attr == "latest_version" for n in ast.walk(value))
        if (_VERSION_NAME.search(name) and not self._holds_the_holder(value)) or reads_the_wire:
            self.found.append((line, text))

    def _store(self, line: int, target: ast.expr, value: ast.expr | None) -> None:
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
            for t, v in zip(target.elts, value.elts):  # `self.a, self.b = x, y`: each its own value
                self._store(line, t, v)
            return
        for t in ast.walk(target):
            if isinstance(t, ast.Attribute) and isinstance(t.ctx, ast.Store):
                self._check(line, t.attr, value, ast.unparse(t))

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._store(node.lineno, target, node.value)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._store(node.lineno, node.target, node.value)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._store(node.lineno, node.target, node.value)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if ast.unparse(node.func).split(".")[-1] == "NewestVersion":
            self.made.append(node.lineno)
        self.generic_visit(node)


def newest_version_holders(source: str) -> tuple[list[tuple[int, str]], list[int]]:
    """(copies of the newest committed version kept in `source`, lines that make a NewestVersion).
    A copy: an attribute or class field named like one (latest, newest, latest_version, ...), unless
    it is the holder passed in, or any attribute set from a `latest_version` (an event's, Status's)."""
    visitor = _Holders()
    visitor.visit(ast.parse(source))
    return sorted(visitor.found), visitor.made


def test_the_newest_committed_version_has_one_holder_in_the_controller() -> None:
    copies, makers = [], []
    for path in sorted(CONTROLLER.rglob("*.py")):
        name = str(path.relative_to(ROOT))
        if name == NEWEST_HOLDER or name.startswith(NOT_THE_CONTROLLERS):
            continue
        found, made = newest_version_holders(path.read_text())
        copies += [f"{name}:{line} {what}" for line, what in found]
        makers += [name] * len(made)
    assert copies == [], "read weights/newest.py's holder (the fleet's) instead of keeping a copy"
    assert makers == [NEWEST_WRITER]


def test_the_holder_check_sees_copies() -> None:
    source = (
        "class Observer:\n"
        "    latest_version: int = 0\n"  # a field of its own
        "    def __init__(self, newest: NewestVersion | None, ask_newest, events):\n"
        "        self.newest = newest\n"  # the holder, passed in: fine
        "        self.ask_newest = ask_newest\n"  # what asks the synchronizer: no copy
        "        self.latest = 0\n"
        "    def observe(self, event, status):\n"
        "        self.newest_version = max(self.newest_version, event.latest_version)\n"
        "        self.committed = event.latest_version\n"  # a copy under another name
        "        self.seen, self.top = status.epoch, status.latest_version\n"
        "        self.newest.heard(event.latest_version)\n"  # telling the holder: fine
        "        newest = event.latest_version\n"  # a local: gone at the return
        "        self.newest = newest\n"  # ... kept: a copy
        "class Fleet:\n"
        "    def __init__(self):\n"
        "        self.newest = NewestVersion()\n"
        "        self.other = versions.NewestVersion()\n"
    )
    copies, made = newest_version_holders(source)
    assert copies == [
        (2, "latest_version"), (6, "self.latest"), (8, "self.newest_version"), (9, "self.committed"),
        (10, "self.top"), (13, "self.newest"),
    ]
    assert made == [16, 17]
