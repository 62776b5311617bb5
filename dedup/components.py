"""Connected components, the references the build's relational plan must agree with.

The build runs the large-star / small-star loop as SQL on an engine (``dedup.engines``: DuckDB
or Daft). ``components_uf`` is a plain union-find over named nodes; ``components_array`` is
scipy's over numbered nodes (used where a result on one machine is enough). Every node's label
is the smallest node of its component, so labels do not depend on order.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np


def find_root(parent: Any, x: Any) -> Any:
    """The root of ``x`` in a union-find forest (``parent``: a dict or a list), compressing the path."""
    root = x
    while parent[root] != root:
        root = parent[root]
    while parent[x] != root:
        parent[x], x = root, parent[x]
    return root


def components_uf(nodes: Iterable[str], edges: Iterable[tuple[str, str]]) -> dict[str, str]:
    parent: dict[str, str] = {n: n for n in nodes}

    def find(x: str) -> str:
        return find_root(parent, x)

    for a, b in edges:
        parent.setdefault(a, a)
        parent.setdefault(b, b)
        ra, rb = find(a), find(b)
        if ra != rb:
            if rb < ra:
                ra, rb = rb, ra
            parent[rb] = ra
    return {n: find(n) for n in parent}


def components_array(n: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Components of nodes ``0..n-1`` joined by the edges ``a[i]``-``b[i]``, each node labelled by
    the smallest node of its component (what ``components_uf`` gives, at C speed: the global
    curation steps number episodes by trajectory key, so the smallest number is the smallest key)."""
    if not len(a):
        return np.arange(n)
    # imported here: scipy.sparse takes 0.17 s to import, which every command paid
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    graph = coo_matrix((np.ones(len(a), dtype=np.int8), (a, b)), shape=(n, n))
    _, comp = connected_components(graph, directed=False)
    smallest = np.full(comp.max() + 1, n, dtype=np.int64)
    np.minimum.at(smallest, comp, np.arange(n))
    return smallest[comp]
