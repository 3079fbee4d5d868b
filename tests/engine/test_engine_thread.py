"""`EngineThread`: an engine stepped by a thread of its own answers prompts submitted from any thread,
each as the engine alone does, and a prompt's error is its own."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from vlm_serve.engine import Engine
from vlm_serve.engine_thread import EngineThread
from vlm_serve.testing.media import make_image


def test_prompts_from_several_threads_get_the_answers_the_engine_gives_alone(tiny_moe_dir):
    with Engine(tiny_moe_dir, dtype="float32") as engine:
        prompts = [
            engine.processor.process_messages(
                [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "image": make_image(40 + i, 48, seed=i)},
                            {"type": "text", "text": "Describe."},
                        ],
                    }
                ]
            )
            for i in range(6)
        ]
        sampling = {"max_tokens": 5, "temperature": 0}
        alone = [engine.generate_processed([x], **sampling)[0].token_ids for x in prompts]
        thread = EngineThread(engine)
        with ThreadPoolExecutor(3) as callers:
            futures = list(callers.map(lambda x: thread.submit(x, **sampling), prompts))
        refused = thread.submit(prompts[0], max_tokens=5, temperature=-1)
        assert [f.result(timeout=60).token_ids for f in futures] == alone
        with pytest.raises(ValueError, match="temperature"):
            refused.result(timeout=60)
        assert thread.submit(prompts[1], **sampling).result(timeout=60).token_ids == alone[1]  # it goes on
        thread.close()
        assert engine.scheduler.is_idle()
