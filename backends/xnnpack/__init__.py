"""etfold's XNNPACK folds. Import `XnnpackPartitioner` from here."""

from etfold.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

__all__ = ["XnnpackPartitioner"]
