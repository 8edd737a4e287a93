"""JointSpar (Liu & Mozafari, ICML 2022), as reconstructed here: each step only a sampled set of layers computes,
sends and applies its weight gradient, rescaled by 1/p so that the update stays unbiased, and the layers'
sampling probabilities are learned online by a bandit rule.

RECONSTRUCTION: neither the paper's full text nor code was available when this was written; only its abstract.
The step structure, the bandit rule, the projection and the LARS/LAMB rescaling below are this project's reading
of it (importance sampling of layers in the style of the authors' earlier ADAMBS), not a transcription. Every
output that names JointSpar should be read with that in mind; the LAMB base is a project extension.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from core.options import check_choice, check_non_negative, require
from optim._jointspar_bases import Sampled, lamb_, lars_, sgd_, uses_state
from optim._math import closure_loss, grad_prenorm_divisor, mask_seed
from optim._registry import OptimSpec, named_by, register_optimizer, run_check
from optim.base_optimizer import BaseWrapper, build_base, check_base_options
from optim.comm import Comm, average_tensors_
from optim.flat import FlatLayout, FlatState, pop_flat_entries
from optim.memory import wrapper_bytes

_GLOBAL = "jointspar"  # key of the optimizer-wide entry of `self.state`
BASES = ("sgd", "lars", "lamb")
GRANULARITIES = ("block", "tensor")
UNSAMPLED_POLICIES = ("freeze", "decay")


@dataclass(frozen=True)
class Layer:
    """A unit of sampling: parameters that compute, send and apply their gradients together."""

    name: str
    params: tuple[Tensor, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def layer_name(param_name: str, granularity: str) -> str:
    """The layer a parameter belongs to.

    `block`: a numbered block, the name up to its last index (`bert.encoder.layer.3`, Swin's
    `layers.1.blocks.0`, `0` of an `nn.Sequential`), so that a whole transformer block skips its weight
    gradients; outside numbered blocks, the first two levels of the module path (`bert.embeddings`,
    `cls.predictions`, `head.fc`). `tensor`: every parameter tensor is a layer.
    """
    if granularity == "tensor":
        return param_name
    modules = param_name.split(".")[:-1]
    indices = [i for i, part in enumerate(modules) if part.isdigit()]
    if indices:
        return ".".join(modules[: indices[-1] + 1])
    return ".".join(modules[:2]) or param_name


def systematic_sample(probabilities: Tensor, generator: torch.Generator) -> Tensor:
    """A bool mask selecting exactly `round(sum(p))` layers, layer `d` with probability exactly `p[d]`.

    Systematic sampling over a random order (Madow's unequal-probability design): the layers' probabilities
    are laid end to end in a random order, and one uniform offset places `k` points one unit apart; a layer is
    selected when a point falls in its interval. Unlike independent Bernoulli draws, every step computes and
    sends the same number of layers and none is empty, while each layer's inclusion probability, which is all
    that the 1/p rescaling needs for unbiasedness, is the same.
    """
    order = torch.randperm(probabilities.numel(), generator=generator)
    ends = probabilities[order].cumsum(0)
    total = float(ends[-1])
    count = max(1, round(total))
    offset = torch.rand(1, generator=generator, dtype=torch.float64)
    points = (offset + torch.arange(count, dtype=torch.float64)) * (total / count)
    hits = torch.searchsorted(ends, points, right=True).clamp_(max=probabilities.numel() - 1)
    sampled = torch.zeros(probabilities.numel(), dtype=torch.bool)
    sampled[order[hits]] = True
    return sampled


def project_to_budget(weights: Tensor, budget: float, p_min: float) -> Tensor:
    """The KL projection of positive `weights` onto {p : sum p = budget, p_min <= p <= 1}.

    The minimiser is `clip(c w, p_min, 1)` for the one scale `c` whose clipped sum is the budget; that sum is
    piecewise linear and non-decreasing in `c` with kinks at `p_min / w` and `1 / w`, so `c` is found exactly
    between the two kinks that bracket the budget (no iteration).
    """
    if budget >= weights.numel():
        return torch.ones_like(weights)
    w = weights.clamp(min=torch.finfo(weights.dtype).tiny)
    kinks = torch.cat([p_min / w, 1.0 / w]).sort().values
    totals = (kinks[:, None] * w[None, :]).clamp(p_min, 1.0).sum(1)
    j = int(torch.searchsorted(totals, torch.tensor([budget], dtype=totals.dtype)))
    if j == 0:  # budget = number of layers x p_min: every layer at the floor
        scale = kinks[0]
    else:
        (c0, c1), (f0, f1) = kinks[j - 1 : j + 1].tolist(), totals[j - 1 : j + 1].tolist()
        scale = c0 + (budget - f0) * (c1 - c0) / (f1 - f0)
    return (scale * w).clamp(p_min, 1.0)


def bandit_update(
    probabilities: Tensor, sampled: Tensor, norms: Tensor, scale: float, budget: float, p_min: float, eta: float
) -> Tensor:
    r"""The next layer probabilities from this step's gradient norms of the sampled layers (all float64, host).

    The per-step cost of sampling is :math:`f(p) = \sum_d \lVert g^d \rVert^2 / p^d` (the variance the 1/p
    rescaling adds), minimised for a fixed budget by :math:`p^d \propto \lVert g^d \rVert`. The layers' norms
    are seen only when sampled, so the probabilities follow exponentiated gradient descent on :math:`f` with the
    importance-weighted gradient estimate (an EXP3-style bandit):
    :math:`w^d = p^d \exp(\eta\, Z^d \lVert g^d \rVert^2 / (N (p^d)^3))`, then `project_to_budget`.
    :math:`Z^d` is 1 for sampled layers and :math:`N` (`scale`) the largest per-step estimate
    :math:`\sum_{d \in S} \lVert g^d \rVert^2 / p^d` of :math:`\lVert g \rVert^2` seen so far, so that
    ``eta`` does not depend on the gradients' scale. The exponent is taken in log space (the projection ignores
    a common factor), so no weight overflows.

    Unlike the ADAMBS-style rule this reconstruction started from, the loss is not shifted by its bound to make
    it non-negative: a shift given to the sampled layers only adds noise that, on a 6-layer problem with known
    norms, kept p within 0.2 of uniform after 2,000 steps, where this rule reaches the cost's optimum to 0.1 %.
    """
    if eta == 0 or scale <= 0:  # nothing learned: stay exactly where they are (a projection rounds)
        return probabilities
    gains = torch.zeros_like(probabilities)
    gains[sampled] = norms[sampled].square() / (scale * probabilities[sampled].pow(3))
    log_weights = probabilities.log() + eta * gains
    return project_to_budget((log_weights - log_weights.max()).exp(), budget, p_min)


def cost_estimate(probabilities: Tensor, sampled: Tensor, norms: Tensor) -> float:
    """This step's unbiased estimate of the squared norm of the full gradient: sum over S of ||g^d||^2 / p^d."""
    return float((norms[sampled].square() / probabilities[sampled]).sum())


