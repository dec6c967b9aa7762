"""A tensor-parallel plan's words become torch's styles, matched by module name; mistakes are
one-line ConfigErrors naming the pattern (no process group needed)."""
from __future__ import annotations

import pytest
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from hybrid_ray.config import ConfigError, load_config
from hybrid_ray.engine.parallelism import _stages
from hybrid_ray.engine.tp import FusedColwise, resolve_plan
from hybrid_ray.models.gpt import GPT, GPTConfig
from hybrid_ray.pipe import LayerSpec, PipelineModule


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(4), nn.Linear(4, 8), nn.Linear(8, 4)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList(Block() for _ in range(2))


def test_words_become_torch_styles_and_the_first_matching_pattern_wins() -> None:
    styles = resolve_plan(Net(), {"blocks.0.up": "colwise:2", "*.up": "colwise", "*.down": "rowwise",
                                  "embed": "rowwise"})
    assert sorted(styles) == ["blocks.0.down", "blocks.0.up", "blocks.1.down", "blocks.1.up", "embed"]
    assert type(styles["blocks.0.up"]) is FusedColwise and styles["blocks.0.up"].chunks == 2
    assert type(styles["blocks.1.up"]) is ColwiseParallel
    # no 'sequence' entry: activations stay whole between the split layers
    assert styles["blocks.1.up"].input_layouts == (Replicate(),)
    assert styles["blocks.1.down"].output_layouts == (Replicate(),)
    assert type(styles["embed"]) is RowwiseParallel and styles["embed"].input_layouts == (Replicate(),)


def test_a_sequence_entry_splits_the_activations_between_split_layers() -> None:
    styles = resolve_plan(Net(), {"*.norm": "sequence", "*.up": "colwise", "*.down": "rowwise"})
    assert type(styles["blocks.0.norm"]) is SequenceParallel
    assert styles["blocks.0.up"].input_layouts == (Shard(1),)
    assert styles["blocks.0.down"].output_layouts == (Shard(1),)


def test_a_torch_style_is_taken_as_given() -> None:
    mine = ColwiseParallel(output_layouts=Replicate())
    assert resolve_plan(Net(), {"blocks.0.up": mine})["blocks.0.up"] is mine


@pytest.mark.parametrize("plan, message", [
    ({}, r"^tp_plan: expected a non-empty \{pattern: style\} mapping; got \{\}"),
    ({"*.upp": "colwise"}, r"^tp_plan\['\*\.upp'\]: matches no module of Net \(names such as 'embed'\)"),
    ({"*.up": "col"}, r"^tp_plan\['\*\.up'\]: unknown style; got 'col'; allowed: colwise, rowwise, sequence"),
    ({"*.norm": "colwise:3"}, r"^tp_plan\['\*\.norm'\]: 'colwise:3' splits a Linear; got LayerNorm"),
    ({"*.up": "colwise:0"}, r"^tp_plan\['\*\.up'\]: unknown style; got 'colwise:0'"),
    ({3: "colwise"}, r"^tp_plan: patterns are module-name strings; got 3"),
])
def test_plan_mistakes_are_one_line_errors(plan, message) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_plan(Net(), plan)


def test_the_gpt_plan_covers_every_split_layer() -> None:
    model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=8, vocab_size=16, seq_len=4))
    styles = resolve_plan(model, model.tp_plan())
    assert type(styles["blocks.1.qkv"]) is FusedColwise and styles["blocks.1.qkv"].chunks == 3
    assert {n for n, s in styles.items() if isinstance(s, SequenceParallel)} == {
        "blocks.0.ln1", "blocks.0.ln2", "blocks.1.ln1", "blocks.1.ln2", "ln_f"}
    assert styles["head"].output_layouts == (Replicate(),)  # whole logits for the loss


def test_stage_counts_of_the_module_and_the_config_must_agree() -> None:
    two = load_config({"train_micro_batch_size_per_gpu": 1, "pipeline_model_parallel_size": 2})
    one_stage = PipelineModule(layers=[LayerSpec(nn.Linear, 2, 2)], num_stages=1)
    with pytest.raises(ConfigError, match=r"^pipeline_model_parallel_size: 2 differs from the "
                       r"PipelineModule's num_stages=1"):
        _stages(one_stage, two)
    assert _stages(PipelineModule(layers=[LayerSpec(nn.Linear, 2, 2)]), two) == 2
    assert _stages(one_stage, load_config({"train_micro_batch_size_per_gpu": 1})) == 1
