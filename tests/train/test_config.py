"""The config tree: recipes resolve exactly, bad keys and values fail early with the key named."""

from __future__ import annotations

import pytest
import torch
from helpers.config import TINY, compose
from helpers.runs import run_train

from optim import list_optimizers
from train.config import ConfigError, batch_geometry, validate


def test_demo_is_the_default():
    assert compose().name == "demo"
    assert compose(["experiment=demo"]).name == "demo"


def test_bert_large_phase1_carries_nvidia_recipe():
    cfg = compose(["experiment=bert_large_phase1", "data.path=/data/wiki_books"])
    assert cfg.model.size == "large"
    assert (cfg.data.max_seq_len, cfg.data.max_predictions) == (128, 20)
    assert cfg.trainer.global_batch_size == 65536
    assert cfg.trainer.max_steps == 7038
    assert cfg.optim.name == "lamb"
    assert cfg.optim.lr == pytest.approx(6e-3)
    assert list(cfg.optim.betas) == [0.9, 0.999]
    assert cfg.optim.eps == pytest.approx(1e-6)
    assert cfg.optim.weight_decay == pytest.approx(0.01)
    assert cfg.trainer.grad_clip == 1.0
    assert cfg.schedule.name == "poly_warmup"
    assert cfg.schedule.kwargs.warmup_fraction == pytest.approx(0.2843)
    assert cfg.schedule.kwargs.degree == 0.5
    assert cfg.trainer.device == "cuda"  # a cluster recipe never falls back to CPU in silence
    # O2 in NVIDIA's fp16, compiled: what measured fastest on the GPU (docs/results/gpu-h100.md)
    assert (cfg.precision.dtype, cfg.precision.weights, cfg.trainer.compile) == ("fp16", "half", True)
    validate(compose(["experiment=bert_large_phase1", "data.path=/data/wiki_books", "trainer.device=cpu"]))


def test_bert_large_phase2_derives_from_phase1():
    cfg = compose(["experiment=bert_large_phase2"])
    assert (cfg.data.max_seq_len, cfg.data.max_predictions) == (512, 80)
    assert cfg.trainer.global_batch_size == 32768
    assert cfg.trainer.max_steps == 1563
    assert cfg.optim.lr == pytest.approx(4e-3)
    assert cfg.schedule.kwargs.warmup_fraction == pytest.approx(0.128)
    assert cfg.schedule.kwargs.degree == 0.5
    assert cfg.optim.weight_decay == pytest.approx(0.01)  # inherited
    assert cfg.trainer.grad_clip == 1.0
    assert "bert_large_phase1" in cfg.trainer.init_from


@pytest.mark.parametrize(
    ("global_batch", "micro", "world", "accumulation"),
    [(65536, 64, 8, 128), (65536, 256, 8, 32), (32768, 8, 8, 512), (32, 32, 1, 1), (32, 8, 2, 2)],
)
def test_accumulation_derives_from_global_batch(global_batch, micro, world, accumulation):
    cfg = compose([f"trainer.global_batch_size={global_batch}", f"trainer.micro_batch_size={micro}"])
    assert batch_geometry(cfg.trainer, world).accumulation_steps == accumulation


@pytest.mark.parametrize(
    ("global_batch", "world", "cap", "micro"),
    [(32, 1, 32, 32), (32, 2, 32, 16), (32, 3, 32, None), (96, 2, 32, 24), (65536, 8, 64, 64), (30, 1, 8, 6)],
)
def test_unset_micro_batch_is_derived_for_the_world_size(global_batch, world, cap, micro):
    cfg = compose([f"trainer.global_batch_size={global_batch}", f"trainer.max_micro_batch_size={cap}"])
    assert cfg.trainer.micro_batch_size is None  # the default: derived
    if micro is None:
        with pytest.raises(ConfigError, match=f"global_batch_size={global_batch} is not divisible by the world size"):
            batch_geometry(cfg.trainer, world)
        return
    geometry = batch_geometry(cfg.trainer, world)
    assert geometry.micro_batch_size == micro
    assert geometry.micro_batch_size * geometry.accumulation_steps * world == global_batch


def test_indivisible_micro_batch_error_suggests_one():
    cfg = compose(["trainer.global_batch_size=32", "trainer.micro_batch_size=32"])
    with pytest.raises(ConfigError, match=r"micro_batch_size=32 x world size 2: try trainer\.micro_batch_size=16"):
        batch_geometry(cfg.trainer, 2)


