"""Start-up without the cyclic garbage collector.

Importing torch, Lightning Fabric, Hydra and this package creates a few hundred thousand objects, and
CPython's collector runs over all of them again and again while they are being made: about 1 s of the 3.9 s a
cold ``python train.py`` spends importing (measured on a 2-core machine, docs/performance/test_suite.md).
Nothing an import makes is garbage worth collecting. ``uncollected_imports`` turns the collector off for the
imports, then freezes what they made (``gc.freeze``: the objects move to a permanent generation that later
collections do not walk) and turns it back on. A process forked afterwards (a rank from its fork server)
inherits the frozen generation, so its collections walk only what it makes itself, and it does not write to
the inherited pages just to walk them.
"""

from __future__ import annotations

import contextlib
import gc
import sys


@contextlib.contextmanager
def uncollected_imports():
    """``with uncollected_imports(): import ...`` -- no collection during the block; if it imported a module,
    what exists at its end is frozen (never collected, never walked again); collection resumes as before. A
    block whose modules were all imported already (a second ``check_overrides`` in one process) freezes
    nothing: the garbage of the moment is not kept for good."""
    was_enabled = gc.isenabled()
    modules = len(sys.modules)
    gc.disable()
    try:
        yield
    finally:
        if len(sys.modules) > modules:
            gc.freeze()
        if was_enabled:
            gc.enable()
