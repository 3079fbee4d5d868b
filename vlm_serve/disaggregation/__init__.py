"""Prefill/decode disaggregation: the same server in `--disaggregation-mode prefill` or `decode`, behind
sglang-router's PD mode, which sends each request to one prefill and one decode server with the same
bootstrap room.

- The prefill server runs the encoder pool, the embedding cache, the RadixCache and the prompt; its
  bootstrap server (`bootstrap.py`) tells decode ranks where its ranks are.
- Its scheduler holds a request in the bootstrap queue until the decode side has said where the KV goes
  (`scheduler/pd_prefill.py`), sends the KV page by page as chunks are computed, then the metadata record
  with the first token, and keeps the request in the inflight queue until the transfer has succeeded.
- The decode server pre-allocates the KV (prealloc queue), waits for the transfer (transfer queue), then
  decodes without a prefill forward (`scheduler/pd_decode.py`). It never runs the vision tower.
- The bytes move through a transfer backend (`transfer.py`): Mooncake's transfer engine (`mooncake.py`),
  or a fake one for tests (`fake.py`).

This folder is the KV transport (the queues that use it are the scheduler's).
"""
