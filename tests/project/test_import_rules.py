"""The house's import rules (docs/architecture.md, "Import rules"): each part of `vlm_serve` imports only
the parts below it, and no files import each other in a circle. Every import counts, those made only for
type checking and those inside functions included: a circle of them is still two modules that cannot be
read, or moved, one without the other."""

from __future__ import annotations

import ast
from pathlib import Path

import vlm_serve

PACKAGE = Path(vlm_serve.__file__).parent

# small shared modules at the ground: they may import each other (circles among them are caught by the other test)
GROUND = {"errors", "sampling_params", "tokenizer", "detokenizer", "quantization", "checkpoint", "config", "builtin",
          "model_source", "process", "ipc"}  # fmt: skip
# The layers, lowest first: a part imports its own modules and those of the layers before it.
LAYERS: list[set[str]] = [
    GROUND,
    {"mm_cache"},  # content hashes and the processed-input and embedding caches
    {"multimodal"},  # media loading, preprocessing, the processor and the item types: the front end's side of pictures
    {"messages"},  # the typed messages between processes
    {"kv_cache"},  # the KV pools, their layout, the radix trees and their host and storage tiers
    {"llm"},  # the model executor
    {"vision"},  # the vision encoder beside the scheduler, or its pool of processes
    {"disaggregation"},  # PD's KV transport
    {"scheduler"},  # the control plane
    {"server"},  # the HTTP server and its processes
    {"engine"},  # the in-process engine
    {"engine_thread"},  # the engine driven by a thread of its own
    {"caption", "demo", "batch", "testing"},  # front ends on the engine; test checkpoints and deployments
    {"tools"},  # training the built-in model, the GPU kit
    {"cli", "__init__"},  # the entry points
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part(module: str) -> str:
    """The part of the package a module belongs to: its folder or file under vlm_serve/."""
    return module.split(".")[1] if "." in module else "__init__"


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (from ... import of a module's names counts as the module)."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {module: set() for module in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                continue
            graph[module] |= {name for name in names if name in modules and name != module}
    return graph


def layer_of(module: str) -> int:
    layers = [i for i, parts in enumerate(LAYERS) if part(module) in parts]
    assert layers, f"{module} is in no layer: give vlm_serve/{part(module)} its place in LAYERS and the docs"
    return layers[0]


def test_each_part_imports_only_the_layers_below_it():
    upward = []
    for module, imported in sorted(import_graph().items()):
        for target in sorted(imported):
            same_part = part(module) == part(target) or layer_of(module) == 0 == layer_of(target)
            if layer_of(target) > layer_of(module) or (layer_of(target) == layer_of(module) and not same_part):
                upward.append(f"{module} imports {target}")
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def test_no_files_import_each_other_in_a_circle():
    graph = import_graph()
    circles = [sorted(component) for component in strongly_connected(graph) if len(component) > 1]
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(circle) for circle in circles)


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    components.append(component)
    return components


def test_the_rules_catch_an_upward_import_and_a_circle():
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}, {"d"}]
    assert (
        layer_of("vlm_serve.llm.model_runner")
        < layer_of("vlm_serve.scheduler.scheduler")
        < layer_of("vlm_serve.server.launcher")
    )
    assert (
        layer_of("vlm_serve.multimodal.processor") < layer_of("vlm_serve.messages.backend") < layer_of("vlm_serve.llm")
    )