class JointSpar(BaseWrapper):
    r"""JointSpar (Liu & Mozafari, ICML 2022) over a base optimizer: sparse computation and communication by
    sampling layers. RECONSTRUCTED from the paper's abstract, not verified against its full text (see the module
    docstring); with ``base="lamb"`` a project extension the paper does not describe.

    Register with ``grad_sync="self"`` and ``samples_layers=True``. Per optimizer step :math:`t`:

    1. `begin_step` (before the step's forward pass) draws the layer set :math:`S_t` with `systematic_sample`
       from a private generator seeded by ``(seed, t)`` and the probabilities :math:`p_t`, identical on every
       rank, and switches ``requires_grad`` off for the parameters of the other layers: backward computes no
       weight gradient for them, and stops below the lowest sampled layer.
    2. `step` averages the sampled layers' gradients over the ranks in one all-reduce (fp32), nothing else.
    3. Unbiased rescaling by :math:`1/p_t^d`: SGD rescales its direction, :math:`(g^d + \lambda x^d) / p^d`,
       before its momentum; LARS, whose trust ratio cancels any factor on the gradient, rescales its
       trust-ratio direction before its momentum (the paper's per-layer LR, which LARS's Algorithm 1 puts inside
       the buffer); LAMB, whose moments are normalised, takes its step with the layer's LR :math:`\gamma / p^d`.
       Either way the expected direction is the base's. (Scaling LARS's step after its momentum instead
       amplified rare large steps: on an MLP it diverged at an LR where LARS trains.)
    4. The base's update steps the sampled layers, all of them in the same multi-tensor ops with a per-tensor
       1/p (`optim._jointspar_bases`: ops per step independent of the number of layers). Unsampled ones, with
       ``unsampled="freeze"``, keep weights and state; with ``"decay"`` their state sees a zero gradient (momenta
       decay) while their weights do not move (LR and weight decay 0 for that step).
    5. `bandit_update` turns the sampled layers' norms into :math:`p_{t+1}` (floor ``p_min``, sum
       :math:`k`), learning :math:`p \propto \lVert g^d \rVert`, the least-variance choice; the norms are the
       averaged gradients', so every rank computes the same probabilities.

    Layers are named blocks of the model (`layer_name`); there are :math:`D` of them and
    :math:`k = \max(1, \mathrm{round}(\text{sample\_ratio} \cdot D))` are sampled per step;
    :math:`p_{min} D \le k` is required. With :math:`k = D` every layer is always sampled with
    :math:`p = 1`, and this is the base optimizer on averaged gradients.

    Args:
        params: ``(name, parameter)`` pairs or groups of them (``model.named_parameters()``, or the trainer's
            weight-decay groups); plain tensors only with ``granularity="tensor"``.
        lr, weight_decay: the base's, set per step by the trainer's schedule.
        base: ``"sgd"`` (``torch.optim.SGD``), ``"lars"`` or ``"lamb"``.
        base_options: the base's other keyword arguments; unset ones are the base's defaults.
        sample_ratio: :math:`k / D`, the expected share of layers per step (the speed/variance knob).
        p_min: floor of every layer's probability.
        eta_p: the bandit's step size; 0 keeps the uniform :math:`k / D` (layer-random-k).
        granularity: ``"block"`` or ``"tensor"`` (see `layer_name`).
        unsampled: ``"freeze"`` or ``"decay"`` (step 4).
        seed: seeds the layer draws; every rank must be given the same.
        comm: the communication layer; None builds one over the default process group (or a world of one).

    Traffic: 32 bits per sampled parameter per step, nothing else. Cost: one host read per step, of the
    :math:`D` layer norms, since the next layer set (and with it the autograd graph) depends on them.

    State (all in `state_dict()`, under ``"jointspar"``, as host numbers): the step, the seed, the
    probabilities and the bandit's scale :math:`N`; under ``"base"``, the base's param groups (one per given group
    and layer; LAMB's hold its step count) and its per-element state (SGD's and LARS's ``momentum_buffer``,
    LAMB's ``exp_avg`` and ``exp_avg_sq``), views of one flat buffer per key (`optim.flat`, loaded in place). A
    tensor's state appears at its first step, as the base makes it. No hyper-parameter value is known from the
    paper; the defaults are this project's.

    Rounding: with the SGD base the direction is formed as :math:`(g + \lambda x) \cdot (1/p)` and stepped in
    torch's fused SGD kernel, a few units in the last place from ``torch.optim.SGD``; with LAMB, a tensor without
    the trust ratio (no weight decay) takes its layer's LR after the fused Adam direction instead of inside it, a
    unit in the last place per step from LAMB's own step. The trust-ratio tensors of LAMB and every LARS tensor
    step bit for bit as their base does.
    """

    def __init__(
        self,
        params: Any,
        lr: float = 6e-3,
        weight_decay: float = 0.0,
        base: str = "lamb",
        base_options: dict[str, Any] | None = None,
        sample_ratio: float = 0.5,
        p_min: float = 0.1,
        eta_p: float = 0.03,
        granularity: str = "block",
        unsampled: str = "freeze",
        seed: int = 0,
        comm: Comm | None = None,
    ) -> None:
        options = dict(lr=lr, weight_decay=weight_decay, base=base, base_options=base_options,
                       sample_ratio=sample_ratio, p_min=p_min, eta_p=eta_p, granularity=granularity,
                       unsampled=unsampled, seed=seed)
        run_check("JointSpar", check_jointspar_options, options)
        self.layers, base_groups, group_layer, group_given = _layers_and_groups(params, granularity)
        self.budget = max(1, round(sample_ratio * len(self.layers)))
        with named_by("JointSpar"):  # the model's layers: no config check sees them, so this always runs
            _check_budget(dict(p_min=p_min, layers=len(self.layers), budget=self.budget))
        self._adopt(build_base(base, base_groups, lr, weight_decay, base_options))
        self.base_name, self.unsampled = base, unsampled
        self.p_min, self.eta_p = float(p_min), float(eta_p)
        self.comm = comm if comm is not None else Comm()
        self.state[_GLOBAL] = {
            "step": 0, "seed": int(seed), "gain_scale": 0.0,
            "probabilities": [self.budget / len(self.layers)] * len(self.layers),  # host floats: no device state
        }
        self._sampled: Tensor | None = None  # this step's layer set, from `begin_step` to the end of `step`
        # Every parameter in the base's order (its param groups', the state_dict's): (layer, given group).
        self._params = [p for group in self.param_groups for p in group["params"]]
        self._places = [(layer, given) for group, layer, given in zip(self.param_groups, group_layer, group_given,
                                                                      strict=True) for _ in group["params"]]
        self._group_given = group_given
        self.flat = _flat_state(self._params, self.param_groups, uses_state(base, self.base.defaults))

    @property
    def probabilities(self) -> Tensor:
        """Each layer's probability of being sampled at the next step (float64, on the host)."""
        return torch.tensor(self.state[_GLOBAL]["probabilities"], dtype=torch.float64)

    def sampled_layers(self) -> list[bool]:
        """This step's layer set (drawn by `begin_step`), one flag per layer of `layers`."""
        if self._sampled is None:
            raise RuntimeError("JointSpar: no layer set drawn for this step; call begin_step() first")
        return self._sampled.tolist()

    def begin_step(self) -> None:
        """Draw this step's layers and let only theirs compute weight gradients. Call it after `zero_grad` and
        before the step's first forward pass; calling it again in the same step draws the same set."""
        glob = self.state[_GLOBAL]
        if self._sampled is None:
            generator = torch.Generator().manual_seed(mask_seed(glob["seed"], glob["step"]))
            self._sampled = systematic_sample(self.probabilities, generator)
        for layer, on in zip(self.layers, self._sampled.tolist(), strict=True):
            for p in layer.params:
                p.requires_grad_(on)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients and make every layer trainable again (a skipped or abandoned step leaves none off)."""
        super().zero_grad(set_to_none)
        self._all_layers_on()

    def _check_loaded_state(self) -> None:
        glob = self.state.get(_GLOBAL)
        if glob is None or len(glob["probabilities"]) != len(self.layers):
            raise ValueError("JointSpar.load_state_dict: no 'jointspar' entry for this model's "
                             f"{len(self.layers)} layers; not a JointSpar state_dict of this model")
        self._sampled = None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a `state_dict()`, the base's per-element state straight into the flat buffers (torch's loader would
        first copy it to the parameters' device)."""
        base, flat = pop_flat_entries(state_dict["base"], self.flat.buffers)
        super().load_state_dict({**state_dict, "base": base})
        for key, saved in flat.items():
            self.flat.load_(key, saved)
            for p, view, value in zip(self._params, self.flat.views(key), saved, strict=True):
                if value is not None:  # state the base made (at the tensor's first step), as saved
                    self.base.state[p][key] = view

    @torch.no_grad()
    def step(self, closure=None):
        """Average the sampled layers' gradients, step the base with each layer's 1/p, learn the next
        probabilities."""
        loss = closure_loss(closure)
        sampled = self.sampled_layers()
        glob = self.state[_GLOBAL]
        probabilities = self.probabilities
        if any(p.grad is not None for layer, on in zip(self.layers, sampled, strict=True) if not on
               for p in layer.params):
            raise RuntimeError("JointSpar: unsampled layers have gradients; call begin_step() after zero_grad() "
                               "and before the forward pass")
        on = [i for i, s in enumerate(sampled) if s]
        owner = [i for i in on for _ in self.layers[i].params]  # the layer of each sampled parameter
        params = [p for i in on for p in self.layers[i].params]
        unused = [p for p in params if p.grad is None]
        for p, zero in zip(unused, _zeros_like_each(unused), strict=True):
            p.grad = zero  # not used by this loss: a zero, so that every rank sends the same layout
        grads = _averaged([p.grad for p in params], self.comm)
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
        grad_norms = torch._foreach_norm(grads, 2, dtype=torch.float32) if grads else []
        norms = self._layer_norms(owner, grad_norms)  # the step's one host read
        self._step_base((1.0 / probabilities).tolist(), dict(zip(map(id, params), grad_norms, strict=True)))

        glob["gain_scale"] = max(glob["gain_scale"], cost_estimate(probabilities, self._sampled, norms))
        glob["probabilities"] = bandit_update(probabilities, self._sampled, norms, glob["gain_scale"],
                                              self.budget, self.p_min, self.eta_p).tolist()
        glob["step"] += 1
        self._sampled = None
        self._all_layers_on()
        return loss

    def _step_base(self, inverse: list[float], grad_norms: dict[int, Tensor]) -> None:
        """The base's step over the sampled layers, each tensor with its layer's 1/p, one set of multi-tensor ops
        per given param group (`optim._jointspar_bases`); with ``unsampled="decay"`` the others' state sees zero
        gradients. `grad_norms` (by parameter id) are the sampled gradients' norms, LAMB's global norm's too."""
        sampled = self._sampled.tolist()
        decaying = [p for p, (layer, _) in zip(self._params, self._places, strict=True)
                    if not sampled[layer]] if self.unsampled == "decay" and self.flat.buffers else []
        zeros = dict(zip(map(id, decaying), _zeros_like_each(decaying), strict=True))
        grad_divisor = None
        if self.base_name == "lamb":
            for group in self.param_groups:
                group["step"] = group.get("step", 0) + 1  # LAMB's: once per call, for every group
            max_grad_norm = self.base.defaults["max_grad_norm"]
            if max_grad_norm is not None and grad_norms:  # NVLAMB's norm over the gradients the base sees, in its order
                zero = torch.zeros((), device=self.flat.device)
                listed = [grad_norms.get(id(p), zero) for p in self._params if id(p) in grad_norms or id(p) in zeros]
                grad_divisor = grad_prenorm_divisor(torch.linalg.vector_norm(torch.stack(listed)), max_grad_norm)
        first_group: dict[int, dict[str, Any]] = {}  # given group -> its first base group: its layers' options
        for group, given in zip(self.param_groups, self._group_given, strict=True):
            first_group.setdefault(given, group)
        for given, group in first_group.items():
            for decay_step, scales in ((False, inverse), (True, None)):
                batch = self._batch(given, scales, zeros if decay_step else None)
                if not batch.params:
                    continue
                for chunk in batch.chunks():
                    if self.base_name == "lamb":
                        lamb_(chunk, group, None if decay_step else grad_divisor, decay_step)
                    else:
                        (sgd_ if self.base_name == "sgd" else lars_)(chunk, group, decay_step)

    def _batch(self, given: int, inverse: list[float] | None, zeros: dict[int, Tensor] | None) -> Sampled:
        """Given group `given`'s tensors the step moves, in the base's order, their state made where new: the
        sampled ones with their gradients and 1/p (`inverse`), or the decaying ones with their `zeros`."""
        sampled = self._sampled.tolist()
        keys = list(self.flat.buffers)
        batch = Sampled([], [], {key: [] for key in keys}, [], [])
        for index, (p, (layer, group)) in enumerate(zip(self._params, self._places, strict=True)):
            moves = sampled[layer] if zeros is None else id(p) in zeros
            if group != given or not moves:
                continue
            state = self.base.state[p]
            batch.fresh.append(bool(keys) and keys[0] not in state)
            for key in keys:
                batch.state[key].append(state.setdefault(key, self.flat.views(key)[index]))
            batch.params.append(p)
            batch.grads.append(p.grad if zeros is None else zeros[id(p)])
            batch.scales.append(inverse[layer] if inverse is not None else 0.0)
        return batch

    def _layer_norms(self, owner: list[int], grad_norms: list[Tensor]) -> Tensor:
        """Every layer's gradient L2 norm (0 for unsampled ones) as float64 on the host, from its tensors' norms;
        `owner[j]` is the layer of `grad_norms[j]`."""
        norms = torch.zeros(len(self.layers), dtype=torch.float64)
        if not grad_norms:
            return norms
        squares = torch.stack(grad_norms).double().square().cpu()
        return norms.index_add_(0, torch.tensor(owner), squares).sqrt_()

    def _all_layers_on(self) -> None:
        for layer in self.layers:
            for p in layer.params:
                p.requires_grad_(True)


