"""PipelineModule and engine.train_batch()/eval_batch() at one stage: DeepSpeed's pipeline API
trains exactly as the plain engine loop over the same micro-batches. (Several stages:
tests/distributed/test_pipeline.py.)"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hybrid_ray as deepspeed
from hybrid_ray.config import ConfigError, NotSupportedError
from hybrid_ray.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from hybrid_ray.utils import RepeatingLoader

CFG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


def layers():
    return [nn.Linear(6, 16), lambda x: torch.tanh(x), LayerSpec(nn.Linear, 16, 16), nn.ReLU(),
            nn.Linear(16, 3)]


def pipe(**kw) -> PipelineModule:
    torch.manual_seed(0)
    return PipelineModule(layers=layers(), loss_fn=nn.CrossEntropyLoss(), **kw)


def batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


def test_runs_its_layers_in_order_under_deepspeeds_names() -> None:
    model = pipe()
    assert sorted(model.state_dict()) == ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"]
    x = torch.randn(2, 6)
    want = model._chunks[0][4](F.relu(model._chunks[0][2](torch.tanh(model._chunks[0][0](x)))))
    torch.testing.assert_close(model(x), want, rtol=0, atol=0)


def test_train_batch_equals_the_engine_loop() -> None:
    data = batches(6)
    a = deepspeed.initialize(model=pipe(), config=CFG)[0]
    losses = [a.train_batch(iter(data[i:i + 2])) for i in range(0, 6, 2)]
    b = deepspeed.initialize(model=pipe(), config=CFG)[0]
    manual = []
    for x, y in data:
        loss = F.cross_entropy(b(x), y)
        b.backward(loss)
        b.step()
        manual.append(loss.item())
    assert a.global_steps == b.global_steps == 3
    for p, q in zip(a.module.parameters(), b.module.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert [x.item() for x in losses] == pytest.approx([(manual[i] + manual[i + 1]) / 2 for i in (0, 2, 4)])


def test_train_batch_lets_go_of_each_micro_batchs_outputs_before_its_backward() -> None:
    # The outputs (a language model's logits) are the largest activation; cross-entropy's
    # backward needs only its own saved softmax, so nothing may keep them alive into backward.
    import weakref

    model = pipe()
    seen = []
    model._chunks[0][4].register_forward_hook(lambda m, a, out: seen.append(weakref.ref(out)))
    alive = []
    model._chunks[0][0].register_full_backward_hook(lambda m, gi, go: alive.append(seen[-1]() is not None))
    engine = deepspeed.initialize(model=model, config=CFG)[0]
    engine.train_batch(iter(batches(2)))
    assert alive == [False, False]


def test_train_batch_draws_from_training_data_forever() -> None:
    data = batches(3)  # 3 micro-batches: the second step's second one comes from a new pass
    dataset = [(x[i], y[i]) for x, y in data for i in range(4)]
    engine, _, loader, _ = deepspeed.initialize(model=pipe(), config=CFG, training_data=dataset)
    for _ in range(3):
        loss = engine.train_batch()
        assert torch.isfinite(loss) and loss.dim() == 0
    assert engine.global_steps == 3


def test_tied_layers_share_one_module() -> None:
    torch.manual_seed(0)
    model = PipelineModule(layers=[TiedLayerSpec("emb", nn.Linear, 5, 5, bias=False), nn.Tanh(),
                                   TiedLayerSpec("emb", nn.Linear, 5, 5, bias=False,
                                                 forward_fn=lambda m, x: x @ m.weight)],
                           loss_fn=nn.MSELoss())
    assert [n for n, _ in model.named_parameters()] == ["tied_modules.emb.weight"]
    w = model.tied_modules["emb"].weight
    x = torch.randn(3, 5)
    torch.testing.assert_close(model(x), torch.tanh(x @ w.t()) @ w, rtol=0, atol=0)


def test_activation_checkpoint_interval_gives_the_same_gradients() -> None:
    x, y = batches(1)[0]
    grads = []
    for interval in (0, 1, 2):
        model = pipe(activation_checkpoint_interval=interval)
        F.cross_entropy(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for g in grads[1:]:
        for a, b in zip(grads[0], g):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_eval_batch_takes_no_step_and_keeps_the_mode() -> None:
    engine = deepspeed.initialize(model=pipe(), config=CFG)[0]
    before = [p.detach().clone() for p in engine.module.parameters()]
    data = batches(2)
    loss, logits = engine.eval_batch(iter(data), return_logits=True)
    want = sum(F.cross_entropy(engine.module(x), y).item() for x, y in data) / 2
    assert loss.item() == pytest.approx(want) and logits.shape == (4, 3)
    assert engine.module.training and engine.global_steps == 0
    assert all(torch.equal(p, q) for p, q in zip(before, engine.module.parameters()))
    assert len(engine.eval_batch(iter(batches(3)), reduce_output=None, num_micro_batches=3)) == 3


def test_repeating_loader_restarts_and_sets_the_epoch() -> None:
    class Sampler(list):
        epochs = []

        def set_epoch(self, e):
            self.epochs.append(e)

    loader = torch.utils.data.DataLoader(list(range(3)), batch_size=2, sampler=Sampler(range(3)))
    it = RepeatingLoader(loader)
    got = [next(it).tolist() for _ in range(4)]
    assert got == [[0, 1], [2], [0, 1], [2]] and Sampler.epochs == [1]


@pytest.mark.parametrize("make,error,match", [
    (lambda: pipe(num_stages=2), ConfigError, "num_stages=2: needs the process group first"),
    (lambda: pipe(partition_method="bogus"), ConfigError, "partition_method: unknown"),
    (lambda: pipe(partition_method="type:["), ConfigError, "partition_method: invalid regular expression"),
    (lambda: PipelineModule(layers=[3]), ConfigError, r"layers\[0\]: expected"),
    (lambda: LayerSpec(len), ConfigError, "typename must be an nn.Module class"),
    (lambda: pipe(stages_per_rank=0), ConfigError, "stages_per_rank: must be >= 1; got 0"),
])
def test_refuses_in_one_line(make, error, match) -> None:
    with pytest.raises(error, match=match):
        make()


def test_train_batch_refusals() -> None:
    plain = deepspeed.initialize(model=nn.Linear(6, 3), config=CFG)[0]
    with pytest.raises(ConfigError, match="must be a hybrid_ray.pipe.PipelineModule"):
        plain.train_batch(iter(batches(2)))
    engine = deepspeed.initialize(model=pipe(), config=CFG)[0]
    with pytest.raises(ConfigError, match="no data"):
        engine.train_batch()
    with pytest.raises(ConfigError, match=r"must be \(inputs, labels\)"):
        engine.train_batch(iter([torch.randn(4, 6)] * 2))
    x, y = batches(1)[0]
    engine.backward(F.cross_entropy(engine(x), y))
    engine.step()
    with pytest.raises(ConfigError, match="middle of an accumulation window"):
        engine.train_batch(iter(batches(2)))


def test_partition_is_the_most_balanced_cut_into_nonempty_stages() -> None:
    import itertools
    import random

    from hybrid_ray.engine.pipe.layout import partition

    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 10)
        parts = rng.randint(1, n)
        w = [rng.choice([0, 0, 1, 2, 5, 10]) for _ in range(n)]
        b = partition(w, parts)
        assert b[0] == 0 and b[-1] == n and len(b) == parts + 1 and all(x < y for x, y in zip(b, b[1:]))
        best = min(max(sum(w[c[i]:c[i + 1]]) for i in range(parts))
                   for cut in itertools.combinations(range(1, n), parts - 1) for c in [(0, *cut, n)])
        assert max(sum(w[b[i]:b[i + 1]]) for i in range(parts)) == best, (w, parts, b)
    with pytest.raises(ConfigError, match="3 layers cannot fill 4 stages"):
        partition([1, 1, 1], 4)


def test_the_project_gpt_as_a_pipeline_module_is_the_same_model() -> None:
    from hybrid_ray.lm.pipeline_model import gpt_pipeline
    from hybrid_ray.models.gpt import GPT, GPT_SIZES

    cfg = GPT_SIZES["tiny"]
    torch.manual_seed(0)
    gpt, piped = GPT(cfg), gpt_pipeline(cfg)
    names = {"wte.weight": "tied_modules.embed.wte.weight", "wpe.weight": "tied_modules.embed.wpe.weight",
             "head.weight": "tied_modules.embed.head.weight",  # wte's weight under its second name
             "ln_f.weight": f"{cfg.n_layer + 1}.weight", "ln_f.bias": f"{cfg.n_layer + 1}.bias"}
    mapped = {names.get(k) or f"{int(k.split('.')[1]) + 1}." + k.split(".", 2)[2]: v
              for k, v in gpt.state_dict().items()}
    piped.load_state_dict(mapped, strict=True)  # every name of each, one to one
    embed = piped.tied_modules["embed"]
    assert embed.head.weight is embed.wte.weight  # tied as GPT's head is
    idx = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len))
    tgt = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len))
    torch.testing.assert_close(piped.loss_fn(piped(idx), tgt), gpt(idx, tgt), rtol=0, atol=0)
