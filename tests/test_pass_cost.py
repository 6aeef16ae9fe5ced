"""What load control learns a decode pass costs by its rows: a line with a knee, fitted to the passes seen.

Rules: passes are given as (rows, seconds) the way the pass loop reports them; exact assertions.
"""

from dataclasses import dataclass, field

import pytest

from lanes.core.drafting import Drafting
from lanes.core.pass_cost import PassCost

# A 2-core CPU's drafted passes (bench/RESULTS.md): rows up to 4 hide under the weights' read, then 2.5 ms each.
KNEED = [(1, 0.020), (3, 0.020), (5, 0.0225), (9, 0.0325), (13, 0.0425), (17, 0.0525)]


def test_a_pass_whose_first_rows_hide_under_the_weights_read_is_learnt_with_its_knee():
    cost = PassCost()
    assert not cost.known
    for rows, seconds in KNEED:
        cost.add(rows, seconds)
    assert cost.known and cost.free == 4
    assert cost.fixed == pytest.approx(0.020, rel=1e-9) and cost.per_row == pytest.approx(0.0025, rel=1e-9)
    assert [round(cost.seconds(rows), 6) for rows in (1, 2, 4, 5, 9, 17)] == [0.02, 0.02, 0.02, 0.0225, 0.0325, 0.0525]


def test_passes_on_a_line_are_learnt_as_that_line():
    line = PassCost()
    for rows, seconds in [(1, 0.100), (8, 0.1035), (64, 0.1315), (4, 0.1015)]:  # 0.5 ms a row over 99.5 ms
        line.add(rows, seconds)
    assert line.free == 0
    assert line.fixed == pytest.approx(0.0995, rel=1e-9) and line.per_row == pytest.approx(0.0005, rel=1e-9)
    bent = PassCost()  # a bend that explains under a tenth more than the line is not taken for a knee
    for rows, seconds in [(1, 0.0100), (5, 0.0141), (9, 0.0180), (13, 0.0220), (17, 0.0260)]:
        bent.add(rows, seconds)
    assert bent.free == 0
    crowd = PassCost()  # 32 lanes and their drafts: a line whose intercept at 0 rows would be negative
    for i in range(40):
        crowd.add(32 + i % 17, 0.020 + 0.001 * (i % 17))
    assert crowd.free == 32 and [round(crowd.seconds(rows), 6) for rows in (32, 40, 48)] == [0.02, 0.028, 0.036]


def test_old_passes_fade_so_the_cost_follows_the_host():
    cost = PassCost()
    for rows, seconds in KNEED * 4:
        cost.add(rows, seconds)
    for rows, seconds in KNEED * 40:  # the host slows to twice the time a pass
        cost.add(rows, 2 * seconds)
    assert cost.free == 4 and cost.seconds(1) == pytest.approx(0.040, rel=1e-5)  # 0.95^240 of the old left
    assert cost.per_row == pytest.approx(0.005, rel=1e-5)


class Source:
    def propose(self, job, most):
        return (1,) * most

    def forget(self, job):
        pass


@dataclass
class Stream:
    id: int
    prompt: tuple[int, ...] = (1,)
    generated: list[int] = field(default_factory=list)
    media: tuple = ()


def test_load_control_drafts_the_rows_that_hide_under_the_weights_read_where_a_line_prices_them_all():
    """A lane whose first draft token is kept 2 times in 5, a later one 1 in 2: its third token gains 0.1 of a
    token. Under the knee that row costs nothing, so it is drafted; a line through the same passes' ends
    prices it at 2 ms of a 24 ms pass, more than it gains."""
    lengths = {}
    for name, passes in (("knee", KNEED), ("line", [KNEED[0], KNEED[-1]])):
        drafting = Drafting(Source(), most=16)
        for rows, seconds in passes:
            drafting.passed(rows, seconds)
        job = Stream(0)
        for _ in range(30):
            drafting.observe(job, 2, 0)
            drafting.observe(job, 2, 0)
            drafting.observe(job, 3, 2)
        assert drafting._rates(0) == pytest.approx((25 / 61, 0.5), rel=1e-6)
        lengths[name] = drafting._choose([job])[0]
    assert lengths == {"knee": 3, "line": 2}
