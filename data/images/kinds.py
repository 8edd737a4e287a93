"""The image-classification data kinds `images` and `digits`: their schema, compose-time check and builder."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING, DictConfig

from core.errors import ConfigError
from core.options import check_choice, check_positive, check_range, options_of, require
from data._registry import DataKind, DataRequest, TaskData, register_data_kind, require_file


@dataclass
class ImageDataConfig:
    """Schema of the image-classification data options (conf/data/imagenet.yaml, digits.yaml)."""

    name: str = MISSING  # images: data.format under data.path; digits: scikit-learn's digits written to data.path
    format: str = MISSING  # folder (<path>/<split>/<class>/<image>) | tar (WebDataset shards) | hf (datasets)
    path: str | None = MISSING  # the dataset root (hf: a save_to_disk directory or a hub name)
    train_split: str = MISSING
    eval_split: str | None = MISSING  # null: no held-out evaluation
    image_key: str = MISSING  # hf columns
    label_key: str = MISSING
    num_classes: int | None = MISSING  # the model head's classes, checked against the data (null: unchecked)
    img_size: int = MISSING
    scale: list[float] = MISSING  # RandomResizedCrop area range
    ratio: list[float] = MISSING  # RandomResizedCrop aspect-ratio range
    hflip: float = MISSING
    auto_augment: str | None = MISSING  # timm RandAugment spec, e.g. rand-m9-mstd0.5-inc1
    color_jitter: float = MISSING
    interpolation: str = MISSING
    re_prob: float = MISSING  # random erasing
    re_mode: str = MISSING
    re_count: int = MISSING
    mean: list[float] = MISSING
    std: list[float] = MISSING
    crop_pct: float = MISSING  # eval: resize floor(img_size / crop_pct), centre crop img_size
    mixup_alpha: float = MISSING
    cutmix_alpha: float = MISSING
    mixup_prob: float = MISSING
    mixup_switch_prob: float = MISSING
    mixup_mode: str = MISSING
    label_smoothing: float = MISSING
    eval_batch_size: int = MISSING
    num_workers: int = MISSING  # loader worker processes per rank


def check_image_data(data_cfg: DictConfig, micro_batch_size: int) -> None:
    """Values that cannot work, including an odd micro-batch under mixup (timm mixes a batch with its reverse)."""
    with options_of("data"):
        for key, allowed in (("format", ("folder", "tar", "hf")), ("mixup_mode", ("batch", "pair", "elem")),
                             ("re_mode", ("const", "rand", "pixel"))):
            check_choice(key, data_cfg[key], allowed)
        if data_cfg.name != "digits":
            require(bool(data_cfg.path), "path", data_cfg.path,
                    f"must name the dataset root (data.format={data_cfg.format})")
        check_positive("img_size", data_cfg.img_size)
        check_positive("eval_batch_size", data_cfg.eval_batch_size)
        for key in ("hflip", "re_prob", "mixup_prob", "mixup_switch_prob"):
            check_range(key, data_cfg[key], 0.0, 1.0)
        check_range("label_smoothing", data_cfg.label_smoothing, 0.0, 0.999)
        require(0.0 < data_cfg.crop_pct <= 1.0, "crop_pct", data_cfg.crop_pct, "must be in (0, 1]")
    mixing = (data_cfg.mixup_alpha > 0 or data_cfg.cutmix_alpha > 0) and data_cfg.mixup_prob > 0
    if mixing and micro_batch_size % 2:
        raise ConfigError(
            f"trainer.micro_batch_size={micro_batch_size} must be even with mixup/cutmix on "
            "(timm mixes each batch with its reverse); or set data.mixup_alpha=0 data.cutmix_alpha=0"
        )


def build_image_data(data_cfg: DictConfig, request: DataRequest, dry: bool = False) -> TaskData | None:
    """This rank's augmented (mixup) training loader and the held-out set; `digits` first writes its images."""
    from data.images.digits import write_digits_imagefolder
    from data.images.transforms import AugmentConfig, build_image_sets

    if dry:
        if data_cfg.name != "digits" and data_cfg.format != "hf":  # hf: a hub name is not a local path
            require_file(data_cfg.path, "data.path: image dataset root")
        return None  # digits: written on first use, never by a dry build
    path = data_cfg.path
    if data_cfg.name == "digits":
        path = str(write_digits_imagefolder(path))
    dataset, collate, evaluation = build_image_sets(
        data_cfg.format, path, data_cfg.train_split, data_cfg.eval_split, AugmentConfig.from_config(data_cfg),
        data_cfg.num_classes, request.seed, data_cfg.eval_batch_size, data_cfg.num_workers, request.pin_memory,
        data_cfg.image_key, data_cfg.label_key,
    )
    from data.loader import ResumableLoader

    loader = ResumableLoader(dataset, request.micro_batch_size, request.rank, request.world_size, request.seed,
                             num_workers=data_cfg.num_workers, pin_memory=request.pin_memory, collate_fn=collate)
    return TaskData(train=loader, eval=evaluation,
                    source=f"{data_cfg.name}: {data_cfg.format} images at {path}",
                    preprocessing=image_preprocessing(data_cfg), class_names=getattr(dataset.source, "classes", None))


def image_preprocessing(data_cfg: Mapping[str, Any]) -> dict[str, Any] | None:
    """The preprocessing an image run trained and evaluated with, which its export carries (timm's
    `pretrained_cfg`); None for data without images (no `img_size`)."""
    if "img_size" not in data_cfg:
        return None
    return {
        "mean": list(data_cfg["mean"]), "std": list(data_cfg["std"]), "crop_pct": float(data_cfg["crop_pct"]),
        "interpolation": str(data_cfg["interpolation"]), "input_size": int(data_cfg["img_size"]),
    }


register_data_kind(DataKind("images", ImageDataConfig, check_image_data, build_image_data))
register_data_kind(DataKind("digits", ImageDataConfig, check_image_data, build_image_data))
