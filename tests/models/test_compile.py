"""`compiled_for_training`: BERT's repeated layers compiled once for all, in a copy that shares the model's tensors;
other models compiled whole."""

import pytest
import torch
import torch._dynamo
from torch import nn

from benchmarks.common import bert_pretraining_batch
from models import compiled_for_training, create_model
from train.tasks import get_task

TINY_BERT = dict(size="large", hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64,
                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _loss_and_grads(forward: nn.Module, model: nn.Module, batch: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = get_task("bert_pretraining").step(forward, batch)["loss"]
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation checkpointing"])
def test_bert_layers_share_one_compile_and_the_model_stays_eager(checkpointing):
    torch.manual_seed(0)
    model = create_model("bert_pretraining", activation_checkpointing=checkpointing, **TINY_BERT)
    batch = bert_pretraining_batch(32, 2, 0.25)
    eager_loss, eager_grads = _loss_and_grads(model, model, batch)
    wrapped = []
    torch._dynamo.reset()

    trained = compiled_for_training("bert_pretraining", model, lambda module: wrapped.append(module) or module)
    with torch._dynamo.config.patch(error_on_recompile=True):  # a second layer compiled again fails
        loss, grads = _loss_and_grads(trained, model, batch)
        second_loss, _ = _loss_and_grads(trained, model, batch)

    assert wrapped == [trained] and trained is not model
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(second_loss, eager_loss, rtol=1e-5, atol=1e-6)
    for grad, eager_grad in zip(grads, eager_grads, strict=True):  # the gradients land on the model's parameters
        torch.testing.assert_close(grad, eager_grad, rtol=1e-4, atol=1e-6)
    layers = trained.bert.encoder.layer
    assert all(getattr(layer, "_compiled_call_impl", None) is not None for layer in layers)
    assert not any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())
    assert [t.data_ptr() for t in trained.state_dict().values()] == [t.data_ptr() for t in model.state_dict().values()]
    assert list(trained.state_dict()) == list(model.state_dict())  # no `_orig_mod.` prefix: checkpoints unchanged


def test_a_model_without_regions_is_compiled_whole_around_its_wrapper():
    model = nn.Linear(2, 2)
    wrapper = nn.Sequential(model)
    compiled = compiled_for_training("swin", model, lambda module: wrapper)
    assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule) and compiled._orig_mod is wrapper


@pytest.mark.slow
def test_a_layer_switched_trainable_between_calls_gets_its_gradient_from_the_compiled_copy():
    """JointSpar's pattern: each call only some layers require gradients. Calls alternate which encoder layer alone
    is trainable, so a region's graph traced with its layer frozen is reused only if the guards miss the switch
    (torch without pytorch/pytorch#177158): its layer then gets no gradient, or the loss none at all."""
    torch.manual_seed(0)
    model = create_model("bert_pretraining", **TINY_BERT)
    batch = bert_pretraining_batch(32, 2, 0.25)
    layers = model.bert.encoder.layer
    torch._dynamo.reset()
    trained = compiled_for_training("bert_pretraining", model)
    for drawn in (1, 0, 1, 0):
        for p in model.parameters():
            p.requires_grad_(False)
        layers[drawn].requires_grad_(True)
        model.zero_grad(set_to_none=True)
        get_task("bert_pretraining").step(trained, batch)["loss"].backward()
        with_grads = {name for name, p in model.named_parameters() if p.grad is not None}
        assert with_grads == {name for name, p in model.named_parameters() if p.requires_grad}
        assert with_grads and all(name.startswith(f"bert.encoder.layer.{drawn}.") for name in with_grads)
