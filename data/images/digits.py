"""The offline image demo: scikit-learn's 1797 real handwritten digits written as an ImageFolder tree.

`load_digits()` ships inside scikit-learn (8x8 grey images, 10 classes), so the image pipeline can be
exercised end to end without a download. The images are upsampled (bicubic) to RGB PNGs so they go through
the same decode and timm transforms as ImageNet JPEGs, and split into `train/` and `val/` per class.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from core.atomic import replace_directory, staging_directory

COMPLETE_MARKER = ".complete"


def default_digits_dir() -> Path:
    """Where `digits` is written when data.path is null: the user's cache, shared by every run."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "slamb-trainer" / "digits"


def write_digits_imagefolder(root: str | Path | None = None, size: int = 32, val_fraction: float = 0.2,
                             seed: int = 0) -> Path:
    """Write `root/{train,val}/<digit>/<n>.png` once and return `root` (idempotent, safe to race).

    The split is stratified: `val_fraction` of each digit's images, chosen with `seed`, are held out.
    The tree is built in a private staging directory and renamed into place, so concurrent writers (ranks)
    and interrupted runs never leave a partial tree behind.
    """
    from PIL import Image
    from sklearn.datasets import load_digits

    root = Path(root) if root is not None else default_digits_dir()
    if (root / COMPLETE_MARKER).is_file():
        return root
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be in (0, 1)")
    digits = load_digits()
    pixels = np.clip(digits.images * (255.0 / 16.0), 0, 255).astype(np.uint8)  # values are 0..16
    rng = np.random.default_rng(seed)
    staging = staging_directory(root)  # (what a killed writer left beside it goes first)
    try:
        for label in range(10):
            members = rng.permutation(np.flatnonzero(digits.target == label))
            held_out = max(1, round(len(members) * val_fraction))
            for split, chosen in (("val", members[:held_out]), ("train", members[held_out:])):
                directory = staging / split / str(label)
                directory.mkdir(parents=True, exist_ok=True)
                for index in chosen:
                    image = Image.fromarray(pixels[index]).resize((size, size), Image.BICUBIC)
                    image.convert("RGB").save(directory / f"{index:04d}.png")
        (staging / COMPLETE_MARKER).write_text(f"size={size} val_fraction={val_fraction} seed={seed}\n")
        if not (root / COMPLETE_MARKER).is_file():  # else another writer finished first: keep its tree
            replace_directory(staging, root)  # (a stale incomplete tree in the way is removed)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return root
