"""Paired comparison of two ways of training, scored on the same dev rows over the same seeds.

An arm trained with seeds s = 1..S and scored on rows i = 1..n gives, per seed,
whether each row was right (c_is) and each row's summed label-token NLL (e_is).
Against a reference arm (whole-model backprop) on the same rows and seeds, the
paired differences are

    d_is = c_is(arm) - c_is(ref)          accuracy, one row and seed
    D_s  = mean_i d_is                    accuracy difference of seed s
    diff = mean_s D_s

Two things make `diff` uncertain: which dev rows were drawn (row noise, shared
by every seed because the rows are the same) and how training fell out (seed
noise). Its variance is estimated as the sum of the two parts,

    var(diff) = var_i(mean_s d_is) / n  +  var_s(D_s) / S

(the second term is 0 with one seed), and the 95% interval is diff ± 1.96·sd:
a normal interval, which with S = 3 slightly understates the seed part. The
NLL difference per label token is the same with e_is in place of d_is and
sums over rows divided by the rows' label tokens. An arm without seeds (the
base model) pairs its one scoring with every seed of the reference.

The rows may also differ from seed to seed, as long as the two arms of one
seed are scored on the same ones (the study's held-out rows: each seed keeps
its own shuffled tail of the training rows out of training). The same
estimate then holds: the row part, var_i(mean_s d_is) / n, is the variance of
a mean over n·S independent rows, as it should be.

Accuracy and NLL of a single arm are reported as mean ± standard error over
its seeds (sd / sqrt(S)); with one seed, the binomial standard error of the
accuracy over the rows instead (the row noise alone).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

Z95 = 1.959964


@dataclass(frozen=True)
class Scored:
    """One arm at one seed: per-row correctness, summed NLL and label tokens, in dev row order."""

    seed: int | None  # None: the same for every seed (the base model)
    correct: tuple[int, ...]
    nll_sum: tuple[float, ...]
    tokens: tuple[int, ...]

    @property
    def accuracy(self) -> float:
        return sum(self.correct) / len(self.correct)

    @property
    def nll(self) -> float:
        return sum(self.nll_sum) / sum(self.tokens)


@dataclass(frozen=True)
class Summary:
    """An arm's figures over its seeds."""

    seeds: int
    accuracy: float
    accuracy_se: float
    nll: float
    nll_se: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Paired:
    """An arm minus the reference on the same rows and seeds (accuracy in [−1, 1]; NLL in nats per label token)."""

    seeds: int
    accuracy_diff: float
    accuracy_ci: tuple[float, float]
    nll_diff: float
    nll_ci: tuple[float, float]
    nll_ratio: float  # the arm's NLL / the reference's, over the paired seeds

    def to_dict(self) -> dict:
        return asdict(self)


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


def _var(xs) -> float:
    """Sample variance (n - 1); 0 for a single value."""
    xs = list(xs)
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)


def summarize(runs: list[Scored]) -> Summary:
    """Mean and standard error over the seeds of one arm (binomial over rows with a single seed)."""
    if not runs:
        raise ValueError("summarize: no runs")
    accs, nlls = [r.accuracy for r in runs], [r.nll for r in runs]
    if len(runs) > 1:
        acc_se, nll_se = math.sqrt(_var(accs) / len(runs)), math.sqrt(_var(nlls) / len(runs))
    else:
        acc, n = accs[0], len(runs[0].correct)
        acc_se = math.sqrt(acc * (1 - acc) / n)
        per_token = [e / t for e, t in zip(runs[0].nll_sum, runs[0].tokens)]
        nll_se = math.sqrt(_var(per_token) / n)
    return Summary(len(runs), _mean(accs), acc_se, _mean(nlls), nll_se)


def paired(arm: list[Scored], ref: list[Scored]) -> Paired | None:
    """`arm` minus `ref` over their common seeds (an arm scored once pairs with every seed); None when none pair."""
    ref_by = {r.seed: r for r in ref}
    if len(arm) == 1 and arm[0].seed is None:
        pairs = [(arm[0], r) for r in ref]
    else:
        pairs = [(a, ref_by[a.seed]) for a in arm if a.seed in ref_by]
    if not pairs:
        return None
    n = len(pairs[0][1].correct)
    for a, r in pairs:
        if len(a.correct) != n or len(r.correct) != n or a.tokens != r.tokens:
            raise ValueError("paired: the arms were not scored on the same rows")
    seeds = len(pairs)

    def interval(per_row_seed: list[list[float]], scale: float) -> tuple[float, tuple[float, float]]:
        # per_row_seed[s][i]: one seed's paired difference of row i; the estimate is scale * sum_i, averaged over s.
        per_seed = [scale * sum(row) for row in per_row_seed]
        row_means = [_mean(col) for col in zip(*per_row_seed)]
        var = scale ** 2 * n * _var(row_means) + _var(per_seed) / seeds
        diff, half = _mean(per_seed), Z95 * math.sqrt(var)
        return diff, (diff - half, diff + half)

    acc_diff, acc_ci = interval([[x - y for x, y in zip(a.correct, r.correct)] for a, r in pairs], 1 / n)
    # per token of each seed's rows (the same count for every seed when the rows are the same)
    nll_diff, nll_ci = interval([[(x - y) * n / sum(r.tokens) for x, y in zip(a.nll_sum, r.nll_sum)]
                                 for a, r in pairs], 1 / n)
    ratio = _mean(a.nll for a, _ in pairs) / _mean(r.nll for _, r in pairs)
    return Paired(seeds, acc_diff, acc_ci, nll_diff, nll_ci, ratio)
