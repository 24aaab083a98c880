import logging

from etfold.decisions import Declined, collect_decisions, record_applied, record_declined


def test_collectors_see_only_what_happens_inside_them(caplog):
    record_declined("fold.a", "n0", "before any collector")
    with caplog.at_level(logging.INFO, logger="etfold"), collect_decisions() as outer:
        record_applied("fold.a", "n1", "scaled by 2")
        with collect_decisions() as inner:
            record_declined("fold.b", "n2", "scale is not finite")
    assert [(d.fold, d.applied, d.where) for d in outer] == [
        ("fold.a", True, "n1"),
        ("fold.b", False, "n2"),
    ]
    assert [d.detail for d in inner] == ["scale is not finite"]
    assert "fold.b declined at n2: scale is not finite" in caplog.text


def test_equal_empty_collectors_are_removed_by_identity():
    with collect_decisions() as first:
        with collect_decisions():
            pass
        record_applied("fold.a", "n", "")
    assert len(first) == 1


def test_declined_is_falsy_and_carries_its_reason():
    declined = Declined("conv output has several users")
    assert not declined
    assert declined.reason == "conv output has several users"
