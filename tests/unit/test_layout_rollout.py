"""The rollout's layout: files grouped by job, and one way to the synchronizer.

`services/rollout/` keeps at its top level only the launcher, the assembly,
the config, the gRPC servicer and the metrics; everything else lives in a
subpackage named for its job (`serving/`, `openai_api/`, `weights/`,
`engine/`), so the flat folder does not grow back.

The rollout reaches the synchronizer only through `flywheel/synchronizer/`
(its typed client), and only from `weights/` and the MEMORY pull that an
engine's worker process runs itself (`engine/pull.py`): no module opens a
gRPC channel of its own, names a synchronizer RPC path or imports the
synchronizer's wire stubs.

`engine/` is the floor: it imports nothing of the rollout above it (not
`serving/`, `weights/`, the API layers or the servicer; its config is fine),
as vLLM keeps its model executor below its engine. And a new version comes
in by one door (`weights/arrival.py`): only it runs the update transaction.

Checked on the source (ast), so a lazy import inside a function counts as
much as one at the top of a module.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.unit.layout_checks import absolute_imports
from tests.unit.layout_checks import top_level_strays as strays

ROOT = Path(__file__).resolve().parents[2]
ROLLOUT = ROOT / "services" / "rollout"

TOP_LEVEL = {"__init__.py", "__main__.py", "app.py", "config.py", "servicer.py", "metrics.py"}
SUBPACKAGES = {"engine", "serving", "openai_api", "weights"}
#: The synchronizer-facing code: the only places that may use flywheel.synchronizer's client side.
SYNC_FACING = "weights"
SYNC_FACING_FILES = {"engine/pull.py"}
#: What `engine/` may import of the rollout (everything else of services.rollout is above it).
ENGINE_MAY_IMPORT = ("services.rollout.engine", "services.rollout.config")
#: Who may run the update transaction (WeightUpdates.run): the door, and the NCCL receive it delegates to.
TRANSACTION_CALLERS = {"weights/arrival.py", "weights/nccl.py"}
#: flywheel.synchronizer modules that only name things (no calls): any module may import them.
SYNC_VOCABULARY = {
    "flywheel.synchronizer.types", "flywheel.synchronizer.client_types", "flywheel.synchronizer.presence_config",
}
#: Names that make a channel of one's own or a raw call on one.
CHANNEL_NAMES = {
    "open_channel", "insecure_channel", "secure_channel",
    "unary_unary", "unary_stream", "stream_unary", "stream_stream",
}
RPC_PATH = "/flywheel.synchronizer.v1."


def top_level_strays(package: Path) -> list[str]:
    return strays(package, TOP_LEVEL, SUBPACKAGES)


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for line, module, names in absolute_imports(tree):
        found.append((line, module))
        # `from flywheel.synchronizer import client` imports a module too.
        found += [(line, f"{module}.{name}") for name in names]
    return found


def channel_violations(package: Path) -> list[str]:
    """Every place under `package` that reaches the synchronizer, or opens a channel, other than through
    `flywheel.synchronizer`'s client from the synchronizer-facing subpackage."""
    bad: list[tuple[str, int, str]] = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        where = f"{package.name}/{rel.as_posix()}"
        facing = rel.parts[0] == SYNC_FACING or rel.as_posix() in SYNC_FACING_FILES
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, module in _imports(tree):
            last = module.rsplit(".", 1)[-1]
            if module.startswith("flywheel.synchronizer.v1"):
                bad.append((where, line, f"imports the wire stubs {module}"))
            elif last in CHANNEL_NAMES:
                bad.append((where, line, f"imports {module}"))
            elif (module.startswith("flywheel.synchronizer.") and not facing
                  and not any(module == v or module.startswith(v + ".") for v in SYNC_VOCABULARY)):
                bad.append((where, line, f"imports {module} outside {SYNC_FACING}/"))
        for node in ast.walk(tree):
            name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            if name in CHANNEL_NAMES:
                bad.append((where, node.lineno, f"uses {name}"))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and RPC_PATH in node.value:
                bad.append((where, node.lineno, f"names the RPC path {node.value!r}"))
    return [f"{where}:{line} {what}" for where, line, what in sorted(bad)]


