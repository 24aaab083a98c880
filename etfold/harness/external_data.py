# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Run programs whose constants live in external `.ptd` files.

The runtime in the wheel takes one data map per program, so several `.ptd` files
(one per external tag) are merged into one FlatTensor blob first: the keys of a
program never repeat across its files, so the merge is a plain union.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from executorch.exir import ExecutorchProgramManager
from executorch.exir._serialize._cord import Cord
from executorch.exir._serialize.data_serializer import DataEntry, DataPayload
from executorch.extension.flat_tensor.serialize.serialize import FlatTensorSerializer

ALIGNMENT = 64


def data_files(executorch: ExecutorchProgramManager) -> dict[str, bytes]:
    """`{tag: bytes}` of the `<tag>.ptd` files `write_tensor_data_to_file` writes."""
    with tempfile.TemporaryDirectory() as directory:
        executorch.write_tensor_data_to_file(directory)
        return {path.stem: path.read_bytes() for path in sorted(Path(directory).glob("*.ptd"))}


def data_keys(blob: bytes) -> set[str]:
    return set(FlatTensorSerializer().deserialize(Cord(blob)).named_data)


def merged_data_map(blobs: Sequence[bytes]) -> bytes:
    buffers: list[bytes] = []
    named: dict[str, DataEntry] = {}
    serializer = FlatTensorSerializer()
    for blob in blobs:
        payload = serializer.deserialize(Cord(blob))
        offset = len(buffers)
        buffers.extend(bytes(b) for b in payload.buffers)
        for key, entry in payload.named_data.items():
            if key in named:
                raise ValueError(f"key {key!r} appears in more than one data file")
            named[key] = DataEntry(entry.buffer_index + offset, ALIGNMENT, entry.tensor_layout)
    return bytes(serializer.serialize(DataPayload(buffers=buffers, named_data=named)))


@dataclass
class ProgramWithData:
    """A runtime module and the buffers it points into (the runtime does not copy them)."""

    module: Any
    pte: bytes
    data: bytes | None

    def run_method(self, method: str, inputs: tuple) -> list:
        return list(self.module.run_method(method, inputs))


def load_with_data(pte: bytes, files: Mapping[str, bytes] | Sequence[bytes]) -> ProgramWithData:
    """The runtime module for `pte` with every data file attached."""
    from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer

    blobs = list(files.values()) if isinstance(files, Mapping) else list(files)
    # one file is passed as written; only several are merged into one map
    data = None if not blobs else blobs[0] if len(blobs) == 1 else merged_data_map(blobs)
    module = (
        _load_for_executorch_from_buffer(pte)
        if data is None
        else _load_for_executorch_from_buffer(pte, data)
    )
    return ProgramWithData(module, pte, data)
