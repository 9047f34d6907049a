"""Host work done in the shadow of a device wait.

A stage process is one thread: while it blocks on the GPU (the talker waits about 9 ms a frame
for its code predictor), its inbox fills with the thinker's chunks, which it then handles one
by one before the next step can launch (5 ms a frame at concurrency 8). `wait_for` lets that
work run while the device computes:

    worker:  with idle_work(handle_one_chunk):      # registered around engine.step()
                 engine.step()
    model:   ready = torch.cuda.Event(); ready.record()
             wait_for(ready)                        # runs handle_one_chunk until the device
             codes.cpu()                            #   is done or the work runs out

The work runs one unit at a time and stops as soon as the device is done, so the wait it fills
is never made longer by more than one unit. Only the code that calls `wait_for` decides where
this may happen (a point where the engine's state is not being changed), and only the caller
of `idle_work` decides what runs (what is safe then). Per thread: the inproc backend runs each
stage in a thread of one process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

_local = threading.local()


@contextmanager
def idle_work(work: Callable[[], bool]) -> Iterator[None]:
    """Within the block, `wait_for` calls `work()` while the device is busy; `work` does one
    unit and returns False when there is nothing (more) it may do now."""
    previous = getattr(_local, "work", None)
    _local.work = work
    try:
        yield
    finally:
        _local.work = previous


def wait_for(event: torch.cuda.Event) -> int:
    """Run the thread's idle work until `event` has completed or the work says stop; returns
    the number of units done. Does not itself wait for the event."""
    work = getattr(_local, "work", None)
    done = 0
    while work is not None and not event.query():
        if not work():
            break
        done += 1
    return done


def record_and_wait(device: torch.device) -> int:
    """`wait_for` the work queued so far on `device`'s current stream (CUDA only; elsewhere
    there is nothing to overlap)."""
    if device.type != "cuda" or getattr(_local, "work", None) is None:
        return 0
    event = torch.cuda.Event()
    event.record()
    return wait_for(event)
