"""LoRA adapters on a PD pair (tests/pd_loopback.py): both sides load the same adapters; a request through an
adapter of the language model, or of the vision tower and the language model, is answered by the decode side
with PeftModel's greedy tokens; a pair whose adapters of one name differ fails such a request naming both."""

from __future__ import annotations

import pytest
import torch
import transformers

from helpers import hf_inputs
from pd_loopback import PDPair
from vlm_serve.testing.media import make_image

peft = pytest.importorskip("peft", reason="peft is the oracle of these tests (the test extra installs it)")

NEW_TOKENS = 6
TARGETS = {
    "text": r".*language_model\..*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)",
    "both": r".*visual\..*\.(qkv|attn\.proj|linear_fc1|linear_fc2)|.*language_model\..*\.(q_proj|down_proj)",
}
MESSAGES = [
    {
        "role": "user",
        "content": [{"type": "image", "image": make_image(96, 64, seed=1)}, {"type": "text", "text": "Hi"}],
    }
]


def hf_model(model_dir):
    return transformers.Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapters(tiny_dense_dir, tmp_path_factory) -> dict[str, str]:
    """ "text" and "both" (by their targets), and "text, retrained": "text"'s targets, other weights."""
    folders = {}
    for seed, (name, targets) in enumerate([*TARGETS.items(), ("text, retrained", TARGETS["text"])]):
        torch.manual_seed(seed)
        config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=targets, init_lora_weights=False)
        folder = tmp_path_factory.mktemp("lora")
        peft.get_peft_model(hf_model(tiny_dense_dir), config).save_pretrained(folder)
        folders[name] = str(folder)
    return folders


@pytest.fixture
def pair(tiny_dense_dir, adapters, monkeypatch, request):
    """Both sides serve "text" and "both"; with the parameter "differ", the decode side's "text" is another
    adapter of that name."""
    paths = [f"{name}={adapters[name]}" for name in TARGETS]
    decode = [f"text={adapters['text, retrained']}", f"both={adapters['both']}"]
    options = {"dtype": "float32", "enable_lora": True, "lora_paths": paths}
    differ = getattr(request, "param", None) == "differ"
    pair = PDPair(tiny_dense_dir, monkeypatch, decode_options={"lora_paths": decode} if differ else None, **options)
    yield pair
    for engine in (pair.prefill, pair.decode):
        engine.scheduler.check_memory()
    pair.close()


def run(pair: PDPair, lora: str | None):
    x = pair.decode.processor.process_messages(MESSAGES, add_generation_prompt=True)
    prefill, decode = pair.submit(x, lora=lora, max_tokens=NEW_TOKENS, temperature=0)
    pair.run(prefill, decode)
    return x, decode


def test_the_decode_side_answers_through_each_adapter_as_peft_does(pair, adapters, tiny_dense_dir):
    for lora in (None, "text", "both"):
        x, decode = run(pair, lora)
        model = hf_model(tiny_dense_dir)
        if lora is not None:
            model = peft.PeftModel.from_pretrained(model, adapters[lora]).eval()
        inputs = hf_inputs(pair.decode, x)
        with torch.no_grad():
            want = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert pair.decode.result(decode).token_ids == want[0, inputs["input_ids"].shape[1] :].tolist(), lora


@pytest.mark.parametrize("pair", ["differ"], indirect=True)
def test_a_pair_whose_adapters_of_one_name_differ_fails_the_request_naming_both(pair):
    _, decode = run(pair, "text")
    with pytest.raises(Exception, match=r"through LoRA adapter 'text' \(\w+\), .* through 'text' \(\w+\)") as failure:
        pair.decode.result(decode)
    assert failure.value.status == 500
    _, decode = run(pair, "both")  # (the adapter both load alike still serves)
    assert pair.decode.result(decode).token_ids
