"""A Gradio chat page: images and short videos, streamed answers, for several people at once.

The page (`page`) talks to a `ChatBackend` (`chat`): the in-process `Engine` stepped by a thread of its own
(`LocalChat`), whose scheduler batches every session's answers together, or a running `vlm-serve serve` (or a
router over many) through its OpenAI API (`RemoteChat`). `turns` makes the page's conversation the messages a
backend is sent. `run_demo(backend)` serves the page until stopped, `launch_demo` serves it and returns,
`build_demo(backend)` returns the `gr.Blocks` without launching. A model trained on single questions only (the
built-in one) is sent each question alone (`latest_question`). Gradio is imported on first use, so importing
these modules stays cheap.
"""
