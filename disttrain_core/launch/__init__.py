"""The front door: ``launch(cfg)`` runs one composed config (train.py calls it).

entry.py validates and resolves the run and starts this node's ranks (launchers.py, fabric.py); worker.py is
what each rank runs; cluster.py renders SLURM jobs; cli.py checks a command line before Hydra composes it;
producer.py is the standalone data producer (``python -m disttrain_core.launch.producer``)."""


def launch(cfg):
    """Validate, prepare and run one training job; returns the optimized metric (launch/entry.py)."""
    from .entry import launch as run

    return run(cfg)
