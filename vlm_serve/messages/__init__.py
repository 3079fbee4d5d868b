"""The typed messages between the server's processes, a layer of their own that server/, llm/ and the
in-process `Engine` all import (none of them imports the others for these). In the server they cross
processes over ZMQ (`vlm_serve.ipc`: pixel tensors inside a `TokenizedGenerateReq` travel as shared
memory); in `Engine` they are handed over in queues. `backend`: to and from the scheduler; `frontend`:
what a front end receives and gets back as text."""
