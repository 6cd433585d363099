"""Whether two strided views share memory, exactly.

A view is a base address, a shape, byte strides and an itemsize: element i covers the bytes
[base + sum_k i_k s_k, base + sum_k i_k s_k + itemsize). Two views share memory when some byte
lies in both. The byte intervals the views span decide most pairs; where they overlap, the
exact answer is whether a bounded linear Diophantine equation has a solution:

    sum_k c_k x_k = target,   0 <= x_k <= n_k,   c_k > 0

(every stride of either view becomes one term, the two itemsizes one more; see ``_problem``).
It is solved by depth-first search over the variable with the fewest feasible values, stepping
only through values the other coefficients' gcd allows, with the two-variable case closed by
the extended Euclidean algorithm: the method of numpy's ``solve_may_share_memory``, without its
work limit.
"""

from __future__ import annotations

from math import gcd


def views_overlap(a, b) -> bool:
    """Whether views ``a`` and ``b`` (each with ``ptr``, ``shape``, ``byte_strides`` and
    ``itemsize``) share a byte."""
    if 0 in a.shape or 0 in b.shape:
        return False
    alo, ahi = byte_span(a)
    blo, bhi = byte_span(b)
    if ahi < blo or bhi < alo:
        return False
    terms, target = _problem(a, b)
    return _solvable(terms, target)


def byte_span(v) -> tuple[int, int]:
    """[first, last] byte address of a non-empty view."""
    lo = v.ptr + sum(s * (n - 1) for s, n in zip(v.byte_strides, v.shape) if s < 0)
    hi = v.ptr + sum(s * (n - 1) for s, n in zip(v.byte_strides, v.shape) if s > 0)
    return lo, hi + v.itemsize - 1


def _problem(a, b) -> tuple[list[tuple[int, int]], int]:
    """The equation whose solutions are the shared bytes: a byte of ``a`` is
    a.ptr + sum i_k s_k + u (0 <= u < a.itemsize), one of ``b`` is b.ptr + sum j_k t_k + v;
    they meet when sum i_k s_k - sum j_k t_k + u - v = b.ptr - a.ptr. Each negative coefficient
    is made positive by counting its index from the other end (i = n - 1 - i'), which moves a
    constant into the target."""
    terms, target = [], b.ptr - a.ptr
    for sign, view in ((1, a), (-1, b)):
        for s, n in zip(view.byte_strides, view.shape):
            c = sign * s
            if n > 1 and c != 0:
                if c < 0:
                    target -= c * (n - 1)
                terms.append((abs(c), n - 1))
    # u - v with u < a.itemsize, v < b.itemsize: v = (b.itemsize - 1) - v'.
    target += b.itemsize - 1
    terms.append((1, a.itemsize + b.itemsize - 2))
    return [(c, n) for c, n in terms if n > 0], target


def _solvable(terms: list[tuple[int, int]], target: int) -> bool:
    """Whether sum c_k x_k = target has a solution with 0 <= x_k <= n_k (all c_k > 0)."""
    total = sum(c * n for c, n in terms)
    if target < 0 or target > total:
        return False
    if not terms:
        return target == 0
    g = 0
    for c, _ in terms:
        g = gcd(g, c)
    if target % g:
        return False
    if len(terms) == 1:
        ((c, n),) = terms
        return target // c <= n
    if len(terms) == 2:
        return _two_terms(terms[0], terms[1], target)
    # The variable with the fewest feasible values: x in [lo, hi] leaves the rest reachable.
    best = None
    for k, (c, n) in enumerate(terms):
        rest = total - c * n
        lo, hi = max(0, -(-(target - rest) // c)), min(n, target // c)
        if lo > hi:
            return False
        if best is None or hi - lo < best[0]:
            best = (hi - lo, k, lo, hi)
    _, k, lo, hi = best
    c = terms[k][0]
    others = terms[:k] + terms[k + 1 :]
    g_rest = 0
    for ci, _ in others:
        g_rest = gcd(g_rest, ci)
    # The rest can only sum to multiples of g_rest: c x = target (mod g_rest).
    g2 = gcd(c, g_rest)
    if target % g2:
        return False
    m = g_rest // g2
    x = lo
    if m > 1:
        x0 = (target // g2) * pow(c // g2, -1, m) % m
        x = lo + (x0 - lo) % m
    while x <= hi:
        if _solvable(others, target - c * x):
            return True
        x += m
    return False


def _two_terms(t1: tuple[int, int], t2: tuple[int, int], target: int) -> bool:
    """c1 x + c2 y = target with 0 <= x <= n1, 0 <= y <= n2 (target divisible by gcd)."""
    (c1, n1), (c2, n2) = t1, t2
    g = gcd(c1, c2)
    m = c2 // g
    # x = x0 (mod m) makes target - c1 x divisible by c2.
    x0 = (target // g) * pow(c1 // g, -1, m) % m if m > 1 else 0
    lo = max(0, -(-(target - c2 * n2) // c1))  # y <= n2
    hi = min(n1, target // c1)  # y >= 0
    if lo > hi:
        return False
    return lo + (x0 - lo) % m <= hi