def _flat_state(params: list[Tensor], groups: list[dict[str, Any]], keys: tuple[str, ...]) -> FlatState:
    """The base's per-element state as flat buffers (`optim.flat`), one per key, in the base's parameter order;
    a tensor's views join the base's `state` at its first step, where the base would make its state."""
    if len({(p.device, p.dtype) for p in params}) > 1:
        raise ValueError("JointSpar keeps its base's state in flat buffers: all parameters must share one device "
                         "and dtype")
    slot_groups = [index for index, group in enumerate(groups) for _ in group["params"]]
    flat = FlatState(FlatLayout.packed([p.shape for p in params], slot_groups), params[0].device, params[0].dtype)
    for key in keys:
        flat.add(key)
    return flat


def _averaged(grads: list[Tensor], comm: Comm) -> list[Tensor]:
    """`grads` averaged over the ranks in one fp32 all-reduce (`average_tensors_`), as views of the one vector it
    averages: they stay there, not copied back."""
    if not comm.distributed or not grads:
        return grads
    flat = torch.cat([g.reshape(-1) for g in grads])
    average_tensors_([flat], comm)
    return [piece.view_as(g) for piece, g in zip(flat.split([g.numel() for g in grads]), grads, strict=True)]


def _zeros_like_each(tensors: list[Tensor]) -> list[Tensor]:
    """A zero tensor like each of `tensors` (one device and dtype), views of one buffer: one op, not one each."""
    if not tensors:
        return []
    buffer = torch.zeros(sum(t.numel() for t in tensors), device=tensors[0].device, dtype=tensors[0].dtype)
    return [piece.view_as(t) for piece, t in zip(buffer.split([t.numel() for t in tensors]), tensors, strict=True)]


