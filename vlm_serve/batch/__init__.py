"""Batch captioning and answering over datasets on Ray Data: a CPU stage that preprocesses rows, engine
actors that answer them (`stages.py`), and the pipeline that joins them (`pipeline.py`)."""
