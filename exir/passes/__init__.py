"""etfold's exir passes."""

from etfold.exir.passes.constant_prop_pass import constant_prop_pass

__all__ = ["constant_prop_pass"]
