"""engine.train_batch() / eval_batch(): one optimizer step (or one evaluation) over the
micro-batches of a batch, for a model given as a PipelineModule, as DeepSpeed's PipelineEngine.

Each micro-batch is `(inputs, labels)` drawn from `data_iter` (by default the loader that
initialize(training_data=...) built, repeated when it runs out); the loss is
`module.loss_fn(module(inputs), labels)`. A step takes gradient_accumulation_steps
micro-batches, and the loss returned is their mean, averaged over the data-parallel ranks.
With one stage the engine's forward/backward/step stay available too (they are the same thing);
with several, the micro-batches go through the stages' schedule (stages.py) and train_batch()
is the only way in, as in DeepSpeed.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, List, Optional

import torch
import torch.distributed as dist

from ...config import ConfigError, NotSupportedError
from .module import PipelineModule, layout_of


class RepeatingLoader:
    """DeepSpeed's `utils.RepeatingLoader`: iterates a loader forever, restarting it (and calling
    its sampler's set_epoch, where it has one, with the pass number) when it runs out."""

    def __init__(self, loader: Iterable) -> None:
        self.loader, self.epoch = loader, 0
        self.data_iter = iter(loader)

    def __iter__(self) -> "RepeatingLoader":
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.epoch += 1
            sampler = getattr(self.loader, "sampler", None)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self.epoch)
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


def _to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(o, device) for o in obj)
    return obj


