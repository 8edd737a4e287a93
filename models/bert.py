"""BERT for pretraining from a transformers BertConfig, with NVIDIA's speed choices.

Speed choices (NVIDIA DeepLearningExamples BERT): SDPA attention, the vocabulary padded to a multiple of 8
for tensor cores, and MLM logits computed only at the masked positions (the full-sequence decoder is most of
a small model's step). The weights are plain `BertForPreTraining` weights, so `save_pretrained` output loads
back in stock transformers.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from core.apex import NVIDIA_APEX_HINT, missing_nvidia_apex
from core.options import InvalidOption
from models._registry import register_model

if TYPE_CHECKING:
    from transformers import BertConfig, BertForQuestionAnswering

    from models._bert_heads import BertForPreTrainingMaskedLM

# hidden size, layers, attention heads, feed-forward size. "xl" is the SLAMB paper's 2.8B-parameter scale:
# 36 x 12 x 2560^2 ≈ 2.83B in the encoder [derived from the paper's parameter count; the exact shape is
# not stated in the material we have].
BERT_SIZES: dict[str, tuple[int, int, int, int]] = {
    "tiny": (128, 2, 2, 512),
    "base": (768, 12, 12, 3072),
    "large": (1024, 24, 16, 4096),
    "xl": (2560, 36, 40, 10240),
}


def pad_vocab_size(vocab_size: int, multiple: int = 8) -> int:
    """Round the embedding rows up so the decoder GEMM has tensor-core friendly shapes (30522 -> 30528)."""
    return -(-vocab_size // multiple) * multiple


def build_bert_config(
    size: str = "large",
    vocab_size: int = 30522,
    pad_vocab_to_multiple_of: int = 8,
    max_position_embeddings: int = 512,
    hidden_dropout_prob: float = 0.1,
    attention_probs_dropout_prob: float = 0.1,
    hidden_size: int | None = None,
    num_hidden_layers: int | None = None,
    num_attention_heads: int | None = None,
    intermediate_size: int | None = None,
    config_from: str | None = None,
) -> BertConfig:
    """A BertConfig for a named size; explicit shape arguments override the size's values (for tests).

    `config_from` takes the whole architecture from a transformers directory's config.json instead (to
    fine-tune any Hugging Face BERT); only the dropout rates and attention kernel are then set here.
    """
    from transformers import BertConfig  # here: the launcher and Swin runs need not import transformers

    if config_from is not None:
        config = BertConfig.from_pretrained(config_from)
        config.hidden_dropout_prob = hidden_dropout_prob
        config.attention_probs_dropout_prob = attention_probs_dropout_prob
        config._attn_implementation = "sdpa"
        return config
    if size not in BERT_SIZES:
        raise InvalidOption("size", f"is an unknown BERT size; known sizes: {', '.join(BERT_SIZES)}", size)
    hidden, layers, heads, ffn = BERT_SIZES[size]
    hidden = hidden_size or hidden
    heads = num_attention_heads or heads
    if hidden % heads:
        raise InvalidOption("num_attention_heads", f"does not divide the hidden size {hidden}", heads)
    return BertConfig(
        vocab_size=pad_vocab_size(vocab_size, pad_vocab_to_multiple_of),
        hidden_size=hidden,
        num_hidden_layers=num_hidden_layers or layers,
        num_attention_heads=heads,
        intermediate_size=intermediate_size or ffn,
        max_position_embeddings=max_position_embeddings,
        hidden_dropout_prob=hidden_dropout_prob,
        attention_probs_dropout_prob=attention_probs_dropout_prob,
        attn_implementation="sdpa",
    )


def check_bert_options(fused_layer_norm: bool = False, activation_checkpointing: bool = False,
                       **config_kwargs) -> None:
    """Compose-time check: building the BertConfig (no weights) validates size, shape and `config_from`;
    `fused_layer_norm` needs NVIDIA apex and a GPU."""
    config_from = config_kwargs.get("config_from")
    if config_from is not None and not (Path(config_from) / "config.json").is_file():
        raise InvalidOption("config_from", "has no config.json (a transformers model directory)", config_from)
    build_bert_config(**config_kwargs)
    if fused_layer_norm:
        missing = missing_nvidia_apex("apex.normalization", "fused_layer_norm_cuda")
        if missing is not None:
            raise InvalidOption("fused_layer_norm", f"{NVIDIA_APEX_HINT}; here {missing}", fused_layer_norm)


_SHAPE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")  # null: the size's
_SPEED_OPTIONS = ("fused_layer_norm", "activation_checkpointing")  # no part of the BertConfig


def bert_options_in_use(**options: Any) -> dict[str, Any]:
    """The options with the shape their size (or `config_from`'s config.json) gives in place of the nulls."""
    config = build_bert_config(**{k: v for k, v in options.items() if k not in _SPEED_OPTIONS})
    return {**options, **{key: getattr(config, key) for key in _SHAPE}}


def _with_options(model: nn.Module, fused_layer_norm: bool, activation_checkpointing: bool) -> nn.Module:
    """Apply the speed/memory options that leave the weights as they are (exports stay stock transformers)."""
    if activation_checkpointing:  # recompute each layer's activations in backward: phase 2 / BERT-XL memory
        model.config.use_cache = False  # BERT has no cache to keep; said here, transformers does not warn
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if fused_layer_norm:
        _use_fused_layer_norm(model)
    return model


def _use_fused_layer_norm(model: nn.Module) -> None:
    """Swap every LayerNorm for apex's FusedLayerNorm with the same parameters (and so the same state dict)."""
    from apex.normalization import FusedLayerNorm

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.LayerNorm:
                fused = FusedLayerNorm(child.normalized_shape, eps=child.eps, elementwise_affine=True)
                fused.weight, fused.bias = child.weight, child.bias
                setattr(parent, name, fused)


def bert_export_refusal(options: Mapping[str, Any], export_config: Mapping[str, Any], directory: Path) -> str | None:
    """Why a BERT built with `options` cannot take the export whose config.json is `export_config` (in `directory`):
    the first shape it has otherwise, which transformers would refuse only as it loads, after its report."""
    config = build_bert_config(**{k: v for k, v in options.items() if k not in _SPEED_OPTIONS})
    for key in (*_SHAPE, "vocab_size", "max_position_embeddings", "type_vocab_size"):
        theirs, ours = export_config.get(key), getattr(config, key)
        if theirs is not None and theirs != ours:
            own_key = f"model.{key}={theirs}, or " if key in inspect.signature(build_bert_config).parameters else ""
            return (f"with {key}={theirs}, and this run's model has {key}={ours}: set {own_key}"
                    f"model.config_from={directory} to take the export's whole shape")
    return None


def _encoder_regions(model: nn.Module) -> list[nn.Module]:
    """What `trainer.compile` compiles of a BERT: the embeddings and each encoder layer (one compile serves all)."""
    return [model.bert.embeddings, *model.bert.encoder.layer]


def _pretraining_regions(model: nn.Module) -> list[nn.Module]:
    """The encoder's regions and the MLM head's transform and decoder."""
    return [*_encoder_regions(model), model.cls.predictions]


_FAMILY = dict(family="bert", check=check_bert_options, in_use=bert_options_in_use, export_refusal=bert_export_refusal)


@register_model(**_FAMILY, compile_regions=_pretraining_regions)
def bert_pretraining(fused_layer_norm: bool = False, activation_checkpointing: bool = False,
                     **config_kwargs) -> BertForPreTrainingMaskedLM:
    """BERT with MLM + NSP heads; the other keyword arguments are those of `build_bert_config`."""
    from models._bert_heads import BertForPreTrainingMaskedLM  # the modeling stack: only where a model is built

    model = BertForPreTrainingMaskedLM(build_bert_config(**config_kwargs))
    # Exports name the stock class so any transformers install can load them.
    model.config.architectures = ["BertForPreTraining"]
    return _with_options(model, fused_layer_norm, activation_checkpointing)


@register_model(**_FAMILY, compile_regions=_encoder_regions)
def bert_question_answering(fused_layer_norm: bool = False, activation_checkpointing: bool = False,
                            **config_kwargs) -> BertForQuestionAnswering:
    """BERT with a span start/end head (SQuAD); the other keyword arguments are those of `build_bert_config`."""
    from transformers import BertForQuestionAnswering

    model = BertForQuestionAnswering(build_bert_config(**config_kwargs))
    return _with_options(model, fused_layer_norm, activation_checkpointing)


def _builder_signature() -> inspect.Signature:
    """build_bert_config's arguments plus the two model options, so config keys are checked before launch."""
    options = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=False, annotation=bool)
               for name in ("fused_layer_norm", "activation_checkpointing")]
    config = inspect.signature(build_bert_config)
    return config.replace(parameters=[*config.parameters.values(), *options], return_annotation=nn.Module)


for _builder in (bert_pretraining, bert_question_answering):
    _builder.__signature__ = _builder_signature()  # type: ignore[attr-defined]
