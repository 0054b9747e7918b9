"""Counting the expert compute backends' calls (a deterministic proxy for grouped compute)."""


def count_backends(monkeypatch) -> dict:
    """Record the expert compute backends' calls: ``grouped`` (experts per grouped GEMM), ``looped``
    (experts per ``_loop`` call of two or more experts: a group computed one mm per expert)."""
    import operators.expert_compute as ec

    seen = {"grouped": [], "looped": []}
    grouped, loop = ec._grouped, ec._loop
    monkeypatch.setattr(ec, "_grouped", lambda m, views, ids, *a: seen["grouped"].append(len(ids)) or
                        grouped(m, views, ids, *a))
    monkeypatch.setattr(ec, "_loop", lambda m, weights, *a: (len(weights) > 1 and seen["looped"].append(len(weights)))
                        or loop(m, weights, *a))
    return seen
