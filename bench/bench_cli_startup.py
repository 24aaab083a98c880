# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Start-up time of the `etfold` command: `--help` and `report --list`, target < 1 s.

    .venv/bin/python bench/bench_cli_startup.py [--repeats N]

Each command runs as a fresh process (the console script beside this Python),
N times; prints the median, p10–p90 and max wall time, and whether torch was
imported (it must not be: lazy imports are what keep these fast). For scale,
the same for `python -c "import torch"`.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

TARGET_S = 1.0


def _times(command: list[str], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return times


def _imports_torch(args: list[str]) -> bool:
    probe = (
        "import sys, contextlib, io\n"
        "from etfold import cli\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        f"    cli.main({args!r})\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return result.stdout.strip() == "True"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=10, help="runs per command (>= 2)")
    repeats = parser.parse_args().repeats
    etfold = str(Path(sys.executable).with_name("etfold"))
    cases = {
        "etfold --help": ([etfold, "--help"], ["--help"]),
        "etfold report --list": ([etfold, "report", "--list"], ["report", "--list"]),
        "etfold report --list --json": (
            [etfold, "report", "--list", "--json"],
            ["report", "--list", "--json"],
        ),
        'python -c "import torch" (scale)': ([sys.executable, "-c", "import torch"], None),
    }
    print(
        f"{'command':36s} {'median s':>9s} {'p10–p90 s':>13s} {'max s':>7s}  torch  < {TARGET_S} s"
    )
    for name, (command, cli_args) in cases.items():
        times = sorted(_times(command, repeats))
        deciles = statistics.quantiles(times, n=10, method="inclusive")
        p10, p90 = deciles[0], deciles[-1]
        torch_loaded = "-" if cli_args is None else ("yes" if _imports_torch(cli_args) else "no")
        verdict = (
            "" if cli_args is None else ("ok" if statistics.median(times) < TARGET_S else "SLOW")
        )
        print(
            f"{name:36s} {statistics.median(times):9.3f} {p10:6.3f}–{p90:6.3f} {max(times):7.3f}"
            f"  {torch_loaded:5s}  {verdict}"
        )


if __name__ == "__main__":
    main()
