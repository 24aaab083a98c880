# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Per-channel values for a fold into a conv or linear.

A scale or affine folds into a layer only as one value per channel
(`channel_vector`: a broadcast tensor read as a [channels] vector, or None), and
for a grouped conv the fold needs the input channel each weight entry reads
(`conv_input_channels`), so a per-input-channel map lands on the right weights.
"""

from __future__ import annotations

import torch


def channel_vector(
    values: torch.Tensor, rank: int, channel_axis: int, channels: int
) -> torch.Tensor | None:
    """`values` as a [channels] vector if it broadcasts over a rank-`rank` tensor along
    `channel_axis` only (or is a scalar); None if it varies along any other axis."""
    if values.dim() > rank:
        return None
    shape = (1,) * (rank - values.dim()) + tuple(values.shape)
    for axis, size in enumerate(shape):
        if size != 1 and axis != channel_axis:
            return None
    if shape[channel_axis] not in (1, channels):
        return None
    return values.reshape(-1).expand(channels) if values.numel() == 1 else values.reshape(channels)


def conv_input_channels(out_channels: int, per_group: int, groups: int) -> torch.Tensor:
    """[out_channels, per_group]: the input channel that weight[o, i] of a grouped conv
    (not transposed) reads."""
    group_of_output = torch.arange(out_channels) // (out_channels // groups)
    return group_of_output[:, None] * per_group + torch.arange(per_group)[None, :]
