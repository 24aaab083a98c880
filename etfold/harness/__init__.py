"""Runtime oracles shared by tests, benchmarks and `etfold report`."""
