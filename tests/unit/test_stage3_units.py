"""ZeRO-3's default units (the modules whose forward gathers and releases their parameters):
which modules they are and which parameters stay in the root unit, gathered for the whole step.
No process group: the rules are about a model's structure."""
from __future__ import annotations

import dataclasses

import torch.nn as nn

from hybrid_ray.engine.zero.stage3 import assign_units, unit_modules
from hybrid_ray.lm.pipeline_model import gpt_pipeline
from hybrid_ray.models import GPT, GPT_SIZES

CFG = dataclasses.replace(GPT_SIZES["tiny"], bias=False)


class DictOfLayers(nn.Module):
    """Layers in a ModuleDict, as torchtitan's models keep them: the dict is never called."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Linear(4, 4) for i in range(3)})
        self.out = nn.Linear(4, 1)

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return self.out(x)


def test_a_module_dict_s_members_are_units_not_the_dict() -> None:
    model = DictOfLayers()
    assert unit_modules(model) == [*model.layers.values(), model.out]


def test_module_list_children_are_the_units_and_tied_weights_the_root() -> None:
    model = GPT(CFG)
    units = unit_modules(model)
    assert units == list(model.blocks)
    owner = assign_units(model, units)
    assert owner[id(model.wte.weight)] is None  # the embedding and its tied head
    assert owner[id(model.blocks[1].qkv.weight)] == 1


def test_a_pipeline_s_tied_module_stays_in_the_root_and_its_layers_are_units() -> None:
    """The embedding serves the first layer and, through forward_fn, the head: neither use is
    the tied module's own forward on its own, so its parameters are the root's."""
    model = gpt_pipeline(CFG, num_stages=1, seed_layers=True)
    embed = model.tied_modules["embed"]
    units = unit_modules(model)
    assert units[0] is embed and model.get_submodule("1") in units
    owner = assign_units(model, units)
    assert {owner[id(p)] for p in embed.parameters()} == {None}
    assert owner[id(model.get_submodule("1").qkv.weight)] == units.index(model.get_submodule("1"))