def upward_imports(package: Path) -> list[str]:
    """Every import in `package`/engine/ of a rollout module outside the engine (and its config)."""
    bad = []
    name = f"services.{package.name}"
    for path in sorted((package / "engine").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, module in _imports(tree):
            if module.startswith(name + ".") and not module.startswith(
                    tuple(m.replace("services.rollout", name) for m in ENGINE_MAY_IMPORT)):
                bad.append(f"{package.name}/{path.relative_to(package).as_posix()}:{line} imports {module}")
    return sorted(set(bad))


def transaction_runs(package: Path) -> list[str]:
    """Every call of `<something>.run(...)` on the update transaction outside its door: a call named
    `run` on an attribute or name called `updates`."""
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "run"
                    and (getattr(node.func.value, "attr", None) == "updates" or getattr(node.func.value, "id", None) == "updates")
                    and rel not in TRANSACTION_CALLERS):
                found.append(f"{package.name}/{rel}:{node.lineno}")
    return found


def test_the_engine_imports_nothing_above_it() -> None:
    assert upward_imports(ROLLOUT) == []


def test_a_new_version_comes_in_by_one_door() -> None:
    assert transaction_runs(ROLLOUT) == []


def test_the_floor_checks_see_violations(tmp_path: Path) -> None:
    package = tmp_path / "rollout"
    (package / "engine").mkdir(parents=True)
    (package / "weights").mkdir()
    (package / "engine" / "vllm.py").write_text(
        "from services.rollout.engine.base import Engine\n"  # its own floor: fine
        "from services.rollout.config import RolloutConfig\n"  # its config: fine
        "def f():\n"
        "    from services.rollout.weights.verify import checkpoint_specs\n"  # upward, even lazily
        "from services.rollout.serving.text import TextCodec\n"
    )
    (package / "servicer.py").write_text("async def UpdateWeights(self):\n    await self.updates.run(1, None, None, 1)\n")
    (package / "weights" / "arrival.py").write_text("async def install(updates):\n    await updates.run(1)\n")
    assert upward_imports(package) == [
        "rollout/engine/vllm.py:4 imports services.rollout.weights.verify",
        "rollout/engine/vllm.py:4 imports services.rollout.weights.verify.checkpoint_specs",
        "rollout/engine/vllm.py:5 imports services.rollout.serving.text",
        "rollout/engine/vllm.py:5 imports services.rollout.serving.text.TextCodec",
    ]
    assert transaction_runs(package) == ["rollout/servicer.py:2"]


def test_the_top_level_holds_only_the_service_frame() -> None:
    assert top_level_strays(ROLLOUT) == []


def test_every_subpackage_is_there() -> None:
    assert {p.name for p in ROLLOUT.iterdir() if (p / "__init__.py").is_file()} == SUBPACKAGES


def test_the_synchronizer_is_reached_only_through_its_client() -> None:
    assert channel_violations(ROLLOUT) == []


def test_the_checks_see_violations(tmp_path: Path) -> None:
    package = tmp_path / "rollout"
    for sub in ("serving", "weights", "misc"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text("")
    (package / "app.py").write_text("")
    (package / "follower.py").write_text("")  # a domain module back at the top
    (package / "serving" / "core.py").write_text(
        "from flywheel.synchronizer.types import Method\n"  # vocabulary: fine anywhere
        "from flywheel.synchronizer.client import SynchronizerClient\n"  # the client, outside weights/
        "def pull():\n"
        "    from flywheel.runtime.client import open_channel\n"
        "    channel = open_channel('x')\n"
        "    return channel.unary_stream('/flywheel.synchronizer.v1.SynchronizerService/PullWeights')\n"
    )
    (package / "weights" / "memory.py").write_text(
        "from flywheel.synchronizer.client import SynchronizerClient\n"  # the one way: fine here
        "from flywheel.synchronizer.v1 import synchronizer_pb2\n"  # the wire stubs: nowhere
    )
    assert top_level_strays(package) == ["follower.py", "misc/"]
    assert channel_violations(package) == [
        "rollout/serving/core.py:2 imports flywheel.synchronizer.client outside weights/",
        "rollout/serving/core.py:2 imports flywheel.synchronizer.client.SynchronizerClient outside weights/",
        "rollout/serving/core.py:4 imports flywheel.runtime.client.open_channel",
        "rollout/serving/core.py:5 uses open_channel",
        "rollout/serving/core.py:6 names the RPC path '/flywheel.synchronizer.v1.SynchronizerService/PullWeights'",
        "rollout/serving/core.py:6 uses unary_stream",
        "rollout/weights/memory.py:2 imports the wire stubs flywheel.synchronizer.v1",
        "rollout/weights/memory.py:2 imports the wire stubs flywheel.synchronizer.v1.synchronizer_pb2",
    ]
