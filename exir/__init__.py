"""etfold's exir additions."""

from etfold.exir.program.lower import to_edge_transform_and_lower

__all__ = ["to_edge_transform_and_lower"]
