"""`EngineThread`: an engine stepped by a thread of its own answers prompts submitted (or streamed) from any
thread, each as the engine alone does; a prompt's error is its own, and a stream closed early is aborted."""

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


def test_streams_from_several_threads_give_the_answers_and_one_closed_early_is_aborted(tiny_moe_dir):
    with Engine(tiny_moe_dir, dtype="float32") as engine:
        prompts = [
            engine.processor.process_messages([{"role": "user", "content": f"Tell me about the number {i}."}])
            for i in range(4)
        ]
        sampling = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
        alone = [engine.generate_processed([x], **sampling)[0] for x in prompts]
        thread = EngineThread(engine)

        def whole(x) -> tuple[str, list[int], object]:
            chunks = list(thread.stream(x, **sampling))
            return "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids], chunks[-1].output

        with ThreadPoolExecutor(3) as callers:
            streamed = list(callers.map(whole, prompts))
        for (text, ids, output), expected in zip(streamed, alone):
            assert (text, ids) == (expected.text, expected.token_ids)
            assert output.token_ids == ids and output.prompt_tokens == expected.prompt_tokens  # (its usage)
        stream = thread.stream(prompts[0], max_tokens=1000, temperature=0, ignore_eos=True)
        next(stream)
        stream.close()  # (the request is aborted: the thread goes idle well before 1000 tokens)
        with pytest.raises(ValueError, match="temperature"):
            list(thread.stream(prompts[0], max_tokens=5, temperature=-1))
        thread.close()
        assert engine.scheduler.is_idle() and not engine.scheduler.reqs
        assert engine.scheduler.metrics.generated_tokens < 1000  # (the stream closed early did not run on)
        engine.scheduler.check_memory()