def test_indivisible_batch_is_an_error():
    cfg = compose(["trainer.global_batch_size=100", "trainer.micro_batch_size=32"])
    with pytest.raises(ConfigError, match=r"trainer\.global_batch_size=100 .* trainer\.micro_batch_size=32"):
        validate(cfg)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("trainer.max_steps=0", "trainer.max_steps"),
        ("trainer.epochs=2", "trainer.epochs"),
        ("optim.lr=-1", "optim.lr"),
        ("data.masking=sometimes", "data.masking"),
        ("+optim.momentum=0.9", "optim.momentum"),
        ("+model.depth=3", "model.depth"),
        ("optim.name=sgdd", "optim.name"),
        ("data.max_predictions=200", "data.max_predictions"),
        ("schedule.kwargs.warmup_fraction=1.5", "schedule"),
        ("optim.lr=fast", "optim.lr=fast must be a number"),
        ("optim.betas=[0.9,1.5]", "optim.betas"),
        ("schedule.kwargs.warmup_fraction=a", "schedule.kwargs.warmup_fraction=a must be a number"),
        ("model.num_attention_heads=3", "model.num_attention_heads=3 does not divide"),
        ("model.hidden_size=big", "model.hidden_size=big must be an integer"),
        ("data.max_seq_len=1024", "data.max_seq_len=1024 exceeds model.max_position_embeddings=512"),
        ("data.num_workers=-1", "data.num_workers=-1 must be >= 0"),
        ("trainer.max_micro_batch_size=0", "trainer.max_micro_batch_size"),
        ("trainer.grad_allreduce_dtype=fp8", "trainer.grad_allreduce_dtype=fp8"),
        ("optim=slamb trainer.grad_allreduce_dtype=fp16", "trainer.grad_allreduce_dtype=fp16 sets DDP's gradient"),
        ("precision.dtype=fp8", "precision.dtype=fp8"),
    ],
)
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as info:
        validate(compose(override.split()))
    assert "\n" not in str(info.value)


def test_an_appended_key_no_schema_declares_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"^trainer\.max_stpes is not a key of trainer; did you mean "
                                          r"trainer\.max_steps\?$"):
        validate(compose([*TINY, "+trainer.max_stpes=5"]))


@pytest.mark.parametrize(("args", "line"), [
    (["+trainer.max_stpes=5"], "config error: trainer.max_stpes is not a key of trainer; did you mean "
                                "trainer.max_steps?"),
    (["optim=nope", "--cfg", "job"], "config error: In 'config': Could not find 'optim/nope'; options: "
                                     f"{', '.join(list_optimizers())}"),  # conf/optim/, one to one with the registry
    (["trainer.max_stpes=5", "--cfg", "job"], "config error: Could not override 'trainer.max_stpes': Key "
                                              "'max_stpes' not in 'TrainerConfig'"),
    (["name=café", "--cfg", "job"], "config error: cannot parse override 'name=café' ("),
])
def test_cli_errors_are_one_line_with_exit_code_2(tmp_path, args, line):
    result = run_train([*TINY, f"hydra.run.dir={tmp_path / 'run'}", *args], timeout=120)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith(line), result.stderr
    assert not (tmp_path / "run" / ".hydra").exists()


@pytest.mark.slow
def test_cli_rejects_bad_key_and_value_before_training(tmp_path):
    bad_key = run_train(["trainer.no_such_key=1", f"hydra.run.dir={tmp_path}"], timeout=120)
    assert bad_key.returncode != 0
    assert "trainer.no_such_key" in bad_key.stderr
    bad_value = run_train(["trainer.global_batch_size=33", "trainer.micro_batch_size=32", f"hydra.run.dir={tmp_path}"],
                          timeout=120)
    assert bad_value.returncode == 2
    assert bad_value.stderr.strip().splitlines()[-1].startswith("config error: trainer.global_batch_size=33")
    assert not (tmp_path / "checkpoints").exists()
    bad_enum = run_train(["precision.dtype=fp8", f"hydra.run.dir={tmp_path}"], timeout=120)
    assert bad_enum.returncode != 0 and "precision.dtype" in bad_enum.stderr


@pytest.mark.slow
@pytest.mark.parametrize("spelling", ["experiment", "+experiment"])
def test_cli_prints_phase1_recipe(spelling):
    result = run_train([f"{spelling}=bert_large_phase1", "--cfg", "job"], timeout=120)
    assert result.returncode == 0, result.stderr
    for fragment in ("global_batch_size: 65536", "lr: 0.006", "warmup_fraction: 0.2843", "max_steps: 7038"):
        assert fragment in result.stdout


@pytest.mark.slow
def test_multirun_sweep(tmp_path):
    args = ["-m", *TINY, "trainer.max_steps=2", "optim=lamb,adamw", f"hydra.sweep.dir={tmp_path}"]
    result = run_train(args, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = sorted(p.name for p in tmp_path.iterdir() if (p / "metrics.jsonl").exists())
    assert runs == ["0", "1"], runs


@pytest.mark.slow
def test_cli_rejects_a_bad_optimizer_value_before_any_worker_starts(tmp_path):
    result = run_train(["trainer.nproc_per_node=2", "optim=slamb", "optim.beta3=2", f"hydra.run.dir={tmp_path}"],
                       timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("config error: optim.beta3=2")
    assert "Traceback" not in result.stderr and "rank" not in result.stderr.lower()
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("experiment", ["bert_large_phase1", "bert_large_phase2_slamb", "swin_base_imagenet"])
def test_cluster_recipes_refuse_to_run_without_their_dataset(experiment):
    with pytest.raises(ConfigError, match=r"^data\.path is not set: give data\.path=\.\.\.") as info:
        validate(compose([f"experiment={experiment}", "trainer.device=cpu"]))
    assert "\n" not in str(info.value)
    assert compose([f"experiment={experiment}"]).data.name != "demo"  # never the demo corpus in silence


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a machine without CUDA gives")
def test_cuda_without_a_device_is_a_config_error():
    with pytest.raises(ConfigError, match=r"^trainer\.device=cuda but no CUDA device is visible"):
        validate(compose(["trainer.device=cuda"]))
