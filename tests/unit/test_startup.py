"""base/startup.py: imports run without the garbage collector and end frozen."""

import gc
import subprocess
import sys

from ..conftest import REPO


def test_a_block_that_imports_runs_uncollected_and_what_exists_after_it_is_frozen():
    from disttrain_core.base.startup import uncollected_imports

    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    sys.modules.pop("colorsys", None)
    with uncollected_imports():
        assert not gc.isenabled()
        import colorsys  # noqa: F401  (a small stdlib module, imported afresh)

        made = [[index] for index in range(2_000)]  # 2,001 objects the collector tracks
    assert gc.isenabled()
    assert gc.get_freeze_count() >= frozen + len(made)


def test_a_block_that_imports_nothing_new_freezes_nothing():
    from disttrain_core.base.startup import uncollected_imports

    frozen = gc.get_freeze_count()
    with uncollected_imports():
        import json  # noqa: F401  (imported already)

        made = [[index] for index in range(2_000)]
    # Frozen objects can die meanwhile (a pytest-xdist worker's threads: a make test run saw 2 fewer), so the count
    # may fall; freezing the block's 2,000 lists would raise it by at least that many.
    assert gc.get_freeze_count() <= frozen and len(made) == 2_000


def test_a_collector_turned_off_before_stays_off():
    from disttrain_core.base.startup import uncollected_imports

    gc.disable()
    try:
        with uncollected_imports():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_launchers_fork_server_hands_its_ranks_frozen_imports():
    """What rank_preload imported (torch, Fabric, the package) is frozen and the collector is on again: a rank
    forked from it walks only what it makes itself."""
    program = (
        "import gc, disttrain_core.launch.rank_preload, torch; "
        "print(gc.isenabled(), gc.get_freeze_count(), len(gc.get_objects()))"
    )
    out = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=120)
    enabled, frozen, tracked = out.stdout.split()
    assert enabled == "True"
    assert int(frozen) > 10 * int(tracked), (frozen, tracked)
