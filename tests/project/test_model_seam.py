"""The model seam (docs/architecture.md, "Where to add what"): outside `llm/models/` the engine reaches a model
only through the seam's modules — the shared types (`base`), the registry of families and the loader — so that
a family is added in files of its own and one registry line."""

from __future__ import annotations

from test_import_rules import import_graph

MODELS = "vlm_serve.llm.models"
SEAM = {f"{MODELS}.base", f"{MODELS}.registry", f"{MODELS}.loader", MODELS}


def family_imports(graph: dict[str, set[str]]) -> list[str]:
    """'module imports family file' for each module outside llm/models importing one beyond the seam."""
    return [
        f"{module} imports {target}"
        for module, imported in sorted(graph.items())
        if not module.startswith(f"{MODELS}.")
        for target in sorted(imported)
        if target.startswith(f"{MODELS}.") and target not in SEAM
    ]


def test_no_module_outside_the_models_imports_a_family_file():
    crossings = family_imports(import_graph())
    assert not crossings, "imports of a model family's own file past the seam:\n" + "\n".join(crossings)


def test_the_seam_check_finds_a_crossing():
    graph = {
        "vlm_serve.scheduler.x": {f"{MODELS}.qwen3_vl", f"{MODELS}.base"},
        f"{MODELS}.registry": {f"{MODELS}.qwen3_vl"},
    }
    assert family_imports(graph) == [f"vlm_serve.scheduler.x imports {MODELS}.qwen3_vl"]
