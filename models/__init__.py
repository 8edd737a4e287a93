"""Model builders keyed by config name (`conf/model/*.yaml` -> `create_model`).

A model's module registers its builder (`@register_model`), and the registry imports every public module here on
its first lookup, so a new model is named nowhere else. Importing them loads no model library (transformers,
timm): the builders do, so a process that only checks a config stays light. The BERT module class,
`models._bert_heads.BertForPreTrainingMaskedLM`, is private for that reason: only a builder imports it.
"""

from models._compile import compiled_for_training, compiles_by_regions
from models._pretrained import export_names, init_summary, pretrained_state, quiet_transformers
from models._registry import (
    check_model_config,
    create_model,
    init_refusal,
    list_models,
    model_options_in_use,
    register_model,
)
from models.bert import BERT_SIZES, build_bert_config, pad_vocab_size
from models.swin import export_timm_model, swin

__all__ = [
    "BERT_SIZES",
    "build_bert_config",
    "check_model_config",
    "compiled_for_training",
    "compiles_by_regions",
    "create_model",
    "export_names",
    "export_timm_model",
    "init_refusal",
    "init_summary",
    "list_models",
    "model_options_in_use",
    "pad_vocab_size",
    "pretrained_state",
    "quiet_transformers",
    "register_model",
    "swin",
]
