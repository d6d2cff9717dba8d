"""Where a slow step's host time went, without a profiler: the training thread's Python stack,
sampled on a daemon thread, and the garbage collector's pauses, both per step.

A profiler's trace covers a few chosen steps, and a slow step that comes once per run (a
window close that takes half a second) is seldom among them. Sampling every
``interval`` seconds costs the training thread the GIL for a few microseconds per sample (well
under 1 % at 10 ms); the collector's pauses are timed through ``gc.callbacks``.
"""

import collections
import gc
import sys
import threading
import time
from pathlib import Path


class StepSamples:
    """Samples one thread's Python stack while a step is open (``begin``/``end``) and times
    the collector's pauses in it; owns each ended step's samples (``frames``) and pause time
    (``gc_s``)."""

    def __init__(self, thread_id: int | None = None, interval: float = 0.01, roots=("zenflow",)):
        self.thread_id = threading.get_ident() if thread_id is None else thread_id
        self.interval = interval
        self._roots = tuple(f"/{root}/" for root in roots)
        self._counts: collections.Counter | None = None
        self._gc_started: float | None = None
        self._gc_s = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="step-samples", daemon=True)
        self._thread.start()
        gc.callbacks.append(self._on_gc)

    def begin(self) -> None:
        with self._lock:
            self._counts = collections.Counter()
            self._gc_s = 0.0

    def end(self) -> dict:
        """The step's samples: ``frames`` (the most sampled places, most first, as "file:line
        function" of the innermost frame under one of the roots, then of the innermost frame
        if that is elsewhere, with its count), ``samples`` and ``gc_s``."""
        with self._lock:
            counts, self._counts = self._counts, None
            gc_s = self._gc_s
        counts = counts or collections.Counter()
        return {
            "samples": sum(counts.values()),
            "frames": counts.most_common(4),
            "gc_s": gc_s,
        }

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if threading.get_ident() != self.thread_id:
            return
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            self._gc_s += time.perf_counter() - self._gc_started
            self._gc_started = None

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(self.thread_id)
            if frame is None or self._counts is None:
                continue
            place = self._place(frame)
            with self._lock:
                if self._counts is not None:
                    self._counts[place] += 1

    def _place(self, frame) -> str:
        innermost = _where(frame)
        while frame is not None:
            if any(root in frame.f_code.co_filename for root in self._roots):
                ours = _where(frame)
                return ours if ours == innermost else f"{ours} > {innermost}"
            frame = frame.f_back
        return innermost


def _where(frame) -> str:
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {frame.f_code.co_name}"
