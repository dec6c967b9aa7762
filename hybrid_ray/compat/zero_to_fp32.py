"""`deepspeed.utils.zero_to_fp32`: a checkpoint's full fp32 model weights, without an engine.

A hybrid_ray checkpoint already holds every parameter's fp32 master, sharded by rank;
hybrid_ray/engine/checkpoint/offline.py reassembles them (at any saved world size or stage)
into the model's state_dict. checkpoint_dir is the save directory (`latest` picks the tag, with
the usual fallback to the newest good checkpoint) or one checkpoint's own directory.
"""
from __future__ import annotations

import argparse
import os
from typing import Dict, List, Optional

import torch
import torch.nn as nn

from ..engine.checkpoint import offline

WEIGHTS_NAME = "pytorch_model.bin"  # what DeepSpeed and transformers write into an output folder
SAFE_WEIGHTS_NAME = "model.safetensors"


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: Optional[str] = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> Dict[str, torch.Tensor]:
    """The model's state_dict in fp32 (buffers in their own dtype), on the CPU.
    lazy_mode is accepted and ignored: the tensors are read into memory at once."""
    fs, ckpt = offline.target(checkpoint_dir, tag)
    return offline.consolidated_state_dict(fs, ckpt, torch.float32, exclude_frozen_parameters)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str, output_file: str,
                                               tag: Optional[str] = None,
                                               exclude_frozen_parameters: bool = False,
                                               safe_serialization: bool = False) -> str:
    """Write the fp32 state_dict with torch.save (or safetensors for a .safetensors name or
    safe_serialization); an existing directory as output_file gets pytorch_model.bin
    (model.safetensors) inside, as DeepSpeed's newer output_dir does. Returns the file written.
    """
    if os.path.isdir(output_file):
        output_file = os.path.join(output_file, SAFE_WEIGHTS_NAME if safe_serialization else WEIGHTS_NAME)
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    if safe_serialization or output_file.endswith(".safetensors"):
        import safetensors.torch

        seen: set = set()
        unshared = {}
        for key, value in state.items():  # safetensors refuses tensors that share memory
            unshared[key] = value.clone() if id(value) in seen else value.contiguous()
            seen.add(id(value))
        safetensors.torch.save_file(unshared, output_file, metadata={"format": "pt"})
    else:
        torch.save(state, output_file)
    return output_file


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str,
                                         tag: Optional[str] = None) -> nn.Module:
    """Overwrite `model`'s weights with the checkpoint's fp32 ones; the model moves to the CPU
    and is returned (as DeepSpeed does: strict=False, so extra/missing keys are not errors)."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def main(argv: Optional[List[str]] = None) -> int:
    """`python -m hybrid_ray.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT_FILE [-t TAG]`."""
    p = argparse.ArgumentParser(description="Write a checkpoint's consolidated fp32 state_dict.")
    p.add_argument("checkpoint_dir", help="save directory (with `latest`) or one checkpoint's folder")
    p.add_argument("output_file", help="file to write (torch.save; .safetensors with safetensors), "
                                       "or an existing folder")
    p.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: `latest`)")
    p.add_argument("--exclude_frozen_parameters", action="store_true")
    p.add_argument("--safe_serialization", action="store_true")
    args = p.parse_args(argv)
    out = convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_file, args.tag,
                                                     args.exclude_frozen_parameters,
                                                     args.safe_serialization)
    print(f"wrote {out}")
    return 0
