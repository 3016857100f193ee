"""Kinds found by name: the ones eventpush ships and the ones installed packages add.

Sources (``eventpush.sources``) and sinks (``eventpush.sinks``) are each a :class:`Registry`:
a name (a URL scheme) is served by a built-in, written as an entry-point value
(``module:attribute``, loaded on first use so a kind's libraries load only when a bus or a
target needs them), or by a plug-in, declared by any installed distribution in the
registry's entry-point group. A plug-in may not take a built-in's name, and two plug-ins may
not claim one name: either is refused, naming both values, rather than one winning by the
order packages happen to be found in.

The entry points are read once per process (:meth:`Registry.forget` reads them again).
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points


class PluginConflictError(RuntimeError):
    """Two installed packages claim one name, or a plug-in claims a built-in's."""


class Registry:
    """The kinds of one entry-point ``group``: ``builtin`` maps a name to its value."""

    def __init__(self, group: str, builtin: dict[str, str], noun: str) -> None:
        self.group = group
        self.builtin = builtin
        self.noun = noun  # what a name is, in refusals: "sink scheme", "source scheme"
        self._points: dict[str, EntryPoint] | None = None
        self._loaded: dict[str, object] = {}

    def points(self) -> dict[str, EntryPoint]:
        """Every name served here, with its entry point; PluginConflictError on a clash."""
        if self._points is None:
            found = {n: EntryPoint(n, v, self.group) for n, v in self.builtin.items()}
            claimed: dict[str, EntryPoint] = {}
            for ep in entry_points(group=self.group):
                name = ep.name.lower()
                # Checked first: eventpush's own distribution declares the built-ins too.
                if name in self.builtin and ep.value != self.builtin[name]:
                    raise PluginConflictError(
                        f"{self.noun} {name!r} is built in; a plug-in may not replace it "
                        f"with {ep.value}"
                    )
                other = claimed.get(name)
                if other is not None and other.value != ep.value:
                    raise PluginConflictError(
                        f"{self.noun} {name!r} is claimed twice ({other.value} and {ep.value}): "
                        f"uninstall one of the packages declaring it in entry points "
                        f"{self.group!r}"
                    )
                claimed[name] = ep
            self._points = {**found, **claimed}
        return self._points

    def names(self) -> list[str]:
        return sorted(self.points())

    def load(self, name: str) -> object | None:
        """What serves ``name`` (any case), loaded once; None when nothing does."""
        name = name.lower()
        if name in self._loaded:
            return self._loaded[name]
        ep = self.points().get(name)
        if ep is None:
            return None
        kind = self._loaded[name] = ep.load()
        return kind

    def forget(self) -> None:
        """Read the entry points again on next use (after packages were installed)."""
        self._points = None
        self._loaded.clear()
