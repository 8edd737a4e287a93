"""Image data: digits ImageFolder, folder/tar/HF sources, timm transforms, mixup, exact loader resume, errors."""

from __future__ import annotations

import random
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.config import compose
from PIL import Image

from data import ResumableLoader
from data.images.digits import write_digits_imagefolder
from data.images.sources import FolderSource, HFImageSource, ImageReadError, TarShardSource, open_source, tar_shards
from data.images.transforms import AugmentConfig, ImageCollate, ImageDataset, build_image_sets, check_classes
from train.config import ConfigError, validate


def augment_config(**overrides) -> AugmentConfig:
    """The official recipe as conf/data/imagenet.yaml holds it (the only place of its values), with overrides."""
    return AugmentConfig.from_config(compose(["data=imagenet", "data.path=/nowhere"]).data, **overrides)


DEMO = augment_config(img_size=32, scale=(0.7, 1.0), hflip=0.0, auto_augment=None, re_prob=0.0,
                     mixup_alpha=0.0, cutmix_alpha=0.0, crop_pct=1.0)


def _write_tar_shards(folder: FolderSource, directory: Path, per_shard: int) -> list[Path]:
    """WebDataset-style shards of a folder source: <key>.png + <key>.cls."""
    directory.mkdir(parents=True)
    shards = []
    for start in range(0, len(folder), per_shard):
        shard = directory / f"train-{start // per_shard:06d}.tar"
        with tarfile.open(shard, "w") as archive:
            for index in range(start, min(start + per_shard, len(folder))):
                path, label = folder.samples[index]
                key = f"sample{index:05d}"
                archive.add(path, arcname=f"{key}.png")
                cls = directory / "label.tmp"
                cls.write_text(str(label))
                archive.add(cls, arcname=f"{key}.cls")
        shards.append(shard)
    return shards


def test_digits_imagefolder_is_a_stratified_split_of_all_1797_images(digits):
    train, val = FolderSource(digits / "train"), FolderSource(digits / "val")
    assert len(train) + len(val) == 1797
    assert train.classes == val.classes == [str(d) for d in range(10)]
    assert 0.18 < len(val) / 1797 < 0.22
    assert all(sum(label == c for _, label in val.samples) >= 30 for c in range(10))  # every digit held out
    image, label = train.load(0)
    assert image.mode == "RGB" and image.size == (32, 32) and label == 0
    stamp = (digits / "train" / "0").stat().st_mtime_ns
    assert write_digits_imagefolder(digits) == digits  # idempotent: nothing rewritten
    assert (digits / "train" / "0").stat().st_mtime_ns == stamp


def test_tar_shards_and_hf_dataset_give_the_folder_samples(digits, tmp_path):
    import datasets

    folder = FolderSource(digits / "val")
    _write_tar_shards(folder, tmp_path / "wds", per_shard=100)
    shards = tar_shards(tmp_path / "wds", "train")
    assert len(shards) == 4
    tar = TarShardSource(shards)
    assert len(tar) == len(folder) and tar.max_label == 9 and tar.num_classes is None
    table = {
        "image": [str(path) for path, _ in folder.samples],
        "label": [label for _, label in folder.samples],
    }
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=10)})
    datasets.DatasetDict({"validation": datasets.Dataset.from_dict(table, features=features)}).save_to_disk(
        str(tmp_path / "hf"))
    hf = open_source("hf", tmp_path / "hf", "validation")
    assert isinstance(hf, HFImageSource) and hf.num_classes == 10 and len(hf) == len(folder)
    for index in (0, 57, len(folder) - 1):
        image, label = folder.load(index)
        for other in (tar, hf):
            other_image, other_label = other.load(index)
            assert other_label == label
            assert np.array_equal(np.asarray(other_image), np.asarray(image))


def test_tar_sample_without_label_is_an_error(tmp_path, digits):
    shard = tmp_path / "train-000000.tar"
    with tarfile.open(shard, "w") as archive:
        archive.add(FolderSource(digits / "val").samples[0][0], arcname="lonely.png")
    with pytest.raises(ValueError, match=r"lonely has no lonely\.cls"):
        TarShardSource([shard])


