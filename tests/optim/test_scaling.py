"""The alpha-beta cost model (optim.network) against hand-computed cases, and trainer.simulated_network's check."""

from __future__ import annotations

import pytest
from helpers.config import compose
from helpers.runs import run_train

from core.errors import ConfigError
from optim.network import LINKS, Cluster, collective_seconds, parse_cluster, ring_all_reduce_seconds
from train.config import validate

NET_ALPHA, NVLINK_ALPHA = 14e-6, 3.4e-6
IB100_NODES_OF_8 = Cluster(LINKS["ib100"], 8, LINKS["nvlink3"])  # 12.5 GB/s between nodes, 300 GB/s inside


def test_presets_are_the_nominal_rates_per_direction():
    assert LINKS["10gbe"].bandwidth == 1.25e9 and LINKS["ib200"].bandwidth == 25e9
    assert LINKS["nvlink3"].bandwidth == 300e9 and LINKS["nvlink2"].bandwidth == 150e9
    assert LINKS["100gbe"].latency == NET_ALPHA and LINKS["nvlink3"].latency == NVLINK_ALPHA


def test_ring_all_reduce():
    # 2 * 3/4 * 1e9 B / 1.25e9 B/s = 1.2 s, plus 2 * 3 steps of 14 us
    assert ring_all_reduce_seconds(1e9, 4, LINKS["10gbe"]) == pytest.approx(1.2 + 6 * NET_ALPHA, rel=1e-12)


def test_flat_cluster_all_reduce_is_the_ring():
    one_per_node = Cluster(LINKS["10gbe"])
    assert collective_seconds("all_reduce", 1e9, 4, one_per_node) == pytest.approx(1.2 + 6 * NET_ALPHA, rel=1e-12)


def test_hierarchical_all_reduce():
    # 16 ranks, 8 per node, 8e8 bytes: reduce-scatter 7/8 * 8e8 / 3e11 + 7 alpha_nv; inter-node ring over 2 nodes
    # 2 * 1/2 * 8e8 / 1.25e10 + 2 alpha_net; all-gather of 1e8-byte shards 7 * 1e8 / 3e11 + 7 alpha_nv
    expected = (7e8 / 3e11 + 7 * NVLINK_ALPHA) + (0.064 + 2 * NET_ALPHA) + (7e8 / 3e11 + 7 * NVLINK_ALPHA)
    assert collective_seconds("all_reduce", 8e8, 16, IB100_NODES_OF_8) == pytest.approx(expected, rel=1e-12)


def test_all_reduce_within_one_node_is_the_nvlink_ring():
    expected = ring_all_reduce_seconds(8e8, 8, LINKS["nvlink3"])  # 2 * 7/8 * 8e8 / 3e11 + 14 * 3.4 us
    assert expected == pytest.approx(2 * 7e8 / 3e11 + 14 * NVLINK_ALPHA, rel=1e-12)
    assert collective_seconds("all_reduce", 8e8, 8, IB100_NODES_OF_8) == pytest.approx(expected, rel=1e-12)
    assert collective_seconds("all_reduce", 8e8, 2, IB100_NODES_OF_8) == pytest.approx(
        8e8 / 3e11 + 2 * NVLINK_ALPHA, rel=1e-12)  # a world smaller than a node fills one node


def test_all_gather():
    # 1e6 bytes per rank, 16 ranks in 2 nodes: 8 concurrent 2-node rings put 8e6 bytes through the node's link
    # (8e6 / 1.25e10 + 1 alpha_net), then each rank gathers the 2e6 bytes of its 7 node peers over NVLink
    expected = (8e6 / 1.25e10 + NET_ALPHA) + (7 * 2e6 / 3e11 + 7 * NVLINK_ALPHA)
    assert collective_seconds("all_gather", 1e6, 16, IB100_NODES_OF_8) == pytest.approx(expected, rel=1e-12)
    # one rank per node: the ring, (p - 1) * n / B + (p - 1) alpha
    assert collective_seconds("all_gather", 1e6, 4, Cluster(LINKS["10gbe"])) == pytest.approx(
        3 * 1e6 / 1.25e9 + 3 * NET_ALPHA, rel=1e-12)