def _layers_and_groups(params: Any, granularity: str
                       ) -> tuple[list[Layer], list[dict[str, Any]], list[int], list[int]]:
    """The model's layers, and the base's param groups: each given group split by layer, with each split's layer and
    given group.

    One param group per (given group, layer) lets the step set a per-layer LR (the 1/p of LARS and LAMB) in
    the way every torch optimizer honours, while weight decay stays the given group's.
    """
    given = list(params)
    if not given:
        raise ValueError("JointSpar got an empty parameter list")
    groups = given if isinstance(given[0], dict) else [{"params": given}]
    named_groups: list[tuple[dict[str, Any], list[tuple[str, Tensor]]]] = []
    for i, group in enumerate(groups):
        options = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        items = list(group["params"])
        if items and isinstance(items[0], tuple):
            pairs = [(str(name), p) for name, p in items]
        elif "param_names" in group:
            pairs = list(zip(group["param_names"], items, strict=True))
        elif granularity == "tensor":
            pairs = [(f"group{i}.param{j}", p) for j, p in enumerate(items)]
        else:
            raise ValueError("JointSpar(granularity='block') names layers after the model's modules: pass "
                             "model.named_parameters() (or use granularity='tensor')")
        named_groups.append((options, pairs))

    members: dict[str, list[Tensor]] = {}  # layer name -> parameters, in the model's order
    for _, pairs in named_groups:
        for name, p in pairs:
            members.setdefault(layer_name(name, granularity), []).append(p)
    layers = [Layer(name, tuple(ps)) for name, ps in members.items()]
    index = {name: i for i, name in enumerate(members)}

    base_groups, group_layer, group_given = [], [], []
    for given, (options, pairs) in enumerate(named_groups):
        by_layer: dict[int, list[Tensor]] = {}
        for name, p in pairs:
            by_layer.setdefault(index[layer_name(name, granularity)], []).append(p)
        for layer_index, ps in by_layer.items():
            base_groups.append({**options, "params": ps})
            group_layer.append(layer_index)
            group_given.append(given)
    return layers, base_groups, group_layer, group_given


