"""The model seam (docs/architecture.md, "Where to add what"): outside `llm/models/` the engine reaches a model
only through the seam's modules — the shared types (`base`), the registry of families and the loader — so that
a family is added in files of its own and one registry line."""

from __future__ import annotations

import json
import re

import pytest
from test_import_rules import PACKAGE, import_graph

from vlm_serve.config import ModelConfig
from vlm_serve.llm.models.registry import ARCHITECTURES, model_family
from vlm_serve.testing.tiny_model import model_config

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


def test_the_registry_is_the_one_list_of_served_architectures(tmp_path):
    """A vision-language config.json is read whatever architecture it names; the registry serves those it
    lists, and names them when it refuses another. No other module lists architectures."""
    config = model_config("qwen2.5") | {"architectures": ["Qwen2VLForConditionalGeneration"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    read = ModelConfig.from_pretrained(tmp_path)
    served = ", ".join(ARCHITECTURES)
    with pytest.raises(
        ValueError, match=re.escape(f"unsupported architecture 'Qwen2VLForConditionalGeneration' (served: {served})")
    ):
        model_family(read)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}))
    with pytest.raises(ValueError, match="'LlamaForCausalLM': its config.json has no vision_config"):
        ModelConfig.from_pretrained(tmp_path)
    listing = [
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if re.search(r"[\"']Qwen\w*ForConditionalGeneration[\"']", path.read_text())
    ]
    assert sorted(listing) == ["llm/models/registry.py", "testing/tiny_model.py"]  # (the factory writes configs)