def test_all_to_all():
    # 1.6e6 bytes per rank, 16 ranks, 8 per node: half of each rank's chunks leave the node, 8 ranks' worth through
    # the link (8 * 1/2 * 1.6e6 / 1.25e10), 8 network peers; 7/16 of it over NVLink, 7 NVLink peers
    expected = (8 * 0.5 * 1.6e6 / 1.25e10 + 8 * NET_ALPHA) + (7 / 16 * 1.6e6 / 3e11 + 7 * NVLINK_ALPHA)
    assert collective_seconds("all_to_all", 1.6e6, 16, IB100_NODES_OF_8) == pytest.approx(expected, rel=1e-12)
    assert collective_seconds("all_to_all", 1e6, 4, Cluster(LINKS["10gbe"])) == pytest.approx(
        0.75 * 1e6 / 1.25e9 + 3 * NET_ALPHA, rel=1e-12)


def test_broadcast():
    # pipelined chains: 1e9 / 1.25e10 + 1 alpha_net across 2 nodes, 1e9 / 3e11 + 7 alpha_nv inside them
    expected = (0.08 + NET_ALPHA) + (1e9 / 3e11 + 7 * NVLINK_ALPHA)
    assert collective_seconds("broadcast", 1e9, 16, IB100_NODES_OF_8) == pytest.approx(expected, rel=1e-12)
    assert collective_seconds("broadcast", 1e9, 4, Cluster(LINKS["10gbe"])) == pytest.approx(
        0.8 + 3 * NET_ALPHA, rel=1e-12)


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "all_to_all", "broadcast"])
def test_a_world_of_one_costs_nothing(kind):
    assert collective_seconds(kind, 1e9, 1, IB100_NODES_OF_8) == 0.0


def test_parse_cluster():
    assert parse_cluster("10gbe") == Cluster(LINKS["10gbe"], 1, LINKS["nvlink3"])
    assert parse_cluster("ib100:8:nvlink2") == Cluster(LINKS["ib100"], 8, LINKS["nvlink2"])
    for bad in ("5gbe", "ib100:0", "ib100:eight", "ib100:8:nvlink9", "ib100:8:nvlink3:x", "nvlink3"):
        with pytest.raises(ValueError, match="NETWORK"):
            parse_cluster(bad)


