"""Image classification data: sources (folder, tar, HF), timm transforms and mixup, the digits demo."""
