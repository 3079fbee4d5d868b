"""The vision encoder as the scheduler sees it: the tower in the scheduler's process (`encoder.py`, which also
runs the tower in bounded passes) or a pool of data-parallel encoder processes (`pool.py`), each with the
content-hash embedding cache's results handed back by item."""
