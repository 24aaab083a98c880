"""etfold: guarded, registered folds for ExecuTorch's XNNPACK and Arm backends."""

__version__ = "0.1.0"
