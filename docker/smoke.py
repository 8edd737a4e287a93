"""The image build's last check: the modelling stack imports and a tiny BERT and a tiny Swin take a step on CPU.

A base whose torch the pinned transformers refuses (it disables PyTorch below its minimum, so building a BERT raises
ImportError) or whose torchvision does not match its torch (timm fails to import) then fails the build, not the
first job on the cluster.
"""

from __future__ import annotations

import torch
import transformers
from transformers.utils import is_torch_available

from models import create_model


def step(model: torch.nn.Module, loss: torch.Tensor) -> None:
    loss.backward()
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    if not torch.isfinite(loss):
        raise SystemExit(f"smoke: {type(model).__name__} gave a non-finite loss {loss.item()}")


def main() -> None:
    if not is_torch_available():
        raise SystemExit(f"smoke: transformers {transformers.__version__} disabled torch {torch.__version__}")
    bert = create_model("bert_pretraining", size="tiny", vocab_size=128, max_position_embeddings=32)
    ids = torch.randint(5, 128, (2, 16))
    mlm, nsp = bert(ids, torch.zeros_like(ids), torch.ones_like(ids), masked_lm_positions=torch.tensor([[1, 3]] * 2))
    step(bert, mlm.logsumexp(-1).mean() + nsp.logsumexp(-1).mean())
    swin = create_model("swin", arch="swin_tiny_patch4_window7_224", num_classes=10, img_size=32, patch_size=4,
                        embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=4)
    step(swin, torch.nn.functional.cross_entropy(swin(torch.randn(2, 3, 32, 32)), torch.tensor([0, 1])))
    archs = torch.cuda.get_arch_list() if torch.cuda.is_available() else "no GPU at build time"
    print(f"smoke: torch {torch.__version__} (CUDA {torch.version.cuda}, {archs}), transformers "
          f"{transformers.__version__}: tiny BERT and Swin stepped on CPU")


if __name__ == "__main__":
    main()
