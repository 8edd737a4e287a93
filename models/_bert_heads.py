"""`BertForPreTrainingMaskedLM`, apart from `models.bert`: importing the transformers modeling stack takes seconds,
and the processes that only check a config (the launcher of local workers) never build a model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import BertForPreTraining


class BertForPreTrainingMaskedLM(BertForPreTraining):
    """`BertForPreTraining` whose forward decodes only the given masked positions.

    `masked_lm_positions` has a fixed width P (max predictions per sequence), so the gather has a static
    shape: no host sync and no data-dependent shapes, unlike boolean indexing of the labels.
    """

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        masked_lm_positions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return MLM logits [B, P, V] at `masked_lm_positions` [B, P] and NSP logits [B, 2]."""
        sequence_output, pooled_output = self.bert(
            input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask, return_dict=False
        )[:2]
        index = masked_lm_positions.unsqueeze(-1).expand(-1, -1, sequence_output.size(-1))
        masked_output = torch.gather(sequence_output, 1, index)
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
