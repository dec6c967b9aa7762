"""DeepSpeed config keys official examples set: accepted where they mean what the engine does,
refused by name (NotSupportedError) where they cannot be honoured."""
from __future__ import annotations

import pytest

from hybrid_ray.config import ConfigError, NotSupportedError, load_config

BASE = {"train_batch_size": 8}


def cfg(**extra):
    return load_config({**BASE, **extra})


def test_legacy_zero_spellings() -> None:
    assert cfg(zero_optimization=True).zero_optimization.stage == 1
    assert cfg(zero_optimization=False).zero_optimization.stage == 0
    zero = cfg(zero_optimization={"stage": 2, "cpu_offload": True, "cpu_offload_use_pin_memory": True}).zero_optimization
    assert zero.offload_optimizer.device == "cpu" and zero.offload_optimizer.pin_memory
    assert cfg(zero_optimization={"stage": 2, "cpu_offload": False}).zero_optimization.offload_optimizer.device == "none"
    assert cfg(zero_optimization={"stage": 3, "stage3_gather_fp16_weights_on_model_save": True}
               ).zero_optimization.stage3_gather_16bit_weights_on_model_save
    with pytest.raises(ConfigError, match=r"^zero_optimization.cpu_offload, zero_optimization."
                                          r"offload_optimizer.device: contradiction"):
        cfg(zero_optimization={"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "none"}})
    with pytest.raises(ConfigError, match=r"^zero_optimization.cpu_offload: expected a boolean"):
        cfg(zero_optimization={"cpu_offload": "yes"})
    with pytest.raises(NotSupportedError, match=r"^zero_optimization.offload_param.device"):
        cfg(zero_optimization={"stage": 3, "cpu_offload_params": True})


def test_no_op_defaults_of_official_examples_are_accepted() -> None:
    c = cfg(prescale_gradients=False, gradient_predivide_factor=1.0, sparse_gradients=False,
            wall_clock_breakdown=False, dump_state=False, zero_allow_untested_optimizer=True,
            zero_force_ds_cpu_optimizer=False, communication_data_type="fp16",
            amp={"enabled": False, "opt_level": "O1"}, elasticity={"enabled": False, "max_train_batch_size": 64,
                                                                   "micro_batch_sizes": [2, 4]},
            tensorboard={"enabled": False, "output_path": "tb/", "job_name": "x"},
            wandb={"enabled": False, "project": "p"}, csv_monitor={"enabled": False},
            fp16={"enabled": True, "auto_cast": False, "fp16_master_weights_and_grads": False},
            optimizer={"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True, "adam_w_mode": False}})
    assert c.optimizer.params == {"lr": 1e-3} and c.elasticity.micro_batch_sizes == (2, 4)
    assert cfg(bf16={"enabled": True, "immediate_grad_update": True}).bf16.immediate_grad_update
    assert cfg(prescale_gradients=True, gradient_predivide_factor=2.0).gradient_predivide_factor == 2.0


@pytest.mark.parametrize("extra, key", [
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, "fp16.fp16_master_weights_and_grads"),
    ({"sparse_gradients": True}, "sparse_gradients"),
    ({"amp": {"enabled": True}}, "amp.enabled"),
    ({"elasticity": {"enabled": True}}, "elasticity.enabled"),
    ({"tensorboard": {"enabled": True}}, "tensorboard.enabled"),
    ({"wandb": {"enabled": True}}, "wandb.enabled"),
    ({"csv_monitor": {"enabled": True}}, "csv_monitor.enabled"),
])
def test_what_cannot_be_honoured_is_refused_by_name(extra, key) -> None:
    with pytest.raises(NotSupportedError, match=rf"^{key}: not supported yet; got True"):
        cfg(**extra)


def test_bad_values_still_fail_as_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"^gradient_predivide_factor: out of range"):
        cfg(gradient_predivide_factor=0)
    with pytest.raises(ConfigError, match=r"^amp.opt_leve: unknown key"):
        cfg(amp={"enabled": False, "opt_leve": "O1"})
