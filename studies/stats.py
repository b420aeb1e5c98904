"""Summary statistics shared by the reproductions and scripts.

`mean` / `median` skip what is not a finite number (None for a metric a step did not log, NaN, inf) and are NaN
when nothing is left: per-step records miss keys and carry non-finite values on degenerate steps, and a summary
must say "no data" rather than fail. `sorted_median` is the plain middle of an already sorted list."""

from __future__ import annotations

import math
import numbers
import random
import statistics
from collections.abc import Iterable


def finite(xs: Iterable) -> list:
    """The finite real numbers of `xs`, in order (None, strings, NaN and inf dropped)."""
    return [x for x in xs if isinstance(x, numbers.Real) and math.isfinite(x)]


def mean(xs: Iterable) -> float:
    """Mean of the finite values of `xs` (sum / count); NaN if there are none."""
    xs = finite(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def median(xs: Iterable) -> float:
    """Median of the finite values of `xs`; NaN if there are none."""
    xs = finite(xs)
    return statistics.median(xs) if xs else float("nan")


def sorted_median(sorted_values: list[float]) -> float:
    """Median of a non-empty, already sorted list (nothing filtered)."""
    n = len(sorted_values)
    return 0.5 * (sorted_values[(n - 1) // 2] + sorted_values[n // 2])


def trailing_mean(xs: list[float], window: int) -> list[float]:
    """Per position, `mean` of the last `window` values up to it."""
    return [mean(xs[max(0, i - window + 1): i + 1]) for i in range(len(xs))]


def paired_ratio_ci(per_seed: dict[int, list[float]], base_key: int, *, draws: int = 2000,
                    seed: int = 0) -> dict[int, tuple[float, float]]:
    """95% bootstrap interval of mean_s x_s(k) / mean_s x_s(base_key) for every other key k, resampling the
    seeds s jointly for all keys (values of one seed are paired)."""
    rng = random.Random(seed)
    n = len(per_seed[base_key])
    ratios: dict[int, list[float]] = {k: [] for k in per_seed if k != base_key}
    for _ in range(draws):
        idx = [rng.randrange(n) for _ in range(n)]
        base = statistics.fmean(per_seed[base_key][i] for i in idx)
        for k in ratios:
            ratios[k].append(statistics.fmean(per_seed[k][i] for i in idx) / base)
    lo, hi = int(0.025 * draws), int(0.975 * draws) - 1
    return {k: (sorted(v)[lo], sorted(v)[hi]) for k, v in ratios.items()}


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval of a proportion successes / n (a collapse fraction over seeds); (0, 1) for n = 0.
    Unlike the normal interval it stays inside [0, 1] and is not empty at 0/n or n/n."""
    if n < 0 or not 0 <= successes <= max(n, 0):
        raise ValueError(f"wilson_interval: need 0 <= successes <= n, got {successes}/{n}")
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_mean_ci(diffs: Iterable, *, draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the mean of per-seed paired differences (seeds resampled with
    replacement; NaN/None dropped first); (nan, nan) if there are none."""
    d = finite(diffs)
    if not d:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    n = len(d)
    means = sorted(statistics.fmean(d[rng.randrange(n)] for _ in range(n)) for _ in range(draws))
    return means[int(0.025 * draws)], means[int(0.975 * draws) - 1]
