"""libcurl's multi interface driven by the running asyncio event loop (pycurl underneath).

HTTP targets are sent through libcurl: every request's I/O, HTTP parsing, TLS and timeout
run in libcurl's C code on the event loop's own thread, woken when a socket libcurl waits on
is ready. Nothing crosses a thread: a client whose I/O ran on a thread of its own
(pyreqwest's tokio) had to take the GIL back from a busy event loop for every answer, and
lost a third of its rate once the loop had the engine's work to do (docs/BENCHMARKS.md,
issue 34).

:class:`Transfers` is the glue: libcurl tells it which sockets to watch and when its next
timeout is due (``M_SOCKETFUNCTION``, ``M_TIMERFUNCTION``); the sockets are watched by an
epoll set of the Transfers' own, which the loop watches as one reader, so one wake-up serves
every socket that is ready; libcurl is called back (``socket_action``) for each ready socket
it waits on and when the timer fires; finished transfers resolve the future
:meth:`Transfers.start` returned with ``(curl error code, message)`` (0 when the transfer
completed). A Transfers belongs to one event loop and is made on first use there.

Why a set of our own: libcurl stops watching a kept-alive connection after every answer and
asks again with the next request on it. On the loop's own watchers each of those was a
watcher made and dropped and two ``epoll_ctl`` calls; here an idle connection stays in the
set, taking it up again for the events the set already watches it for costs no system
call (any other events: one ``epoll_ctl``, ``MOD``), and an idle socket that stirs (its
server closed it) leaves the set then (docs/BENCHMARKS.md, issue 34). A socket libcurl closes
leaves the set with its last descriptor (the kernel's rule; the duplicate pycurl is handed is
closed on the loop's next turn, see ``eventpush.sinks.http``), and a new socket that reuses a
number is never taken for the old one: what the set watches is forgotten, by number, each
time libcurl opens a socket (:func:`socket_opened`: only then can a number name another
socket), and the ``MOD`` then fails with ENOENT for a socket the set does not hold, and it is
registered. That holds because every socket libcurl asks us to watch is one it opened through
``OPENSOCKETFUNCTION``: the session resolves names itself and hands libcurl addresses
(``CONNECT_TO``), so libcurl's own resolver, whose sockets would open unseen, never runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
from threading import get_ident

import pycurl

# libcurl's codes this module names (pycurl.E_* holds them all).
E_OK = 0

_EVENTS = {  # what libcurl waits for -> what the epoll set watches
    pycurl.POLL_IN: select.EPOLLIN,
    pycurl.POLL_OUT: select.EPOLLOUT,
    pycurl.POLL_INOUT: select.EPOLLIN | select.EPOLLOUT,
}
_READABLE = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR
_WRITABLE = select.EPOLLOUT | select.EPOLLERR
_opened = [0]  # sockets libcurl has opened in this process (see socket_opened)


def socket_opened() -> None:
    """Called for every socket libcurl opens (``OPENSOCKETFUNCTION``): a new socket may have
    the number of one that closed, so what any set knows it watches by number is forgotten."""
    _opened[0] += 1


class Transfers:
    """The transfers of one session on one event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, per_host: int = 0) -> None:
        self.loop = loop
        self.thread = get_ident()  # the loop's thread
        self.multi = pycurl.CurlMulti()
        self.multi.setopt(pycurl.M_SOCKETFUNCTION, self._watch)
        self.multi.setopt(pycurl.M_TIMERFUNCTION, self._schedule)
        if per_host:
            self.multi.setopt(pycurl.M_MAX_HOST_CONNECTIONS, per_host)
        self._sockets = select.epoll()
        self._wanted: dict[int, int] = {}  # fd -> the epoll events libcurl waits for
        self._watched: dict[int, int] = {}  # fd -> the events the set watches it for
        self._opened = _opened[0]  # the sockets opened when _watched was last known right
        self._timer: asyncio.TimerHandle | None = None
        self._due = 0.0  # when the timer fires (the loop's clock)
        self._running: dict[pycurl.Curl, asyncio.Future] = {}
        self.closed = False
        loop.add_reader(self._sockets.fileno(), self._ready)

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
        if not self.loop.is_closed():
            self.loop.remove_reader(self._sockets.fileno())
        self._sockets.close()
        self._wanted.clear()
        self._watched.clear()

    # --- what libcurl asks of the loop -----------------------------------------------------

    def _watch(self, what: int, fd: int, multi, socket_data) -> None:
        """``M_SOCKETFUNCTION``: watch ``fd`` for reading, writing, both, or no more. A socket
        libcurl no longer waits on stays in the set (see the module's docstring)."""
        if what == pycurl.POLL_REMOVE:
            self._wanted.pop(fd, None)
            return
        if self.closed:
            return
        events = _EVENTS[what]
        self._wanted[fd] = events
        if self._opened != _opened[0]:  # a socket opened since: any number may be a new one
            self._opened = _opened[0]
            self._watched.clear()
        elif self._watched.get(fd) == events:  # a kept-alive connection taken up again
            return
        try:  # in the set already, unless new (a new socket on a closed one's number too)
            self._sockets.modify(fd, events)
        except FileNotFoundError:
            self._sockets.register(fd, events)
        self._watched[fd] = events

    def _schedule(self, ms: int) -> None:
        """``M_TIMERFUNCTION``: call libcurl back in ``ms`` (-1: no timeout due). A timer
        that fires sooner is kept: libcurl moves its next timeout on with nearly every answer
        (the oldest transfer's deadline), and a timer made and dropped each time cost more
        than the early call, after which :meth:`_timed_out` asks libcurl again."""
        timer = self._timer
        if ms < 0 or self.closed:
            if timer is not None:
                timer.cancel()
                self._timer = None
            return
        due = self.loop.time() + ms / 1000
        if timer is not None:
            if self._due <= due:
                return
            timer.cancel()
        self._due = due
        self._timer = self.loop.call_at(due, self._timed_out)

    # --- the loop calling libcurl ---------------------------------------------------------

    def _ready(self) -> None:
        """The set is readable: libcurl is called for each ready socket it waits on. An idle
        socket that stirred leaves the set: libcurl finds its connection closed when it next
        takes it up, and opens another."""
        if self.closed:
            return
        multi, wanted = self.multi, self._wanted
        for fd, events in self._sockets.poll(0):
            waits = wanted.get(fd)
            if waits is None:
                self._release(fd)
                continue
            what = 0
            if events & _READABLE and waits & select.EPOLLIN:
                what |= pycurl.CSELECT_IN
            if events & _WRITABLE and waits & select.EPOLLOUT:
                what |= pycurl.CSELECT_OUT
            if events & select.EPOLLERR:
                what |= pycurl.CSELECT_ERR
            multi.socket_action(fd, what)
        self._finished()

    def _release(self, fd: int) -> None:
        self._watched.pop(fd, None)
        # OSError: closed, or the number now names a socket the set does not hold
        with contextlib.suppress(OSError):
            self._sockets.unregister(fd)

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
