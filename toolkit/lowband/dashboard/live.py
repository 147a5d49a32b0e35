"""The dashboard's polling: read what is new in the runs off the kernel's thread and redraw, at
most every `interval` seconds, until stop() or every run is over."""

from __future__ import annotations

import asyncio
import threading
import time

# polling and redrawing take at most this share of one core: after a cycle that used c seconds
# of CPU, the next starts at least c * (1 / BUSY_SHARE - 1) later (benchmarks/dashboard_load.py)
BUSY_SHARE = 0.15


def running_loop():
    """The asyncio loop running in this thread (a kernel's), or None."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


def _pause(cpu_s: float) -> float:
    return cpu_s * (1 / BUSY_SHARE - 1)


class Polling:
    """Dashboard's live updates (a mixin: reads models and _ended; calls _check_handles,
    _render and _update_title)."""

    def _setup_polling(self, interval: float) -> None:
        self.interval = interval
        self._lock = threading.RLock()      # one poll or draw at a time
        self._stop = threading.Event()
        self._task: asyncio.Task | None = None
        self._thread: threading.Thread | None = None

    def _poll(self) -> int:
        with self._lock:
            # the handles first: a run seen ending here is then read to its last event
            ended = self._check_handles()
            new = 0
            for k, m in enumerate(self.models):
                seen = m.events_seen
                if k in ended:
                    m.load()    # no summary.json will come: close the steps still pending
                else:
                    m.poll()
                new += m.events_seen - seen
            return new

    def refresh(self) -> int:
        """Read what is new in every run and redraw (synchronously). Returns how many events
        were new."""
        new = self._poll()
        self._render()
        return new

    @property
    def live(self) -> bool:
        return ((self._task is not None and not self._task.done())
                or (self._thread is not None and self._thread.is_alive()))

    def start(self):
        """Poll and redraw every `interval` seconds until stop() or every run is over (see the
        Dashboard docstring): as an asyncio task when an event loop runs in this thread (a
        kernel), else in a thread."""
        if self.live:
            return self
        self._stop.clear()
        loop = running_loop()
        if loop is not None:
            self._task = loop.create_task(self._run_async())
        else:
            self._thread = threading.Thread(target=self._run_thread, daemon=True,
                                            name="lowband-dashboard")
            self._thread.start()
        self._update_title()
        return self

    def stop(self):
        """Stop polling (the figures keep what they show; start() resumes)."""
        self._stop.set()
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._task = self._thread = None
        self._update_title()
        return self

    def _done(self) -> bool:
        """Every run is over: it has its summary.json, or its handle said failed or cancelled."""
        return all(m.finished or k in self._ended for k, m in enumerate(self.models))

    async def _run_async(self) -> None:
        try:
            while not self._stop.is_set():
                began = time.process_time()
                new = await asyncio.to_thread(self._poll)
                self._render(force=bool(new))
                if self._done():
                    break
                await asyncio.sleep(max(self.interval, _pause(time.process_time() - began)))
        except asyncio.CancelledError:
            pass
        finally:
            self._task = None
            self._update_title()

    def _run_thread(self) -> None:
        try:
            while not self._stop.is_set():
                began = time.process_time()
                new = self._poll()
                self._render(force=bool(new))
                if self._done():
                    break
                self._stop.wait(max(self.interval, _pause(time.process_time() - began)))
        finally:
            self._update_title(live=False)    # this thread is still alive: not self.live
