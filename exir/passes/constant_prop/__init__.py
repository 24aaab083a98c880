# Copyright (c) etfold contributors.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""The phases of `etfold.exir.passes.constant_prop_pass`, one module each.

    verdicts  may a placeholder be read, an op run at export time, inputs' tags agree
    select    which call_function nodes may fold (constant inputs, allowed targets)
    evaluate  each selected node's value, computed once in graph order
    name      what each folded result becomes: a constant placeholder (kind, name,
              meta), an erased node, or an op that stays
    rewrite   the graph surgery: placeholders, signature, erasures, output clones

The public entry point is `constant_prop_pass`, in `constant_prop_pass.py`.
"""

FOLD = "exir.constant_prop"