def test_config_check_names_the_key():
    validate(compose(["trainer.simulated_network=ib100:8"]))
    with pytest.raises(ConfigError, match=r"^trainer\.simulated_network=5gbe must be NETWORK") as info:
        validate(compose(["trainer.simulated_network=5gbe"]))
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_cli_rejects_a_bad_preset_with_exit_2(tmp_path):
    result = run_train(["trainer.simulated_network=5gbe", f"hydra.run.dir={tmp_path}"], timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("config error: trainer.simulated_network=5gbe")


def test_scaled_step_cost_splits_buckets_and_shares_the_all_gather():
    from benchmarks.paper.scaling import DDP_BUCKET_BYTES, Profile, comm_cost

    one_per_node = Cluster(LINKS["10gbe"])
    # fp32 gradients of 100M parameters: 4e8 bytes in 25 MiB buckets -> 16 all-reduces of 2.5e7 bytes on 4 ranks
    ddp = Profile({"cycle": [[("all_reduce", 4.0)]]}, ["cycle"], ["cycle"], DDP_BUCKET_BYTES)
    cost = comm_cost(ddp, ddp.schedule, 100_000_000, 4, one_per_node)
    assert cost["collectives"] == 16 and cost["bits_per_param"] == pytest.approx(32.0)
    assert cost["comm_s"] == pytest.approx(16 * ring_all_reduce_seconds(2.5e7, 4, LINKS["10gbe"]), rel=1e-12)
    # a gathered 1/8 byte per parameter: each of 4 ranks puts in a quarter; a dense step every other step
    onebit = Profile({"dense": [[("all_reduce", 4.0)]], "compressed": [[("all_to_all", 0.125), ("all_gather", 0.125)]]},
                     ["dense", "compressed"], ["compressed"], None)
    steady = comm_cost(onebit, onebit.steady, 8_000_000, 4, one_per_node)
    assert steady["bits_per_param"] == pytest.approx(1.0 + 0.25) and steady["collectives"] == 2
    assert steady["comm_s"] == pytest.approx(0.75 * 1e6 / 1.25e9 + 3 * NET_ALPHA + 3 * 2.5e5 / 1.25e9 + 3 * NET_ALPHA)
    schedule = comm_cost(onebit, onebit.schedule, 8_000_000, 4, one_per_node)
    assert schedule["bits_per_param"] == pytest.approx((32 + 1.25) / 2) and schedule["collectives"] == 1.5


def test_measured_onebit_lamb_profile_is_one_bit_plus_the_gathered_share():
    from benchmarks.paper.scaling import MEASURE_WORLD, measure_profile

    profile = measure_profile("onebit_lamb", "fp32")
    (compressed,) = {tuple(kind for kind, _ in step) for step in profile.steps["compressed"]}
    assert compressed == ("all_to_all", "all_gather")  # one fused call over all momenta: two collectives
    bits = [8 * per_param for kind, per_param in profile.steps["compressed"][0]]
    assert bits[0] == pytest.approx(1.0, rel=1e-3) and bits[1] == pytest.approx(1.0, rel=1e-3)  # gathered: 1 bit
    assert [8 * b for _, b in profile.steps["dense"][0]] == [pytest.approx(32.0)]  # warm-up: fp32 momenta
    assert set(profile.steady) == {"compressed"} and MEASURE_WORLD == 8


def test_scaling_plot_is_a_png_with_a_panel_per_model(tmp_path):
    from benchmarks.paper.plots import write_scaling_plot

    rows = [dict(model=model, optimizer=opt, gpus=g, network="10gbe", efficiency=1 / (1 + g / 64))
            for model in ("bert_large", "swin_base") for opt in ("lamb", "slamb") for g in (8, 64, 1024)]
    path = write_scaling_plot(rows, tmp_path / "scaling.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


@pytest.mark.parametrize("args, error", [
    (["--gpus", "0", "8"], "error: --gpus 0: GPU counts must be >= 1"),
    (["--throughput", "bert_large"], "error: --throughput bert_large: must be MODEL=SAMPLES_PER_S"),
    (["--throughput", "bert_large=fast"], "error: --throughput bert_large=fast: must be a positive number"),
    (["--throughput", "bert_lage=600"], "error: --throughput bert_lage: unknown model; choose from bert_large, "),
    (["--optimizers", "lamb", "sgd_plus"], "error: --optimizers sgd_plus: not runnable here; choose from "),
    (["--runs", "{tmp}/nowhere"], "error: --runs {tmp}/nowhere: no summary.json there (not a finished run directory)"),
])
def test_bad_arguments_exit_2_with_one_line(args, error, tmp_path, capsys, monkeypatch):
    from benchmarks.paper import scaling

    monkeypatch.setattr(scaling, "study", lambda *_: pytest.fail("the study started"))
    with pytest.raises(SystemExit) as info:
        scaling.main([a.format(tmp=tmp_path) for a in args])
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(error.format(tmp=tmp_path))


def test_curves_that_would_hide_each_other_are_one_line_named_after_both(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from benchmarks.paper import plots

    drawn = []
    monkeypatch.setattr(plots, "atomic_write", lambda path, write: drawn.append(plt.gcf()))
    efficiency = {"lamb": 1.0, "adamw": 1.0, "slamb": 1.002, "onebit_lamb": 1.3}  # slamb within 1 % of the height
    rows = [dict(model="bert_large", optimizer=opt, gpus=g, network="ib100", efficiency=0.5 / (1 + g / 64) * scale)
            for opt, scale in efficiency.items() for g in (8, 64, 1024)]
    plots.write_scaling_plot(rows, tmp_path / "scaling.png")
    lines = drawn[0].axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["lamb = adamw = slamb", "onebit_lamb"]
    assert len({(line.get_marker(), line.get_linestyle()) for line in lines}) == 2
