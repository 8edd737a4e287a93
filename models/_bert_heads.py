"""`BertForPreTrainingMaskedLM`, apart from `models.bert`: importing the transformers modeling stack takes seconds,
and the processes that only check a config (the launcher of local workers) never build a model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import BertForPreTraining


class BertForPreTrainingMaskedLM(BertForPreTraining):
    """`BertForPreTraining` whose forward decodes only the given masked positions, and takes packed rows.

    `masked_lm_positions` has a fixed width P (max predictions per sequence), so the gather has a static
    shape: no host sync and no data-dependent shapes, unlike boolean indexing of the labels.

    A packed batch (`data.text.packing`) numbers each row's sequences in `attention_mask` and passes their
    `position_ids` and `cls_positions`: attention is kept within each sequence by a block-diagonal mask, and NSP
    is predicted from the pooled state of every sequence's [CLS]. Packing changes the inputs only, not the weights.
    """

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        masked_lm_positions: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cls_positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return MLM logits [B, P, V] at `masked_lm_positions` [B, P] and NSP logits: [B, 2], or [B, K, 2] at
        the `cls_positions` [B, K] of a packed batch."""
        if cls_positions is None:
            sequence_output, pooled_output = self.bert(
                input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask, return_dict=False
            )[:2]
        else:
            mask = block_diagonal_mask(attention_mask, self.config._attn_implementation, self.dtype)
            sequence_output = self.bert(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=mask,
                                        position_ids=position_ids, return_dict=False)[0]
            # The pooler reads token 0 of each sequence it is given: here each [CLS], as a sequence of one.
            cls_output = _gather(sequence_output, cls_positions)
            pooled_output = self.bert.pooler(cls_output.flatten(0, 1).unsqueeze(1)).unflatten(0, cls_positions.shape)
        masked_output = _gather(sequence_output, masked_lm_positions)
        return self.cls.predictions(masked_output), self.cls.seq_relationship(pooled_output)

    def save_pretrained(self, save_directory: str | Path, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """`BertForPreTraining.save_pretrained`, with `config.architectures` naming the stock class.

        transformers writes `[type(self).__name__]`, which would leak this project-private subclass into
        config.json; the weights are plain `BertForPreTraining` weights, so that is the class users get from
        `AutoModelForPreTraining`. The config is rewritten once the weights are saved (no hub upload here).
        """
        if kwargs.get("push_to_hub"):
            raise ValueError("push_to_hub is not supported here: save, then upload the directory")
        super().save_pretrained(save_directory, *args, **kwargs)
        self.config.architectures = [BertForPreTraining.__name__]
        if kwargs.get("is_main_process", True):
            self.config.save_pretrained(save_directory)


def _gather(states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The hidden states [B, N, H] at `positions` [B, N] of `states` [B, L, H]."""
    return torch.gather(states, 1, positions.unsqueeze(-1).expand(-1, -1, states.size(-1)))


def block_diagonal_mask(sequence_ids: torch.Tensor, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """The 4D mask [B, 1, L, L] that lets a token attend only to tokens of its own sequence (`sequence_ids` [B, L]).

    transformers passes a 4D mask to the attention unchanged: SDPA takes it as booleans (True: attend), the eager
    attention adds it to the scores. Padding (id 0) attends to padding, so no row of the softmax is empty (an empty
    one gives NaN, and NaN gradients). Memory: B x L x L bytes (8 MiB for 32 rows of 512), the size of the padding
    mask transformers builds for an unpacked batch.
    """
    same = sequence_ids[:, None, :, None] == sequence_ids[:, None, None, :]
    if attn_implementation == "sdpa":
        return same
    if attn_implementation == "eager":
        return torch.zeros(same.shape, dtype=dtype, device=same.device).masked_fill_(~same, torch.finfo(dtype).min)
    raise ValueError(f"packed batches need the sdpa or eager attention, not {attn_implementation!r}")
