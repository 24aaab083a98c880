# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The short fuzz profile catches a broken fold: plant a bug for one test, run the profile.

The bugs live only inside a monkeypatched scope; the property run is the very
one CI runs (same strategies, same derandomized examples).
"""

import dataclasses

import pytest
import test_fuzz_scalar_mul as short_profile

from etfold.backends.arm._passes import fold_scalar_mul_into_conv_pass as fold


def test_short_profile_fails_when_the_scale_is_folded_along_the_wrong_axis(monkeypatch):
    rewrite = fold.FoldScalarMulIntoConvPass.rewrite

    def reversed_channels(self, graph_module, program, match):
        flipped = dataclasses.replace(match, channel_scale=match.channel_scale.flip(0))
        return rewrite(self, graph_module, program, flipped)

    monkeypatch.setattr(fold.FoldScalarMulIntoConvPass, "rewrite", reversed_channels)
    with pytest.raises(AssertionError, match=r"^wrong: error .* > tolerance"):
        short_profile.test_generated_conv_scale_programs_are_never_wrong()


def test_short_profile_fails_when_the_finite_scale_guard_is_dropped(monkeypatch):
    monkeypatch.setattr(fold, "is_finite", lambda scale: True)
    with pytest.raises(AssertionError, match=r"^wrong: folded a per_channel nan scale"):
        short_profile.test_generated_conv_scale_programs_are_never_wrong()
