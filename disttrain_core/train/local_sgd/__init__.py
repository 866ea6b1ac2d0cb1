"""Local SGD (``parallel.mode=local_sgd``, docs/LOCAL_SGD.md): the engine (engine.py), how a worker's
processes hold its state (shards.py), the outer step (sync.py), EDiT's penalty (penalty.py) and A-EDiT's
timed syncs (clock.py)."""