class PipelineBatches:
    """Engine mixin: DeepSpeed's PipelineEngine batch API over the Engine's own step."""

    def _pipe_layout(self) -> Any:
        return layout_of(self.module)

    @property
    def dp_rank(self) -> int:
        return self.topology.rank

    @property
    def pp_rank(self) -> int:
        layout = self._pipe_layout()
        return 0 if layout is None else layout.stage

    @property
    def tp_rank(self) -> int:
        mesh = self.topology.mesh
        return 0 if mesh is None else mesh.tp_rank

    @property
    def tp_world_size(self) -> int:
        mesh = self.topology.mesh
        return 1 if mesh is None else mesh.tp

    def is_pipe_parallel(self) -> bool:
        return self._pipe_layout() is not None

    def is_first_stage(self) -> bool:
        layout = self._pipe_layout()
        return layout is None or layout.first

    def is_last_stage(self) -> bool:
        layout = self._pipe_layout()
        return layout is None or layout.last

    def _refuse_stages(self, what: str) -> None:
        if self._pipe_layout() is None:
            return
        # DeepSpeed's PipelineEngine refuses them too
        raise NotSupportedError(f"engine.{what}(): a PipelineModule split into {self.module.num_stages} "
                                "stages trains through engine.train_batch() only")

    def set_dataiterator(self, iterator: Iterator) -> None:
        """Where train_batch() without an argument draws its micro-batches from."""
        self.__dict__["_pipe_iter"] = iterator

    def _pipe_module(self, what: str) -> PipelineModule:
        if not isinstance(self.module, PipelineModule):
            raise ConfigError(f"engine.{what}(): the model must be a hybrid_ray.pipe.PipelineModule "
                              f"(its loss_fn gives the loss); got {type(self.module).__name__}. Use "
                              "engine(x), engine.backward(loss), engine.step() for other models")
        return self.module

    def _micro_batches(self, data_iter: Optional[Iterator], what: str) -> Iterator:
        if data_iter is not None:
            return data_iter
        if "_pipe_iter" not in self.__dict__:
            if self.training_dataloader is None:
                raise ConfigError(f"engine.{what}(): no data: pass data_iter, or training_data to "
                                  "initialize, or call set_dataiterator()")
            self.set_dataiterator(iter(RepeatingLoader(self.training_dataloader)))
        return self.__dict__["_pipe_iter"]

    def _loss_of(self, module: PipelineModule, batch: Any, what: str) -> Any:
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise ConfigError(f"engine.{what}(): each micro-batch must be (inputs, labels); got "
                              f"{type(batch).__name__}{'' if not isinstance(batch, (tuple, list)) else f' of {len(batch)}'}")
        inputs, labels = _to(batch[0], self.device), _to(batch[1], self.device)
        outputs = self(inputs)
        if module.loss_fn is None:
            return outputs, outputs
        return module.loss_fn(outputs, labels), outputs

    def _dp_mean(self, losses: List[torch.Tensor]) -> torch.Tensor:
        loss = torch.stack([x.detach().float() for x in losses]).mean()
        if self.topology.group is not None and self.topology.world_size > 1:
            dist.all_reduce(loss, group=self.topology.group)
            loss /= self.topology.world_size
        return loss

    def train_batch(self, data_iter: Optional[Iterator] = None) -> torch.Tensor:
        """One optimizer step over gradient_accumulation_steps micro-batches; their mean loss
        over every data-parallel rank."""
        module = self._pipe_module("train_batch")
        if self.micro_steps % self.gradient_accumulation_steps():
            raise ConfigError("engine.train_batch(): called in the middle of an accumulation "
                              f"window ({self.micro_steps % self.gradient_accumulation_steps()} of "
                              f"{self.gradient_accumulation_steps()} micro-batches taken by "
                              "engine.step()); finish the window first")
        it = self._micro_batches(data_iter, "train_batch")
        self.train()
        if module.pipe_layout is not None:
            return self._train_stages(module, it)
        losses = []
        for _ in range(self.gradient_accumulation_steps()):
            # Only the loss is kept: a name bound to the outputs (a language model's logits, the
            # largest activation) would hold them through the backward and the next forward.
            loss = self._loss_of(module, next(it), "train_batch")[0]
            self.backward(loss)
            self.step()
            losses.append(loss)
        return self._dp_mean(losses)

    def _train_stages(self, module: PipelineModule, it: Iterator) -> torch.Tensor:
        """One step of a PipelineModule split into stages (stages.py says how)."""
        micro = self._stage_micro_batches(it, self.gradient_accumulation_steps(), "train_batch")
        runner = self._runner()
        if not self._window_open:
            self.reducer.start_window()
        self._window_open = True
        self.reducer.hold()  # the hooks wait: the micro-batches' gradients accumulate
        with self._stage_gathered():
            loss = runner.step(micro).mean()
            self.reducer.before_backward(True)  # then every bucket is reduced once over the replicas
            self.reducer.after_backward()
        for _ in micro:
            self.step()
        return self._pipeline_loss(module, loss)

    def _stage_gathered(self) -> Any:
        """ZeRO 3: the stage's parameters whole for the schedule (gathered once per step)."""
        return self.stage3.held() if self.stage3 is not None else contextlib.nullcontext()

    def _pipeline_loss(self, module: PipelineModule, loss: torch.Tensor) -> torch.Tensor:
        """The last stage's mean over the data-parallel replicas, on every stage."""
        if module.pipe_layout.last:
            loss = self._dp_mean([loss])
        return self._runner().broadcast_loss(loss)

    def _stage_micro_batches(self, it: Iterator, n: int, what: str) -> List[Any]:
        micro = []
        for _ in range(n):
            batch = next(it)
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and all(map(torch.is_tensor, batch))):
                raise ConfigError(f"engine.{what}(): with pipeline stages each micro-batch must be "
                                  "(inputs, labels), two tensors")
            micro.append(batch)
        return micro

    def _runner(self) -> Any:
        from .stages import PipeRunner

        if "_pipe_runner" not in self.__dict__:
            self.__dict__["_pipe_runner"] = PipeRunner(self)
        return self.__dict__["_pipe_runner"]

    def _eval_stages(self, module: PipelineModule, data_iter: Iterator, return_logits: bool,
                     num_micro_batches: Optional[int], reduce_output: Optional[str]) -> Any:
        gas = self.gradient_accumulation_steps()
        if return_logits or num_micro_batches not in (None, gas):
            raise NotSupportedError("engine.eval_batch(): with pipeline stages, return_logits and a "
                                    f"num_micro_batches other than gradient_accumulation_steps ({gas}) "
                                    "are not supported yet")
        micro = self._stage_micro_batches(data_iter, gas, "eval_batch")
        with self._evaluating(module), self._stage_gathered():
            losses = self._runner().step(micro, train=False)
        if reduce_output is None:  # this replica's loss of each micro-batch, on every stage
            return list(self._runner().broadcast_loss(losses).unbind())
        return self._pipeline_loss(module, losses.mean())

    @contextlib.contextmanager
    def _evaluating(self, module: PipelineModule) -> Iterator[None]:
        """Eval mode without gradients inside, the module's mode restored after."""
        was_training = module.training
        self.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self.train(was_training)

    def eval_batch(self, data_iter: Iterator, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: Optional[str] = "avg", bcast_loss: bool = True,
                   num_micro_batches: Optional[int] = None) -> Any:
        """The loss over num_micro_batches (default gradient_accumulation_steps) micro-batches,
        without gradients: their mean over every data-parallel rank with reduce_output='avg',
        the list of this rank's losses with None; with return_logits, (loss, last outputs)."""
        if reduce_output not in ("avg", None):
            raise ConfigError(f"eval_batch reduce_output: unknown; got {reduce_output!r}; allowed: 'avg', None")
        module = self._pipe_module("eval_batch")
        if module.pipe_layout is not None:
            return self._eval_stages(module, data_iter, return_logits, num_micro_batches, reduce_output)
        losses, outputs = [], None
        with self._evaluating(module):
            for _ in range(num_micro_batches or self.gradient_accumulation_steps()):
                loss, outputs = self._loss_of(module, next(data_iter), "eval_batch")
                losses.append(loss if compute_loss else outputs)
        result: Any = self._dp_mean(losses) if reduce_output == "avg" else [x.detach() for x in losses]
        return (result, outputs) if return_logits else result
