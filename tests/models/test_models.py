"""BERT builders: masked-only logits match the stock head, vocab padding, and a stock-loadable export."""

from __future__ import annotations

import pytest
import torch
from transformers import BertForPreTraining

from core.errors import ConfigError
from models import BERT_SIZES, build_bert_config, check_model_config, create_model, list_models, pad_vocab_size

SHAPE = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)


def _tiny(**overrides):
    torch.manual_seed(0)
    return create_model("bert_pretraining", size="tiny", vocab_size=1000, **{**SHAPE, **overrides}).eval()


def _batch(batch=3, length=16, predictions=4, vocab=1000):
    g = torch.Generator().manual_seed(1)
    return (
        torch.randint(0, vocab, (batch, length), generator=g),
        torch.randint(0, 2, (batch, length), generator=g),
        torch.ones(batch, length, dtype=torch.long),
        torch.randint(0, length, (batch, predictions), generator=g),
    )


def test_registry_lists_bert():
    assert "bert_pretraining" in list_models()
    with pytest.raises(ValueError, match=r"^model\.name=no_such_model must be one of .*bert_pretraining"):
        create_model("no_such_model")


@pytest.mark.parametrize(("vocab", "padded"), [(30522, 30528), (30528, 30528), (1000, 1000), (1001, 1008)])
def test_vocab_is_padded_to_multiple_of_8(vocab, padded):
    assert pad_vocab_size(vocab) == padded
    assert build_bert_config("tiny", vocab_size=vocab).vocab_size == padded


def test_named_sizes():
    large = build_bert_config("large")
    assert (large.hidden_size, large.num_hidden_layers, large.num_attention_heads) == (1024, 24, 16)
    assert large.intermediate_size == 4096 and large._attn_implementation == "sdpa"
    xl = build_bert_config("xl")
    encoder_params = xl.num_hidden_layers * 12 * xl.hidden_size**2
    assert 2.7e9 < encoder_params < 2.9e9  # the paper's 2.8B-parameter scale
    assert set(BERT_SIZES) == {"tiny", "base", "large", "xl"}
    with pytest.raises(ValueError, match="unknown BERT size"):
        build_bert_config("huge")


def test_masked_logits_equal_full_head_at_positions():
    model = _tiny()
    input_ids, token_types, attention, positions = _batch()
    mlm, nsp = model(input_ids, token_types, attention, positions)
    full = BertForPreTraining.forward(model, input_ids=input_ids, token_type_ids=token_types,
                                      attention_mask=attention)
    expected = torch.gather(full.prediction_logits, 1, positions.unsqueeze(-1).expand(-1, -1, mlm.size(-1)))
    torch.testing.assert_close(mlm, expected)
    torch.testing.assert_close(nsp, full.seq_relationship_logits)


def test_save_pretrained_loads_in_stock_transformers(tmp_path):
    model = _tiny()
    model.save_pretrained(tmp_path)
    stock = BertForPreTraining.from_pretrained(tmp_path).eval()
    assert type(stock) is BertForPreTraining
    input_ids, token_types, attention, positions = _batch()
    ours = model(input_ids, token_types, attention, positions)[1]
    theirs = stock(input_ids=input_ids, token_type_ids=token_types, attention_mask=attention)
    torch.testing.assert_close(ours, theirs.seq_relationship_logits)


def test_save_pretrained_names_the_stock_class(tmp_path):
    import json

    from transformers import AutoModelForPreTraining

    model = _tiny()
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["BertForPreTraining"]
    assert model.config.architectures == ["BertForPreTraining"]
    assert type(AutoModelForPreTraining.from_pretrained(tmp_path)) is BertForPreTraining


def test_activation_checkpointing_gives_the_same_gradients_and_weights():
    no_dropout = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    plain, checkpointed = _tiny(**no_dropout), _tiny(activation_checkpointing=True, **no_dropout)
    assert checkpointed.is_activation_checkpointing and not plain.is_activation_checkpointing
    assert plain.state_dict().keys() == checkpointed.state_dict().keys()
    for model in (plain, checkpointed):
        model.train()
        mlm, nsp = model(*_batch())
        (mlm.square().mean() + nsp.square().mean()).backward()
    for a, b in zip(plain.parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)  # the same ops, recomputed


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a machine without a GPU (or apex) gives")
def test_fused_layer_norm_without_apex_is_one_config_error():
    with pytest.raises(ConfigError, match=r"^model\.fused_layer_norm=True needs NVIDIA apex .*; here no CUDA") as info:
        check_model_config("bert_pretraining", {"size": "tiny", "fused_layer_norm": True})
    assert "PyPI package 'apex' is unrelated" in str(info.value)
