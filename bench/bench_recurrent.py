# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Recurrent nets on XNNPACK: stock vs etfold, interleaved in one process.

    .venv/bin/python bench/bench_recurrent.py [--models lstm,gru,lstm_large]
                                              [--instances 3] [--budget 20] [--peer ort]

Models (random weights, seeded; each followed by two Linear layers and log_softmax,
as upstream's LSTM op test):
  lstm        LSTM(32, 32) on (1, 32, 32)
  gru         GRU(32, 32) on (1, 32, 32)
  lstm_large  LSTM(128, 256) on (1, 50, 128)

Lowerings: stock = upstream XnnpackPartitioner through upstream to_edge_transform_and_lower;
etfold = etfold's XnnpackPartitioner through etfold.exir.to_edge_transform_and_lower
(its partition result owns the folded constants: `own_folded_constants`).

Columns: delegates; state inputs = parameters / buffers / constants passed into a
delegate call as runtime inputs (0: every weight is the delegate's own static data);
max error against eager; median ms per call (p10-p90) on the single-threaded runtime;
ratio = lowering / stock per round (median, p10-p90; < 1 is faster than stock).
Each lowering is loaded `--instances` times and the rounds rotate over the loads:
two loads of one program differ by several percent for as long as they live.
With `--peer ort` (needs `pip install 'etfold[peers]'`), ONNX Runtime runs the same
export (`etfold.harness.onnx_peer`: one thread, ORT_ENABLE_ALL), `--instances`
sessions, in the same interleaved timing; its row shows its ratio to stock and to etfold.
"""

from __future__ import annotations

import argparse

import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
    XnnpackPartitioner as UpstreamXnnpackPartitioner,
)
from executorch.exir import to_edge_transform_and_lower as upstream_lower
from torch.export.graph_signature import InputKind

from etfold.backends.xnnpack import XnnpackPartitioner
from etfold.exir import to_edge_transform_and_lower as etfold_lower
from etfold.harness.bench_models import RECURRENT as MODELS
from etfold.harness.bench_models import recurrent
from etfold.harness.timing import time_interleaved
from etfold.harness.xnnpack_runner import (
    eager_outputs,
    export_method,
    lower_xnnpack,
    max_abs_error,
)

_DELEGATE_CALL = torch.ops.higher_order.executorch_call_delegate
_STATE = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


LOWERINGS = {
    "stock": (UpstreamXnnpackPartitioner, upstream_lower),
    "etfold": (XnnpackPartitioner, etfold_lower),
}


def state_inputs_of_delegates(program) -> int:
    """Parameters, buffers and constants a delegate call receives as runtime inputs."""
    ep = program.edge.exported_program()
    state = {s.arg.name for s in ep.graph_signature.input_specs if s.kind in _STATE}
    calls = ep.graph.find_nodes(op="call_function", target=_DELEGATE_CALL)
    return sum(getattr(a, "name", None) in state for c in calls for a in c.args[1:])


def bench_model(name: str, args) -> None:
    cell, size, hidden, shape = MODELS[name]
    module, (x,) = recurrent(name)
    reference = eager_outputs(module, (x,))
    loads = {}
    for lowering, (partitioner, lower) in LOWERINGS.items():
        loads[lowering] = [
            lower_xnnpack(export_method(module, "forward", (x,)), [partitioner()], lower=lower)
            for _ in range(args.instances)
        ]
    runs = {k: [lambda p=p: p.run(x) for p in ps] for k, ps in loads.items()}
    peer = _ort_or_failure(module, x, args.instances) if args.peer else None
    if peer is not None and not isinstance(peer, str):
        runs["ort"] = [session.runner((x,)) for session in peer]
    timing = time_interleaved(runs, budget_s=args.budget, min_rounds=args.rounds)
    print(f"{name} {cell.__name__}({size}, {hidden}) on {shape}, {timing.rounds} rounds")
    for lowering, programs in loads.items():
        first = programs[0]
        ms = timing.milliseconds[lowering]
        row = (
            f"  {lowering:<11} delegates {first.delegates():>3}  "
            f"state inputs {state_inputs_of_delegates(first):>2}  "
            f"err {max_abs_error(first.run(x), reference):.1e}  "
            f"{ms.median:.4f} ms ({ms.p10:.4f}-{ms.p90:.4f})"
        )
        if lowering != "stock":
            ratio = timing.ratios[("stock", lowering)]
            row += f"  /stock {ratio.median:.3f} ({ratio.p10:.3f}-{ratio.p90:.3f})"
        print(row, flush=True)
    if peer is not None:
        print(_peer_row(peer, timing, x, reference), flush=True)


def _ort_or_failure(module, x, instances: int):
    """`instances` ORT sessions of the same export, or why there are none (ORT's failure)."""
    from etfold.harness import onnx_peer

    try:
        first = onnx_peer.export_to_ort(export_method(module, "forward", (x,)), threads=1)
        more = [onnx_peer.ort_session(first.model) for _ in range(instances - 1)]
    except onnx_peer.PeerExportFailed as error:
        return f"ORT export: {error}"
    except onnx_peer.PeerRunFailed as error:
        return f"ORT run: {error}"
    return [first, *(onnx_peer.OrtProgram(first.model, s, 1) for s in more)]


def _peer_row(peer, timing, x, reference) -> str:
    if isinstance(peer, str):
        return f"  {'ort':<11} FAILED {peer}"
    ms, text = timing.milliseconds["ort"], ""
    for base in ("stock", "etfold"):
        r = timing.ratios[(base, "ort")]
        text += f"  /{base} {r.median:.3f} ({r.p10:.3f}-{r.p90:.3f})"
    error = max_abs_error(peer[0].run(x), reference)
    return f"  {'ort':<11} {'':>33}err {error:.1e}  {ms.median:.4f} ms ({ms.p10:.4f}-{ms.p90:.4f}){text}"


def main() -> None:
    from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="lstm,gru", help=", ".join(MODELS))
    parser.add_argument("--instances", type=int, default=3, help="loads of each lowering")
    parser.add_argument("--budget", type=float, default=20.0, help="timing seconds per model")
    parser.add_argument("--rounds", type=int, default=20, help="at least this many rounds")
    parser.add_argument("--peer", choices=["ort"], help="also time ONNX Runtime on the export")
    args = parser.parse_args()
    if args.peer:
        from etfold.harness import onnx_peer

        onnx_peer.require()
    torch.set_num_threads(1)
    _unsafe_reset_threadpool(1)  # single-threaded runtime: ratios independent of core count
    for name in args.models.split(","):
        bench_model(name, args)


if __name__ == "__main__":
    main()
