"""Print the import circles inside include/eventpush (none is the goal; exit 1 if any).

Run: .venv/bin/python scripts/import_circles.py [INCLUDE_DIR]
Uses grimp (import-linter's graph builder), so imports inside functions count too.
INCLUDE_DIR (default: this checkout's include/) is where the package is read from.
"""

import sys
from pathlib import Path

import grimp

PACKAGE = "eventpush"


INCLUDE = Path(__file__).resolve().parent.parent / "include"


def import_graph(include: Path = INCLUDE) -> grimp.ImportGraph:
    sys.path.insert(0, str(include))
    return grimp.build_graph(PACKAGE, cache_dir=None)


def circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted, largest first."""
    modules = sorted(graph.modules)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    # Tarjan's algorithm, iterative: the package's graph is deep enough to matter for recursion.
    for root in modules:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in graph.modules:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append(
                        (child, iter(sorted(graph.find_modules_directly_imported_by(child))))
                    )
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found, key=lambda c: (-len(c), c))


def main() -> int:
    found = circles(import_graph(Path(sys.argv[1]) if len(sys.argv) > 1 else INCLUDE))
    for component in found:
        print(f"circle of {len(component)}: " + ", ".join(component))
    if not found:
        print(f"no import circle in {PACKAGE}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
