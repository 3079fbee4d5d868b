"""The GPU validation kit: one command that checks the CUDA path and measures it, on a lent GPU.

    python -m vlm_serve.tools.gpu_check OUT [--device cuda] [--parts suite,parity,server,figures]

Parts, in order of value, a module each (each writes its records under OUT and a line to OUT/summary.txt):
- `suite` (`suite.py`): the test files that run models (`SUITE`) under pytest on the device (`auto` picks CUDA
  there), with the attention backend `auto` picks (FlashInfer where installed). CUDA only: CI runs them on CPU.
- `parity` (`parity.py`): each attention backend the device has, in float32 and bfloat16 (where the backend runs
  it), against transformers in float32 on the CPU: the prefill logits of a prompt with a picture (float32
  within `FLOAT32_TOLERANCE` of the largest logit, bfloat16 about as close as transformers' own bfloat16
  is: `BFLOAT16_SLACK`) and greedy
  answers: 16 identical tokens of random tiny models in float32, and the built-in model's answers in
  bfloat16 (short, confident answers) identical to float32's.
- `server` (`server.py`): `vlm-serve serve` with the built-in model and one encoder rank (`--vit-dp 1`, on the
  GPU): pictures, a clip, a repeated picture and a streamed answer equal the in-process engine's on the CPU.
- `figures` (`figures.py`): on random models of real shapes (`large` preset, `load_format="dummy"`; `tiny` on
  CPU): decode tokens/s at batch 1/16/64/160 with the bytes a step reads as achieved bandwidth (and a share of
  the device's peak, `roofline`), TTFT of one 1024 x 1024 picture split into preprocessing, tower and
  prefill beside their FLOP bounds, and decode ITL p99 while such pictures arrive, with the encoder pool
  and with the tower inline.
  The parity part also checks that decode replayed from CUDA graphs gives the eager tokens.
- `profile` (`profiling.py`): torch's profiler over decode steps, per attention backend (where the time goes),
  and on CUDA as users run it, over 20 steps at batch 1 of the dense model and of the MoE (the kernels by
  device time), a picture's TTFT and 10 steps at batch 160: the device-busy share and the longest host gaps.

On CPU (`--device cpu`, what CI runs) every part but `suite` runs, at tiny sizes. `__main__.py` is the
command, `check.py` what a part records, `prompts.py` what the parts ask the engine.
"""