def _check_budget(options: dict[str, Any]) -> None:
    p_min, layers, budget = options["p_min"], options["layers"], options["budget"]
    require(p_min * layers <= budget * (1 + 1e-9), "p_min", p_min,
            f"x the model's {layers} layers exceeds the {budget} layers sampled per step: lower p_min or "
            "raise sample_ratio")


def check_jointspar_options(options: dict[str, Any]) -> None:
    """JointSpar's value checks, the base's included, run by its constructor and, through the registry, on the
    config before any worker. A bad base option is named `base_options.<key>`."""
    o = options
    check_non_negative("lr", o["lr"])
    check_non_negative("weight_decay", o["weight_decay"])
    check_base_options(o, BASES, "JointSpar")
    ratio = o["sample_ratio"]
    require(isinstance(ratio, int | float) and not isinstance(ratio, bool) and 0.0 < ratio <= 1.0, "sample_ratio",
            ratio, "must be in (0, 1]")
    p_min = o["p_min"]
    require(isinstance(p_min, int | float) and not isinstance(p_min, bool) and 0.0 < p_min <= ratio, "p_min",
            p_min, f"must be in (0, sample_ratio={ratio}]")
    check_non_negative("eta_p", o["eta_p"])
    require(math.isfinite(o["eta_p"]), "eta_p", o["eta_p"], "must be finite")
    check_choice("granularity", o["granularity"], GRANULARITIES)
    check_choice("unsampled", o["unsampled"], UNSAMPLED_POLICIES)
    seed = o["seed"]
    require(isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0, "seed", seed,
            "must be an integer >= 0")


register_optimizer(OptimSpec(
    "jointspar", JointSpar, "self", check=check_jointspar_options, samples_layers=True,
    state_bytes_per_param=wrapper_bytes(0.0),  # its own state is host numbers
    description="JointSpar (Liu & Mozafari, ICML 2022; reconstructed): sampled layers compute, send and apply "
                "their gradients, rescaled by 1/p, with bandit-learned layer probabilities",
))
