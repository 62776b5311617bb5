"""Connected components, three ways that must agree.

``components_sql`` is the large-star / small-star loop (Kiveris et al., "Connected Components in
MapReduce and Beyond", SoCC 2014) written as joins, so the same plan runs in DuckDB here and on a
distributed SQL engine at scale; it needs a few rounds, not as many as the longest chain.
``components_uf`` is a plain union-find, the reference the tests compare against;
``components_array`` is what the build runs on one machine (scipy's, over numbered nodes).
Every node's label is the smallest node id of its component, so labels do not depend on order.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components


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


def components_sql(nodes: Iterable[str], edges: Iterable[tuple[str, str]], max_rounds: int = 64) -> dict[str, str]:
    node_list = sorted(set(nodes))
    edge_list = [(a, b) for a, b in edges if a != b]
    con = duckdb.connect()
    con.register("n", pa.table({"v": node_list}))
    con.register("e0", pa.table({"a": [a for a, _ in edge_list], "b": [b for _, b in edge_list]}))
    con.execute("CREATE TABLE e AS SELECT DISTINCT least(a, b) AS a, greatest(a, b) AS b FROM e0").fetchall()
    for _ in range(max_rounds):
        before = con.execute("SELECT count(*), coalesce(sum(hash(a, b)), 0) FROM e").fetchall()[0]
        # large star: connect every node to the smallest neighbour of its (closed) neighbourhood
        con.execute("""
            CREATE OR REPLACE TABLE e AS
            WITH sym AS (SELECT a AS u, b AS v FROM e UNION ALL SELECT b, a FROM e),
                 m AS (SELECT u, least(u, min(v)) AS m FROM sym GROUP BY u)
            SELECT DISTINCT least(s.v, m.m) AS a, greatest(s.v, m.m) AS b
            FROM sym s JOIN m USING (u) WHERE s.v > s.u AND s.v <> m.m""").fetchall()
        # small star: connect each node and its smaller neighbours to the smallest of them
        con.execute("""
            CREATE OR REPLACE TABLE e AS
            WITH sym AS (SELECT a AS u, b AS v FROM e UNION ALL SELECT b, a FROM e),
                 small AS (SELECT u, v FROM sym WHERE v <= u),
                 m AS (SELECT u, min(v) AS m FROM small GROUP BY u)
            SELECT DISTINCT least(x, m.m) AS a, greatest(x, m.m) AS b
            FROM (SELECT u, v AS x FROM small UNION SELECT u, u FROM small) s JOIN m USING (u)
            WHERE x <> m.m""").fetchall()
        after = con.execute("SELECT count(*), coalesce(sum(hash(a, b)), 0) FROM e").fetchall()[0]
        if after == before:
            break
    label = dict(con.execute("""
        WITH sym AS (SELECT a AS u, b AS v FROM e UNION ALL SELECT b, a FROM e)
        SELECT n.v, least(n.v, coalesce(min(s.v), n.v)) FROM n LEFT JOIN sym s ON s.u = n.v GROUP BY n.v""").fetchall())
    con.close()
    # after convergence every edge points a node at its component minimum (a star)
    return {v: label.get(v, v) for v in node_list}


def components_array(n: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Components of nodes ``0..n-1`` joined by the edges ``a[i]``-``b[i]``, each node labelled by
    the smallest node of its component (what ``components_uf`` gives, at C speed: the global
    curation steps number episodes by trajectory key, so the smallest number is the smallest key)."""
    if not len(a):
        return np.arange(n)
    graph = coo_matrix((np.ones(len(a), dtype=np.int8), (a, b)), shape=(n, n))
    _, comp = connected_components(graph, directed=False)
    smallest = np.full(comp.max() + 1, n, dtype=np.int64)
    np.minimum.at(smallest, comp, np.arange(n))
    return smallest[comp]