def test_corrupt_image_error_names_the_file(tmp_path, digits):
    root = tmp_path / "broken"
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    Image.open(FolderSource(digits / "val").samples[0][0]).save(root / "a" / "good.png")
    (root / "b" / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")
    dataset = ImageDataset(FolderSource(root), DEMO.train_transform(), seed=0)
    dataset.get_item(0, 0)
    with pytest.raises(ImageReadError, match=r"cannot read image .*b/bad\.png"):
        dataset.get_item(1, 0)


def test_empty_and_mismatched_datasets_fail_clearly(tmp_path, digits):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no class folders"):
        FolderSource(tmp_path / "empty")
    (tmp_path / "hollow" / "cat").mkdir(parents=True)
    with pytest.raises(ValueError, match="cat hold no images"):
        FolderSource(tmp_path / "hollow")
    train, val = FolderSource(digits / "train"), FolderSource(digits / "val")
    with pytest.raises(ValueError, match=r"have 10 classes but the model head has model.num_classes=1000"):
        check_classes(train, val, 1000, str(digits))
    assert check_classes(train, val, 10, str(digits)) == 10
    (tmp_path / "other" / "x").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(tmp_path / "other" / "x" / "1.png")
    with pytest.raises(ValueError, match="different class folders"):
        check_classes(train, FolderSource(tmp_path / "other"), 10, "here")


def test_class_count_mismatch_stops_the_trainer_data_build(digits):
    from data import DataRequest, build_data

    cfg = compose(["experiment=swin_demo", f"data.path={digits}", "model.num_classes=7"])
    with pytest.raises(ValueError, match=r"10 classes .* model.num_classes=7: set model.num_classes=10"):
        build_data(cfg.data, DataRequest(rank=0, world_size=1, micro_batch_size=cfg.trainer.micro_batch_size, seed=0))


def test_official_transforms_are_timm_swin_recipe():
    augment = augment_config()  # defaults = conf/data/imagenet.yaml = the official recipe
    text = repr(augment.train_transform())
    for part in ("RandomResizedCropAndInterpolation", "interpolation=bicubic", "RandAugment", "m=9",
                 "RandomErasing", "p=0.25", "mode=pixel", "RandomHorizontalFlip"):
        assert part in text, part
    assert "ColorJitter" not in text  # inert next to RandAugment, in timm as in the official code
    eval_text = repr(augment.eval_transform())
    assert "Resize(size=256" in eval_text and "CenterCrop(size=(224, 224))" in eval_text
    assert augment.eval_description() == "resize 256 bicubic, centre crop 224 (crop_pct 0.875)"
    assert augment.eval_protocol() == {"resize": 256.0, "crop": 224.0, "crop_pct": 0.875}
    cfg = compose(["data=imagenet", "data.path=/nowhere"])
    for key in ("img_size", "hflip", "auto_augment", "color_jitter", "interpolation", "re_prob", "re_mode",
                "crop_pct", "mixup_alpha", "cutmix_alpha", "mixup_prob", "mixup_switch_prob", "label_smoothing"):
        assert cfg.data[key] == getattr(augment, key), key


def test_augmentation_is_keyed_by_seed_epoch_index_and_leaves_global_rng_alone(digits):
    dataset = ImageDataset(FolderSource(digits / "val"), augment_config(img_size=32).train_transform(), seed=3)
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    before = random.random(), np.random.rand(), torch.rand(1)
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    first = dataset.get_item(5, epoch=0)["image"]
    assert (random.random(), np.random.rand(), torch.rand(1)) == before  # the global streams are untouched
    assert torch.equal(dataset.get_item(5, epoch=0)["image"], first)
    assert not torch.equal(dataset.get_item(5, epoch=1)["image"], first)  # a new draw each epoch
    assert first.shape == (3, 32, 32)


def test_mixup_collate_gives_soft_targets_reproducibly():
    augment = augment_config(img_size=8)
    collate = ImageCollate(augment, num_classes=10, seed=0)
    samples = [{"image": torch.randn(3, 8, 8), "label": i % 10, "key": (0, 40 + i)} for i in range(8)]
    state = np.random.get_state()
    batch = collate([dict(s, image=s["image"].clone()) for s in samples])
    assert np.array_equal(np.random.get_state()[1], state[1])
    again = collate([dict(s, image=s["image"].clone()) for s in samples])
    assert torch.equal(batch["image"], again["image"]) and torch.equal(batch["target"], again["target"])
    assert batch["target"].shape == (8, 10)
    assert torch.allclose(batch["target"].sum(-1), torch.ones(8))
    assert batch["target"].min() >= 0.1 / 10 - 1e-6  # label smoothing 0.1 spreads 0.01 everywhere
    assert not torch.equal(batch["image"], torch.stack([s["image"] for s in samples]))  # mixed
    assert torch.equal(batch["label"], torch.tensor([i % 10 for i in range(8)]))
    smooth = ImageCollate(DEMO, num_classes=10, seed=0)(samples)
    assert torch.equal(smooth["image"], torch.stack([s["image"] for s in samples]))
    assert smooth["target"].max() == pytest.approx(0.91)


def test_loader_resumes_exactly_with_workers(digits):
    augment = augment_config(img_size=32, auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.25)
    dataset, collate, evaluation = build_image_sets(
        "folder", str(digits), "train", "val", augment, 10, seed=1, eval_batch_size=100)
    assert evaluation is not None and len(evaluation.dataset) == 1797 - len(dataset)

    def loader(workers: int) -> ResumableLoader:
        return ResumableLoader(dataset, 8, 0, 1, seed=1, num_workers=workers, collate_fn=collate)

    reference = loader(0)
    series = [next(reference) for _ in range(5)]
    interrupted = loader(2)
    for expected in series[:3]:
        assert torch.equal(next(interrupted)["image"], expected["image"])
    state = interrupted.state_dict()
    interrupted.close()
    resumed = loader(2)
    resumed.load_state_dict(state)
    for expected in series[3:]:
        got = next(resumed)
        assert torch.equal(got["image"], expected["image"]) and torch.equal(got["target"], expected["target"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.format=zip"], "data.format=zip must be one of folder, tar, hf"),
        (["data=imagenet"], r"data.path=None must name the dataset root"),
        (["data.mixup_alpha=0.8", "trainer.micro_batch_size=7", "trainer.global_batch_size=7"],
         "must be even with mixup"),
        (["data.crop_pct=0"], r"data.crop_pct=0.0 must be in \(0, 1\]"),
        (["trainer.ema_decay=1.5"], r"trainer.ema_decay=1.5 must be in \(0, 1\)"),
        (["trainer.keep_best=2", "trainer.best_metric=top1"], "must name an eval metric"),
    ],
)
def test_bad_image_settings_fail_before_workers_start(overrides, message):
    cfg = compose(["experiment=swin_demo", *overrides])
    if "data=imagenet" in overrides:
        cfg.data.path = None
    with pytest.raises(ConfigError, match=message):
        validate(cfg)
