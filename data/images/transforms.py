"""Image classification data: timm's train/eval transforms, mixup in the collate, and the held-out set.

Augmentation is a pure function of `(seed, epoch, sample index)`. timm's and torchvision's transforms draw
from the global `random`, numpy and torch generators and take no generator argument, so each sample is
transformed inside `isolated_global_rng(seed, epoch, index)`, which seeds those streams for the sample and
restores them afterwards. Hence:
- resume is exact with any `num_workers` (worker processes would otherwise restart their streams from a
  fixed seed after a resume, and the main process's streams would not cover what they drew);
- the trainer's own streams (dropout, drop path) are untouched by data loading;
- a sample is augmented the same way whichever rank or worker reads it.
Mixup/CutMix (timm's `Mixup`, numpy-driven) is applied per micro-batch in the collate, under the same
isolation keyed by the batch's first sample.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from data.images.sources import FolderSource, HFImageSource, TarShardSource

ImageSource = FolderSource | TarShardSource | HFImageSource
_SEQUENCE_KEYS = ("scale", "ratio", "mean", "std")  # lists in the YAML, tuples here


@contextlib.contextmanager
def isolated_global_rng(*key: int) -> Iterator[None]:
    """Seed the global `random`, numpy and torch CPU generators from `key` for a block; restore them after.

    Only the CPU torch generator is touched (`torch.default_generator`); CUDA streams are left alone.
    """
    py_seed, np_seed, torch_seed = np.random.SeedSequence([int(k) for k in key]).generate_state(3)
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    random.seed(int(py_seed))
    np.random.seed(int(np_seed))
    torch.default_generator.manual_seed(int(torch_seed))
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])


@dataclass(frozen=True)
class AugmentConfig:
    """The training augmentation and eval transform (timm names); the values live in conf/data/imagenet.yaml."""

    img_size: int
    scale: tuple[float, float]  # RandomResizedCrop area range
    ratio: tuple[float, float]  # RandomResizedCrop aspect-ratio range
    hflip: float
    auto_augment: str | None  # timm RandAugment spec, e.g. rand-m9-mstd0.5-inc1
    # Swin's config sets 0.4, but timm (then and now) applies colour jitter only when RandAugment is off.
    color_jitter: float
    interpolation: str
    re_prob: float  # random erasing
    re_mode: str
    re_count: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    crop_pct: float  # eval: resize to floor(img_size / crop_pct), centre-crop img_size
    mixup_alpha: float
    cutmix_alpha: float
    mixup_prob: float
    mixup_switch_prob: float  # chance of CutMix instead of Mixup when both are on
    mixup_mode: str
    label_smoothing: float

    @classmethod
    def from_config(cls, data_cfg: Mapping[str, Any], **overrides: Any) -> AugmentConfig:
        """The augmentation an image data config asks for (its other keys ignored), with `overrides` on top."""
        values = {key: overrides.get(key, data_cfg[key]) for key in cls.__dataclass_fields__}
        return cls(**{key: tuple(value) if key in _SEQUENCE_KEYS else value for key, value in values.items()})

    @property
    def mixup(self) -> bool:
        return (self.mixup_alpha > 0 or self.cutmix_alpha > 0) and self.mixup_prob > 0

    def train_transform(self) -> Any:
        from timm.data import create_transform

        return create_transform(
            self.img_size, is_training=True, scale=self.scale, ratio=self.ratio, hflip=self.hflip,
            color_jitter=self.color_jitter, auto_augment=self.auto_augment, interpolation=self.interpolation,
            mean=self.mean, std=self.std, re_prob=self.re_prob, re_mode=self.re_mode, re_count=self.re_count,
        )

    def eval_transform(self) -> Any:
        from timm.data import create_transform

        return create_transform(self.img_size, is_training=False, interpolation=self.interpolation,
                                mean=self.mean, std=self.std, crop_pct=self.crop_pct, crop_mode="center")

    def eval_protocol(self) -> dict[str, float]:
        """How held-out images are prepared, reported next to every accuracy (it moves top-1 by about 0.1)."""
        resize = int(self.img_size / self.crop_pct)  # timm: floor(img_size / crop_pct), of the shorter side
        return {"resize": float(resize), "crop": float(self.img_size), "crop_pct": float(self.crop_pct)}

    def eval_description(self) -> str:
        protocol = self.eval_protocol()
        return (f"resize {protocol['resize']:g} {self.interpolation}, centre crop {protocol['crop']:g} "
                f"(crop_pct {self.crop_pct:g})")


class ImageDataset:
    """Labelled images from a source, transformed per sample with `(seed, epoch, index)`-keyed randomness."""

    def __init__(self, source: ImageSource, transform: Any, seed: int) -> None:
        self.source, self.transform, self.seed = source, transform, seed

    def __len__(self) -> int:
        return len(self.source)

    def get_item(self, index: int, epoch: int) -> dict[str, Any]:
        image, label = self.source.load(index)
        with isolated_global_rng(self.seed, epoch, index):
            tensor = self.transform(image)
        return {"image": tensor, "label": label, "key": (epoch, index)}

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.get_item(index, 0)


class ImageCollate:
    """Stack samples into `{"image", "label"}`, adding soft `"target"`s under mixup or label smoothing."""

    def __init__(self, augment: AugmentConfig, num_classes: int, seed: int) -> None:
        self.augment, self.num_classes, self.seed = augment, num_classes, seed
        self._mixup = None
        if augment.mixup:
            from timm.data import Mixup

            self._mixup = Mixup(
                mixup_alpha=augment.mixup_alpha, cutmix_alpha=augment.cutmix_alpha, prob=augment.mixup_prob,
                switch_prob=augment.mixup_switch_prob, mode=augment.mixup_mode,
                label_smoothing=augment.label_smoothing, num_classes=num_classes,
            )

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        images = torch.stack([s["image"] for s in samples])
        labels = torch.tensor([s["label"] for s in samples], dtype=torch.long)
        batch = {"image": images, "label": labels}
        if self._mixup is not None:
            epoch, first_index = samples[0]["key"]  # a sample's index is unique within an epoch: so is this key
            with isolated_global_rng(self.seed, epoch, first_index, 1):
                # Mixup mixes `images` in place; the labels stay the unmixed ones (for the accuracy metric).
                batch["image"], batch["target"] = self._mixup(images, labels)
        elif self.augment.label_smoothing > 0:
            from timm.data.mixup import mixup_target

            batch["target"] = mixup_target(labels, self.num_classes, 1.0, self.augment.label_smoothing)
        return batch


def collate_eval(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return {"image": torch.stack([s["image"] for s in samples]),
            "label": torch.tensor([s["label"] for s in samples], dtype=torch.long)}


@dataclass
class EvalImages:
    """The held-out set as the task's `evaluate` consumes it: batches plus how they were prepared."""

    dataset: ImageDataset
    batch_size: int
    description: str  # the eval transform in words
    protocol: dict[str, float]  # ... and as numbers (resize, crop, crop_pct), logged with every accuracy
    num_workers: int = 0
    pin_memory: bool = False

    def batches(self, batch_indices: list[list[int]] | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """The whole set once, in order, or only the batches of sample indices given (one rank's share of an
        evaluation); the eval transform is deterministic."""
        batching = {"batch_size": self.batch_size} if batch_indices is None else {"batch_sampler": batch_indices}
        loader = torch.utils.data.DataLoader(
            self.dataset, **batching, num_workers=self.num_workers,
            pin_memory=self.pin_memory, collate_fn=collate_eval,
            generator=torch.Generator().manual_seed(0),  # workers' base seed: never drawn from the global RNG
        )
        yield from loader


def check_classes(train: ImageSource, held_out: ImageSource | None, num_classes: int | None, where: str) -> int:
    """The class count of the data, checked against the model head (`num_classes`) and the held-out split."""
    found = train.num_classes if train.num_classes is not None else train.max_label + 1
    if num_classes is not None:
        if train.num_classes is not None and train.num_classes != num_classes:
            raise ValueError(
                f"the training images at {where} have {train.num_classes} classes but the model head has "
                f"model.num_classes={num_classes}: set model.num_classes={train.num_classes}"
            )
        if train.max_label >= num_classes:
            raise ValueError(
                f"the training images at {where} carry label {train.max_label} but the model head has "
                f"model.num_classes={num_classes} (labels 0..{num_classes - 1}): set model.num_classes"
            )
        found = num_classes
    if held_out is not None:
        train_names, eval_names = getattr(train, "classes", None), getattr(held_out, "classes", None)
        if train_names is not None and eval_names is not None and train_names != eval_names:
            extra = sorted(set(train_names) ^ set(eval_names))[:5]
            raise ValueError(
                f"the training and held-out splits at {where} have different class folders (e.g. {extra}): "
                "labels would not mean the same class"
            )
        if held_out.max_label >= found:
            raise ValueError(f"the held-out images at {where} carry label {held_out.max_label}, beyond {found} classes")
    return found


def build_image_sets(format: str, path: str, train_split: str, eval_split: str | None, augment: AugmentConfig,
                     num_classes: int | None, seed: int, eval_batch_size: int, num_workers: int = 0,
                     pin_memory: bool = False, image_key: str = "image", label_key: str = "label",
                     ) -> tuple[ImageDataset, ImageCollate, EvalImages | None]:
    """The augmented training set with its collate, and the held-out set, after the class-count checks."""
    from data.images.sources import open_source

    hf_keys = {"image_key": image_key, "label_key": label_key} if format == "hf" else {}
    train = open_source(format, path, train_split, **hf_keys)
    held_out = open_source(format, path, eval_split, **hf_keys) if eval_split else None
    classes = check_classes(train, held_out, num_classes, path)
    dataset = ImageDataset(train, augment.train_transform(), seed)
    evaluation = None
    if held_out is not None:
        evaluation = EvalImages(ImageDataset(held_out, augment.eval_transform(), seed), eval_batch_size,
                                augment.eval_description(), augment.eval_protocol(), num_workers, pin_memory)
    return dataset, ImageCollate(augment, classes, seed), evaluation
