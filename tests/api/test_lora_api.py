"""LoRA adapters through the HTTP API, as vLLM's users drive them: `model` names an adapter (chat, text
completions, SGLang's /generate) or the base; /v1/models lists the adapters with the base as parent; adapters
are loaded and unloaded at run time (/v1/load_lora_adapter, /v1/unload_lora_adapter) while other requests
run; an unknown adapter is a 404 `model_not_found`, a malformed one a 400 naming the problem, and the server
goes on serving. The answers are PeftModel's greedy ones."""

from __future__ import annotations

import threading

import httpx
import pytest
import torch
import transformers

from helpers import running_server

pytestmark = pytest.mark.server  # every test here starts a real server
peft = pytest.importorskip("peft", reason="peft is the oracle of these tests (the test extra installs it)")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
QUESTION = "Tell me about the sea and the ships on it."
NEW_TOKENS = 6


def hf_model(model_dir):
    return transformers.Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapters(tiny_dense_dir, tmp_path_factory) -> dict[str, str]:
    folders = {}
    for name, seed in (("house-style", 1), ("charts", 2)):
        torch.manual_seed(seed)
        config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False)
        folder = tmp_path_factory.mktemp(name)
        peft.get_peft_model(hf_model(tiny_dense_dir), config).save_pretrained(folder)
        folders[name] = str(folder)
    return folders


@pytest.fixture(scope="module")
def expected(tiny_dense_dir, adapters) -> dict[str | None, str]:
    """PeftModel's greedy answer to QUESTION with each adapter (None: the base), as text."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dense_dir)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]

    def answer(model) -> str:
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False
            )
        return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

    answers = {None: answer(hf_model(tiny_dense_dir))}
    for name, folder in adapters.items():
        answers[name] = answer(peft.PeftModel.from_pretrained(hf_model(tiny_dense_dir), folder).eval())
    return answers


def chat(url: str, model: str) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def test_adapters_are_chosen_by_model_listed_and_loaded_and_unloaded_at_run_time(
    tiny_dense_dir, adapters, expected, tmp_path
):
    flags = ("--enable-lora", "--lora-paths", f"house-style={adapters['house-style']}", "--max-loras", "2")
    with running_server(tiny_dense_dir, "--served-model-name", "base", *flags) as server:
        url = server.url
        assert chat(url, "house-style").json()["choices"][0]["message"]["content"] == expected["house-style"]
        assert chat(url, "base").json()["choices"][0]["message"]["content"] == expected[None]
        models = {m["id"]: m for m in httpx.get(url + "/v1/models").json()["data"]}
        assert models["house-style"]["parent"] == "base" and models["house-style"]["root"] == adapters["house-style"]
        # SGLang's /generate: lora_path names the adapter (here one per prompt of a batch)
        tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dense_dir)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False
        )
        params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        body = {"text": [text, text], "lora_path": ["house-style", None], "sampling_params": params}
        generated = httpx.post(url + "/generate", json=body, timeout=60).json()
        assert [g["text"] for g in generated] == [expected["house-style"], expected[None]]
        missing = chat(url, "charts")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"

        # loaded while other requests run, used, unloaded, loaded again
        busy = threading.Thread(target=lambda: [chat(url, "base") for _ in range(4)])
        busy.start()
        load = {"lora_name": "charts", "lora_path": adapters["charts"]}
        assert httpx.post(url + "/v1/load_lora_adapter", json=load).status_code == 200
        assert chat(url, "charts").json()["choices"][0]["message"]["content"] == expected["charts"]
        assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "charts"}).status_code == 200
        assert chat(url, "charts").status_code == 404
        assert httpx.post(url + "/v1/load_lora_adapter", json=load).status_code == 200
        assert chat(url, "charts").json()["choices"][0]["message"]["content"] == expected["charts"]
        busy.join()
        unknown = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "nope"})
        assert unknown.status_code == 404

        # malformed adapters: a 400 naming the problem, and the server goes on
        broken = tmp_path / "broken"
        broken.mkdir()
        refused = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(broken)})
        assert refused.status_code == 400 and "adapter_config.json is missing" in refused.json()["error"]["message"]
        full = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "y", "lora_path": adapters["charts"]})
        assert full.status_code == 400 and "loaded already" not in full.text and "no free LoRA slot" in full.text
        assert chat(url, "house-style").json()["choices"][0]["message"]["content"] == expected["house-style"]
