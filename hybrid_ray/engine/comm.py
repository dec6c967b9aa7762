"""Collectives under the names of the installed torch.

torch 2.13 renamed the single-tensor collectives (`reduce_scatter_single`,
`all_gather_single`) and warns on the old names; the GPU machines run torch 2.11, which only has
the old ones. One place picks whichever exists.
"""
from __future__ import annotations

import torch.distributed as dist

reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
