"""libcurl's multi interface driven by the running asyncio event loop (pycurl underneath).

HTTP targets are sent through libcurl: every request's I/O, HTTP parsing, TLS and timeout
run in libcurl's C code on the event loop's own thread, woken by the loop's readiness
callbacks for the sockets libcurl asks to watch. Nothing crosses a thread: a client whose I/O
ran on a thread of its own (pyreqwest's tokio) had to take the GIL back from a busy event
loop for every answer, and lost a third of its rate once the loop had the engine's work to
do (docs/BENCHMARKS.md, issue 34).

:class:`Transfers` is the glue: libcurl tells it which sockets to watch and when its next
timeout is due (``M_SOCKETFUNCTION``, ``M_TIMERFUNCTION``); the loop calls back into
``socket_action`` when one is ready or the timer fires; finished transfers resolve the
future :meth:`Transfers.start` returned with ``(curl error code, message)`` (0 when the
transfer completed). A Transfers belongs to one event loop and is made on first use there.
"""

from __future__ import annotations

import asyncio

import pycurl

# libcurl's codes this module names (pycurl.E_* holds them all).
E_OK = 0


class Transfers:
    """The transfers of one session on one event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, per_host: int = 0) -> None:
        self.loop = loop
        self.multi = pycurl.CurlMulti()
        self.multi.setopt(pycurl.M_SOCKETFUNCTION, self._watch)
        self.multi.setopt(pycurl.M_TIMERFUNCTION, self._schedule)
        if per_host:
            self.multi.setopt(pycurl.M_MAX_HOST_CONNECTIONS, per_host)
        self._watched: dict[int, int] = {}  # fd -> what the loop watches (pycurl.POLL_*)
        self._timer: asyncio.TimerHandle | None = None
        self._running: dict[pycurl.Curl, asyncio.Future] = {}
        self.closed = False

    def start(self, handle: pycurl.Curl) -> asyncio.Future:
        """Start ``handle``'s transfer; the future gives ``(code, message)`` when it ends.
        A caller that stops waiting (cancelled) calls :meth:`abandon`."""
        future = self.loop.create_future()
        self._running[handle] = future
        self.multi.add_handle(handle)  # libcurl asks for a timeout of 0: started on the loop
        return future

    def abandon(self, handle: pycurl.Curl) -> None:
        """Stop a transfer nobody waits for any more (its connection is closed by libcurl)."""
        if self._running.pop(handle, None) is not None and not self.closed:
            self.multi.remove_handle(handle)

    def close(self) -> None:
        """Every transfer stopped, every connection closed, nothing left on the loop."""
        if self.closed:
            return
        self.closed = True
        for handle, future in list(self._running.items()):
            self.multi.remove_handle(handle)
            if not future.done():
                future.cancel()
        self._running.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.multi.close()  # closes the cached connections
        for fd in list(self._watched):
            self._unwatch(fd)

    # --- what libcurl asks of the loop -----------------------------------------------------

    def _watch(self, what: int, fd: int, multi, socket_data) -> None:
        """``M_SOCKETFUNCTION``: watch ``fd`` for reading, writing, both, or no more. libcurl
        says REMOVE before it closes a socket (and gives no other word of the close), so a
        socket it stops watching stops being watched at once: a number reused by a new
        socket is never left registered for the old one."""
        loop, watched = self.loop, self._watched.get(fd, 0)
        if what == pycurl.POLL_REMOVE:
            self._unwatch(fd)
            return
        if self.closed:
            return
        if what & pycurl.POLL_IN:
            if not watched & pycurl.POLL_IN:
                loop.add_reader(fd, self._ready, fd, pycurl.CSELECT_IN)
        elif watched & pycurl.POLL_IN:
            loop.remove_reader(fd)
        if what & pycurl.POLL_OUT:
            if not watched & pycurl.POLL_OUT:
                loop.add_writer(fd, self._ready, fd, pycurl.CSELECT_OUT)
        elif watched & pycurl.POLL_OUT:
            loop.remove_writer(fd)
        self._watched[fd] = what

    def _unwatch(self, fd: int) -> None:
        was = self._watched.pop(fd, 0)
        if was and not self.loop.is_closed():
            if was & pycurl.POLL_IN:
                self.loop.remove_reader(fd)
            if was & pycurl.POLL_OUT:
                self.loop.remove_writer(fd)

    def _schedule(self, ms: int) -> None:
        """``M_TIMERFUNCTION``: call libcurl back in ``ms`` (-1: no timeout due)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if ms >= 0 and not self.closed:
            self._timer = self.loop.call_later(ms / 1000, self._timed_out)

    # --- the loop calling libcurl ---------------------------------------------------------

    def _ready(self, fd: int, event: int) -> None:
        if self.closed:
            return
        self.multi.socket_action(fd, event)
        self._finished()

    def _timed_out(self) -> None:
        self._timer = None
        if self.closed:
            return
        self.multi.socket_action(pycurl.SOCKET_TIMEOUT, 0)
        self._finished()
        # The loop's clock and libcurl's may disagree by a fraction of a millisecond: a timer
        # that fired early leaves libcurl nothing due and no new timer asked for. Ask again.
        if self._timer is None and self._running:
            due = self.multi.timeout()
            if due >= 0:
                self._schedule(due)

    def _finished(self) -> None:
        """Resolve the futures of the transfers libcurl has finished."""
        running, multi = self._running, self.multi
        while True:
            queued, ok, failed = multi.info_read()
            for handle in ok:
                multi.remove_handle(handle)
                future = running.pop(handle, None)
                if future is not None and not future.done():
                    future.set_result((E_OK, None))
            for handle, code, message in failed:
                multi.remove_handle(handle)
                future = running.pop(handle, None)
                if future is not None and not future.done():
                    future.set_result((code, message))
            if not queued:
                return
