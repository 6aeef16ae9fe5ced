"""What a decode pass costs by its rows, learnt from the passes themselves: a line with a knee.

seconds = fixed + per_row x max(0, rows - free). A pass's rows are nearly free while reading the weights
binds (the CPU's one-row pass is memory-bound: its first few extra rows hide under the read; a GPU's under
its launch), then each costs its arithmetic. A plain line fitted to both halves prices the first extra rows
at the average and the last ones under it, so a 2-core CPU drafted too little where a draft was nearly free
and too much where rows were dear (docs/DECISIONS.md). The knee is the one, among fixed candidates, whose
least-squares line leaves the least unexplained, taken over none only when it explains a tenth more.
"""

from __future__ import annotations

import bisect

COST_DECAY = 0.95  # the weight of past passes
KNEES = (0, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)  # candidate `free` rows
KNEE_GAIN = 0.1  # a knee must leave this much less unexplained than the plain line (a third fitted number)


class PassCost:
    """Seconds a pass by its rows: decayed sums of the passes seen, between each two candidate knees."""

    def __init__(self) -> None:
        # per span [KNEES[i], KNEES[i + 1]): decayed sums of 1, rows, rows^2, seconds, rows x seconds, seconds^2
        self._spans = [[0.0] * 6 for _ in KNEES]
        self._used: set[int] = set()  # the spans a pass has fallen in
        self._line = (0, 0.0, 0.0)  # free, fixed, per_row as last fitted
        self._stale = False

    @property
    def known(self) -> bool:
        return bool(self._used)

    @property
    def free(self) -> int:
        return self._fitted()[0]

    @property
    def fixed(self) -> float:
        return self._fitted()[1]

    @property
    def per_row(self) -> float:
        return self._fitted()[2]

    def seconds(self, rows: float) -> float:
        free, fixed, per_row = self._fitted()
        return fixed + per_row * max(0.0, rows - free)

    def add(self, rows: int, seconds: float) -> None:
        index = bisect.bisect_right(KNEES, rows) - 1
        self._used.add(index)
        for used in self._used:  # the passes fall in a few spans: the others hold zeros
            span = self._spans[used]
            for i in range(6):
                span[i] *= COST_DECAY
        span = self._spans[index]
        for i, value in enumerate((1.0, rows, rows * rows, seconds, rows * seconds, seconds * seconds)):
            span[i] += value
        self._stale = True

    def _fitted(self) -> tuple[int, float, float]:
        if self._stale:
            self._stale = False
            self._line = self._fit()
        return self._line

    def _fit(self) -> tuple[int, float, float]:
        """For each candidate knee, the least-squares line of seconds on max(0, rows - knee) from the sums."""
        total = [sum(column) for column in zip(*self._spans)]
        w, _, _, sy, _, syy = total
        above = total[:]  # the sums over passes of the knee's rows or more
        fits = []
        # knees under the passes' spans fit as the one at their lowest, knees over them as a constant
        lowest, highest = min(self._used), max(self._used)
        for j in (0, *range(max(lowest, 1), highest + 1)):
            knee = KNEES[j]
            if j > lowest:  # the spans under `lowest` hold zeros
                above = [a - b for a, b in zip(above, self._spans[j - 1])]
            aw, ar, arr, ay, ary, _ = above
            sx, sxx, sxy = ar - knee * aw, arr - 2 * knee * ar + knee * knee * aw, ary - knee * ay
            spread = w * sxx - sx * sx
            per_row = max(0.0, (w * sxy - sx * sy) / spread) if spread > 1e-9 * max(1.0, w * sxx) else 0.0
            fixed = max(0.0, (sy - per_row * sx) / w)
            unexplained = (syy - 2 * fixed * sy - 2 * per_row * sxy + fixed * fixed * w + 2 * fixed * per_row * sx
                           + per_row * per_row * sxx)
            fits.append((unexplained, knee, fixed, per_row))
        line = fits[0]
        best = min(fits, key=lambda fit: fit[0])
        if best[0] < (1 - KNEE_GAIN) * line[0] - 1e-12 * syy:
            line = best
        return line[1], line[2], line[3]
