"""`to_edge_transform_and_lower` with etfold's multi-method bookkeeping.

Same signature as upstream's; the exir constant_prop_pass issue adds the
cross-method marking before deferring to upstream.
"""

from __future__ import annotations

from executorch.exir import to_edge_transform_and_lower as _upstream_to_edge_transform_and_lower


def to_edge_transform_and_lower(programs, *args, **kwargs):
    return _upstream_to_edge_transform_and_lower(programs, *args, **kwargs)
