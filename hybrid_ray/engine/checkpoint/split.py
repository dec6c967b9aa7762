"""Checkpoints of a model split over several processes (tensor parallelism, pipeline stages),
in the same format as an unsplit one: every parameter whole, under the unsplit model's name.

So a checkpoint loads at any (tensor, pipeline, data-parallel) layout: saving joins each
tensor-parallel shard into the whole tensor (and the stages' indexes into one), loading cuts
each rank's shard out of the whole tensor and skips other stages' names. Every rank of the world
takes part in the commit (its files, its marker); a parameter is written by one rank of the
stage that holds it, chosen by size as in an unsplit save.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..tp.gather import cut, gather_whole

Tensors = Dict[str, torch.Tensor]


@dataclass(frozen=True)
class SplitLayout:
    """Where this rank's part of the model sits, for a checkpoint.

    rank / world: this rank in the whole world (its file names, the commit).
    stage_first / stage_size: the first global rank of this rank's stage and how many ranks it
      has (dp * tp): a parameter is written by one of those.
    tp / tp_rank / tp_group: the tensor-parallel split; placements / parts as in
      tp.TensorParallelModel (names not in placements are whole on every rank).
    pp / pp_group: the stages; the group links this rank to the same place in every stage.
    layout: {"tp": T, "pp": P, "dp": dp}, recorded in the checkpoint.
    """

    rank: int
    world: int
    stage_first: int
    stage_size: int
    tp: int
    tp_rank: int
    tp_group: Any
    pp: int
    pp_group: Any
    placements: Dict[str, Tuple[Any, ...]]
    parts: Dict[str, int]
    device: torch.device
    layout: Dict[str, int]

    def _dim(self, name: str) -> Optional[int]:
        dims = [p.dim for p in self.placements.get(name, ()) if p.is_shard()]
        return dims[0] if dims and self.tp > 1 else None

    def full_shape(self, name: str, shape: torch.Size) -> torch.Size:
        dim = self._dim(name)
        if dim is None:
            return shape
        return torch.Size(n * self.tp if i == dim else n for i, n in enumerate(shape))

    def unshard(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The whole tensor from every tensor-parallel rank's `local` (collective over them for
        sharded names; the others come back as they are)."""
        dim = self._dim(name)
        if dim is None:
            return local
        return gather_whole(local, dim, self.parts.get(name, 1), self.tp_group, self.tp, self.device)

    def shard(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a whole tensor (the inverse of unshard; no communication)."""
        dim = self._dim(name)
        if dim is None:
            return whole
        return cut(whole, dim, self.parts.get(name, 1), self.tp, self.tp_rank)

    def from_stages(self, obj: Any) -> List[Any]:
        """`obj` of every stage (this rank's counterparts), in stage order (collective)."""
        if self.pp == 1:
            return [obj]
        out: List[Any] = [None] * self.pp
        dist.all_gather_object(out, obj, group=self.pp_group)
        return out


def merge_layouts(layouts: List[dict]) -> dict:
    """One module layout (state_dict keys, aliases, buffers) from every stage's, in stage order;
    a tied module held by several stages is listed once."""
    keys: Dict[str, None] = {}
    buffers: Dict[str, None] = {}
    aliases: Dict[str, str] = {}
    for lay in layouts:
        keys.update(dict.fromkeys(lay["state_dict_keys"]))
        buffers.update(dict.fromkeys(lay["buffers"]))
        aliases.update(lay["aliases"])
    return {"state_dict_keys": list(keys), "aliases": aliases, "buffers": list(buffers)}


def merge_index(indexes: List[List[dict]]) -> List[dict]:
    """The stages' parameter indexes as one; a tied weight held by several stages once (the
    first stage's copy: the copies are equal)."""
    seen, out = set(), []
    for index in indexes:
        for entry in index:
            if entry["name"] not in seen:
                seen.add(entry["name"])
                out.append(entry)
    return out
