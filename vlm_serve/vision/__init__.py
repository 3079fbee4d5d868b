"""The vision encoder as the scheduler sees it: the tower in the scheduler's process (`encoder.py`) or a
pool of data-parallel encoder processes (`pool.py`), each with the content-hash embedding cache's results
handed back by item."""
