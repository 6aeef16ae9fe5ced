"""Records built once a row or a token (`Work`, `TokenEvent`, `Piece`, `RowSampling`) have hand-written constructors that fill the
instance dict; they must still be the frozen dataclasses their fields say.

Rules: the reference is `dataclasses` itself: the constructor's parameters are the fields in order with
their defaults, equality, hashing, `replace` and the frozen error behave as for a generated `__init__`.
"""

import dataclasses
import inspect

import pytest

from lanes.core.passes import Piece
from lanes.core.plan import Plan, Work
from lanes.core.sampling import RowSampling, SamplingParams
from lanes.core.stream import TokenEvent, TopLogprob

PIECE = Piece(3, (7,), 12, (0, 1))
ROW = RowSampling(3, SamplingParams(), 5)


@pytest.mark.parametrize("record", [Work, TokenEvent, Piece, RowSampling])
def test_the_constructor_takes_the_fields_in_order_with_their_defaults(record):
    parameters = list(inspect.signature(record).parameters.values())
    fields = dataclasses.fields(record)
    assert [p.name for p in parameters] == [f.name for f in fields]
    assert [p.default for p in parameters] == [
        inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default for f in fields]


@pytest.mark.parametrize("made", [Work(PIECE, ROW, (1, 2), 3, (4,)), TokenEvent(9, "é", -0.5, (TopLogprob(9, -0.5),)),
                                  Piece(2, (5, 6), 3, (1,), "none"), ROW])
def test_a_record_is_frozen_and_compares_by_its_fields(made):
    values = {f.name: getattr(made, f.name) for f in dataclasses.fields(made)}
    again = type(made)(**values)
    assert again == made and hash(again) == hash(made) and again is not made
    assert vars(made) == values  # nothing but the fields
    assert dataclasses.replace(made, **values) == made
    name = dataclasses.fields(made)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(made, name, None)


def test_defaults_and_a_plans_pieces():
    work = Work(PIECE)
    assert (work.sample, work.targets, work.top, work.labels) == (None, (), 0, ())
    assert TokenEvent(1, "a") == TokenEvent(1, "a", None, ())
    plan = Plan(4, (work, Work(Piece(5, (2,), 0, (3,)), ROW)), 0)
    assert plan.pieces == (PIECE, Piece(5, (2,), 0, (3,))) and plan.pieces is plan.pieces  # read once a pass
    assert plan == Plan(4, plan.work, 0)


def test_a_piece_still_refuses_no_tokens_and_a_negative_start():
    with pytest.raises(ValueError, match="at least one token"):
        Piece(0, (), 0, (1,))
    with pytest.raises(ValueError, match="before position 0"):
        Piece(0, (1,), -1, (1,))
