"""Start-up without the cyclic garbage collector, for the processes that import torch and transformers.

A floor module: stdlib only. Importing torch and transformers and loading a model allocate about 600,000
objects that live as long as the process, and the collector, run every 700 allocations, scans that
growing heap again and again while they load: about a fifth of a CPU engine's or a trainer's CPU to
ready (bench/startup.py measures it). `loading()` holds the collector off from a process's first heavy
import until its model is loaded; `loaded()` then moves every object into the permanent generation
(`gc.freeze`: no later collection, on the serving or training path, scans the libraries' objects again)
and turns the collector back on. The daemon does the same around its own imports: a full collection
of its modules' ~57,000 objects held its event loop ~37 ms. The little garbage the imports left in
cycles is frozen with the rest rather than collected: that one collection would cost ~0.45 CPU-s,
the garbage under 1 MiB of RSS.
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def loading() -> None:
    """First thing in the process, before it imports torch."""
    gc.disable()


def loaded() -> None:
    """Once the model is loaded, before the process serves or trains."""
    gc.freeze()
    gc.enable()


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """The collector off for a one-off job of the same kind, such as the default model's conversion (GGUF
    parsing allocates a few million objects: 25.6 CPU-s with the collector on, 19.3 off, the same peak RSS);
    its previous state after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
