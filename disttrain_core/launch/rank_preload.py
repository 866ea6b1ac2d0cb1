"""Imported once, by the fork server that starts a job's ranks (``trainer.start_method=forkserver``).

Each rank is then a fork of a process that has already imported torch, Lightning Fabric and this
package: about 3-4 s of imports per rank on a CPU core (1.9 s torch, 0.7 s DTensor, 0.7 s dynamo via
Fabric), paid once per launcher process instead of once per rank -- and once per test session for
jobs a test starts in-process. Nothing here starts a thread or touches CUDA: forking stays safe.

The fork server ignores SIGTERM: a scheduler signals every process of a job step, and the ranks'
exit codes reach the launcher through the server, so it must outlive the ranks' orderly stop.
(It still exits as soon as its launcher does.) Ranks restore the default at once (launch/launchers.py).
"""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)

from disttrain_core.base.startup import uncollected_imports  # noqa: E402

# The imports run without the garbage collector and end frozen (base/startup.py): each rank forked from here
# inherits them as a permanent generation its own collections never walk.
with uncollected_imports():
    import lightning_fabric  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    import torch.utils.tensorboard  # noqa: F401  the default tracker's writer: 0.2-0.4 s rank 0 paid after start

    from disttrain_core.config import register_configs
    from disttrain_core.launch import entry as launch  # noqa: F401
    from disttrain_core.train import loop  # noqa: F401

    # Each rank runs train.py again as ``__mp_main__`` (multiprocessing's start methods re-import the main
    # module), whose first act is ``register_configs()``: about 0.7 s of a core storing the schema and reading
    # every recipe. Done here once, the ranks' call finds it done.
    register_configs()
