"""Communication that overlaps computation: bucketed gradient/parameter collectives (engine.py) and
chunked tensor-parallel matmuls (tp_overlap.py)."""
