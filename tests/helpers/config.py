"""The real config tree at test scale: the repository's root, the overrides that shrink a run, and compose()."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A model and batch small enough for ~10 ms steps, on the real config tree.
TINY = [
    "model.hidden_size=32",
    "model.num_hidden_layers=1",
    "model.num_attention_heads=2",
    "model.intermediate_size=64",
    "data.max_seq_len=32",
    "data.max_predictions=5",
    "data.dupe_factor=1",
    "data.heldout_sequences=0",  # no evaluation: the records are the training series (evaluation tests ask for one)
    "trainer.max_steps=6",
    "trainer.global_batch_size=8",
    "trainer.micro_batch_size=4",
    "trainer.log_every=1",
    "trainer.checkpoint_every=2",
    "trainer.device=cpu",
    "logger.progress_bar=false",
    "logger.tensorboard=false",
    "logger.wandb=disabled",
]

# BERT without dropout: runs that should agree to float rounding (accumulation, compiled or not, another world size).
NO_DROPOUT = ["model.hidden_dropout_prob=0.0", "model.attention_probs_dropout_prob=0.0"]

# The SQuAD demo on TINY's model and the vendored vocab instead of the demo model's (whose weights it still starts
# from unless `trainer.init_from` is overridden): one epoch.
QA_TINY = [
    "experiment=squad_demo", "model.config_from=null", "model.size=tiny", "model.hidden_size=32",
    "model.num_hidden_layers=1", "model.num_attention_heads=2", "model.intermediate_size=64", "data.vocab_path=null",
    "data.max_seq_len=64", "data.doc_stride=32", "data.max_query_len=16", "trainer.epochs=1",
    "trainer.device=cpu", "logger.progress_bar=false", "logger.tensorboard=false", "logger.wandb=disabled",
]


def swin_digits_overrides(digits: Path, run_dir: Path, *overrides: str) -> list[str]:
    """The Swin digits demo on the digits folder `digits`: 4 steps, evaluated and checkpointed every 2."""
    return [
        "experiment=swin_demo", f"data.path={digits}", "trainer.epochs=null", "trainer.max_steps=4",
        "trainer.global_batch_size=16", "trainer.micro_batch_size=8", "trainer.log_every=1",
        "trainer.checkpoint_every=2", "trainer.eval_every=2", "trainer.device=cpu", "data.eval_batch_size=180",
        "logger.progress_bar=false", "logger.tensorboard=false", "logger.wandb=disabled",
        f"hydra.run.dir={run_dir}", *overrides,
    ]


def compose(overrides: list[str] | None = None):
    """The config `python -m train <overrides>` would run with."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from train.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides or [])


def optim_preset(name: str) -> dict:
    """conf/optim/<name>.yaml as `build_optimizer` takes it: its keys but `name` (PyYAML is stricter than OmegaConf:
    `6e-3` would be a string, so the presets write `6.0e-3`)."""
    import yaml

    cfg = yaml.safe_load((REPO / "conf" / "optim" / f"{name}.yaml").read_text())
    cfg.pop("name")
    return cfg
