"""``fsdp2.optim.Muon`` as a drop-in for ``torch.optim.Muon``: the same arguments, defaults and
steps, torch's state dicts load, full and CPU-offloaded state dicts work, and ``adamw_params``
train (the sharded steps equal the single-process ones bitwise: tests/optim/test_muon.py).
"""

from __future__ import annotations

import importlib
import inspect
import math
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
from expecttest import assert_expected_inline

from tests.errors import raised
from tests.harness import run_on_ranks

# fp32's unit roundoff is 2**-24; one rounding of a result bounds the error by half an ulp.
U = 2.0**-24


# torch 2.15 added "spectral_unclamped": compared wherever the installed torch has it.
ADJUST_LR_FNS = [None, "original", "match_rms_adamw"] + (
    ["spectral_unclamped"]
    if "spectral_unclamped" in inspect.getsource(importlib.import_module("torch.optim._muon"))
    else []
)


def _muon() -> Any:
    from fsdp2.optim import Muon

    return Muon


def _torch_ns_in(dtype: torch.dtype) -> Any:
    """torch.optim.Muon's own Newton–Schulz with its bf16 cast replaced by ``dtype``."""
    import torch.optim._muon as muon_module

    source = inspect.getsource(muon_module._zeropower_via_newtonschulz)
    # The cast as torch 2.11-2.14 and 2.15 write it (2.15's copies: the same values).
    casts = [
        c for c in ("grad.bfloat16()", "grad.to(dtype=torch.bfloat16, copy=True)") if c in source
    ]
    if not casts:
        raise AssertionError("torch's Newton–Schulz changed: update this test")
    scope = dict(vars(muon_module))
    exec(source.replace(casts[0], f"grad.to({dtype})"), scope)
    return scope["_zeropower_via_newtonschulz"]


def test_signature_is_torchs() -> None:
    """The arguments torch.optim.Muon takes come first, by the same names, kinds and defaults."""
    theirs = inspect.signature(torch.optim.Muon).parameters
    ours = inspect.signature(_muon()).parameters
    assert list(ours)[: len(theirs)] == list(theirs)
    for name, param in theirs.items():
        assert (ours[name].default, ours[name].kind) == (param.default, param.kind), name


def _pair(shape: tuple[int, int], **kw: Any) -> tuple[nn.Parameter, nn.Parameter, Any, Any]:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(*shape))
    v = nn.Parameter(w.detach().clone())
    return (
        w,
        v,
        _muon()([w], **kw),
        torch.optim.Muon([v], **{k: kw[k] for k in kw if k != "ns_dtype"}),
    )


@pytest.mark.parametrize("shape", [(32, 16), (16, 32)])
@pytest.mark.parametrize("adjust_lr_fn", ADJUST_LR_FNS)
@pytest.mark.parametrize("nesterov", [True, False])
def test_bf16_steps_equal_torchs(
    shape: tuple[int, int], adjust_lr_fn: str | None, nesterov: bool
) -> None:
    """ns_dtype=bf16 runs torch's Newton–Schulz operations. With momentum 0.5 and gradients in
    eighths, both momentum formulas (torch's lerp, our multiply-add) are exact, so the
    orthogonalised update is the same bf16 matrix on both sides. What remains: torch adds
    ``-lr' * update`` in one operation, we round the product first: at most one rounding of
    the product and one of the sum apart per step, ``2u (|p| + |lr' update|) <= 2u (1 + |p|)``
    (``|lr' update| < 1`` here), and weight decay shrinks earlier differences."""
    kw = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.5, "nesterov": nesterov}
    w, v, ours, theirs = _pair(shape, adjust_lr_fn=adjust_lr_fn, ns_dtype=torch.bfloat16, **kw)
    start = v.detach().clone()
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 4):
        w.grad = torch.randint(-8, 9, shape, generator=gen).float() / 8
        v.grad = w.grad.clone()
        ours.step()
        theirs.step()
        bound = step * 2 * U * (1 + float(v.detach().abs().max()))
        torch.testing.assert_close(w, v, rtol=0, atol=bound)
        assert torch.equal(ours.state[w]["momentum_buffer"], theirs.state[v]["momentum_buffer"])
    assert (v - start).abs().max() > 1e4 * bound  # the steps moved the weights


@pytest.mark.parametrize("shape", [(32, 16), (16, 32)])
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_fp32_steps_equal_torchs_code_in_fp32(
    shape: tuple[int, int], adjust_lr_fn: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fsdp2's default (fp32 Newton–Schulz) against torch's own code with its bf16 cast made an
    fp32 one, at torch's defaults otherwise (momentum 0.95, random gradients). The momentum
    formulas round differently (an ulp of the input); through five Newton–Schulz iterations an
    input ulp or a rounding grows at most ~3.4x per iteration over sums of <= 32 terms:
    ``u * 3.4**5 * 32 ~ 9e-4`` on O(1) entries, so ``1e-3 * lr'`` per step on the weights."""
    import torch.optim._muon as muon_module

    monkeypatch.setattr(muon_module, "_zeropower_via_newtonschulz", _torch_ns_in(torch.float32))
    w, v, ours, theirs = _pair(shape, lr=0.02, adjust_lr_fn=adjust_lr_fn)
    rows, cols = shape
    scale = 0.2 * math.sqrt(max(shape)) if adjust_lr_fn else math.sqrt(max(1, rows / cols))
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 4):
        w.grad = torch.randn(shape, generator=gen)
        v.grad = w.grad.clone()
        ours.step()
        theirs.step()
        bound = step * (1e-3 * 0.02 * scale + 2 * U * (1 + float(v.detach().abs().max())))
        torch.testing.assert_close(w, v, rtol=0, atol=bound)


def test_only_the_class_changed_against_torchs_bf16() -> None:
    """A torch user's call with only the class changed: torch's bf16 Newton–Schulz (8-bit
    significands, re-rounded in each of 5 iterations: a few percent of the update) against
    fsdp2's fp32; a wrong scale, decay or momentum term is >= 30% of the change."""
    torch.manual_seed(0)
    for shape in [(32, 16), (16, 32)]:
        w = nn.Parameter(torch.randn(*shape))
        v = nn.Parameter(w.detach().clone())
        start = w.detach().clone()
        args = (0.02, 0.1, 0.9, True)  # lr, weight_decay, momentum, nesterov: positionally
        ours, theirs = _muon()([w], *args), torch.optim.Muon([v], *args)
        for _ in range(3):
            w.grad = torch.randn(*shape)
            v.grad = w.grad.clone()
            ours.step()
            theirs.step()
            assert (w - v).norm() / (w - start).norm() < 0.05


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _train(params: list[nn.Parameter], opt: Any, steps: int = 2) -> None:
    gen = torch.Generator().manual_seed(2)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


def test_loads_a_state_dict_saved_by_torch_muon() -> None:
    """torch.optim.Muon's groups have no ``use_muon``: they load into the matrix groups, with
    their settings; this optimizer's AdamW groups keep theirs."""
    ref, net = _net(), _net()
    ref_mats = [ref[0].weight, ref[2].weight]
    theirs = torch.optim.Muon(ref_mats, lr=0.03, momentum=0.9, adjust_lr_fn="match_rms_adamw")
    _train(ref_mats, theirs)
    saved = theirs.state_dict()
    for params in ([net[0].weight, net[2].weight], list(net.parameters())):
        ours = _muon()(params, adamw_lr=1e-3)
        ours.load_state_dict(saved)
        group = ours.param_groups[0]
        assert (group["lr"], group["momentum"], group["adjust_lr_fn"]) == (
            0.03,
            0.9,
            "match_rms_adamw",
        )
        assert group["use_muon"] and group["ns_dtype"] == "float32"
        for p, q in zip([net[0].weight, net[2].weight], ref_mats, strict=True):
            assert torch.equal(ours.state[p]["momentum_buffer"], theirs.state[q]["momentum_buffer"])
        if len(ours.param_groups) > 1:  # the biases: AdamW, as built
            assert ours.param_groups[1]["lr"] == 1e-3 and not ours.param_groups[1]["use_muon"]
    two_groups = _muon()([{"params": [net[0].weight]}, {"params": [net[2].weight]}])
    assert_expected_inline(
        raised(lambda: two_groups.load_state_dict(saved)),
        """ValueError: Muon.load_state_dict: the state dict's 1 param groups have no 'use_muon' (saved by torch.optim.Muon?); they are loaded into this optimizer's matrix groups, of which there are 2. Build the optimizer with the same matrix groups, in the same order, as the optimizer that saved it.""",
    )
    one_matrix = _muon()([net[0].weight])
    assert_expected_inline(
        raised(lambda: one_matrix.load_state_dict(saved)),
        """ValueError: Muon.load_state_dict: a saved param group has 2 parameters where this optimizer's matrix group has 1""",
    )


def test_loads_fsdp2s_state_dicts_from_before_torchs_names() -> None:
    """Groups saved with ``adjust_lr`` ("spectral": torch's "original"), a ``torch.dtype``
    ``ns_dtype`` and no ``ns_coefficients`` load; ``adjust_lr=None`` (no scaling) is refused."""
    net = _net()
    opt = _muon()(net.parameters(), lr=0.02)
    _train(list(net.parameters()), opt)
    saved = opt.state_dict()
    for group in saved["param_groups"]:
        del group["adjust_lr_fn"], group["ns_coefficients"]
        group.update(adjust_lr="spectral", ns_dtype=torch.float32)
    fresh = _muon()(_net().parameters())
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["adjust_lr_fn"] == "original"
    assert "adjust_lr" not in fresh.param_groups[0] and fresh.param_groups[0]["lr"] == 0.02
    _train(list(fresh.param_groups[0]["params"]) + list(fresh.param_groups[1]["params"]), fresh, 1)
    saved["param_groups"][0]["adjust_lr"] = None
    assert_expected_inline(
        raised(lambda: _muon()(_net().parameters()).load_state_dict(saved)),
        """ValueError: Muon.load_state_dict: the state dict's adjust_lr=None (no scaling) has no equivalent now that Muon takes torch.optim.Muon's adjust_lr_fn; set group['adjust_lr_fn'] in the state dict's param_groups to 'original' or 'match_rms_adamw' to load it""",
    )


def test_adamw_params_not_in_params_train() -> None:
    """``Muon(matrices, adamw_params=rest)`` (torch's two-list recipe) trains ``rest``, exactly
    as ``rest`` listed in both places does."""
    a, b = _net(), _net()
    mats = lambda m: [m[0].weight, m[2].weight]  # noqa: E731
    rest = lambda m: [m[0].bias, m[2].bias]  # noqa: E731
    split = _muon()(mats(a), adamw_params=rest(a), adamw_lr=1e-2)
    both = _muon()(list(b.parameters()), adamw_params=rest(b), adamw_lr=1e-2)
    assert sum(len(g["params"]) for g in split.param_groups) == 4
    before = [p.detach().clone() for p in rest(a)]
    _train(mats(a) + rest(a), split)
    _train(mats(b) + rest(b), both)
    for p, q, old in zip(rest(a), rest(b), before, strict=True):
        assert not torch.equal(p, old)
        assert torch.equal(p, q)  # the same AdamW ops on the same values


class TestArguments:
    def test_refused_like_torch(self) -> None:
        Muon, net = _muon(), _net()
        assert_expected_inline(
            raised(lambda: Muon(net.parameters(), lr=-1e-3)),
            """ValueError: Muon: lr must be >= 0, got -0.001""",
        )
        assert_expected_inline(
            raised(lambda: Muon(net.parameters(), weight_decay=-0.1)),
            """ValueError: Muon: weight_decay must be >= 0, got -0.1""",
        )
        assert_expected_inline(
            raised(lambda: Muon(net.parameters(), adamw_lr=-1.0)),
            """ValueError: Muon: adamw_lr must be >= 0, got -1.0""",
        )
        assert_expected_inline(
            raised(lambda: Muon(net.parameters(), adjust_lr_fn="rms")),
            """ValueError: Muon: adjust_lr_fn must be one of (None, 'original', 'match_rms_adamw', 'spectral_unclamped') (torch.optim.Muon's), got 'rms'""",
        )
        named = [{"params": list(net.named_parameters()), "use_muon": True}]
        assert_expected_inline(
            raised(lambda: Muon(named)),
            """ValueError: Muon: parameter 0.bias is 1-D (shape [16]) in a group with use_muon=True; only 2-D and 3-D (stacked) matrices get whole-matrix updates. Put it in adamw_params or in a group with use_muon=False.""",
        )
        mats = [{"params": [net[0].weight], "use_muon": True}]
        assert_expected_inline(
            raised(lambda: Muon(mats, adamw_params=[net[0].weight])),
            """ValueError: Muon: parameter param_groups[0]['params'][0] is in a group with use_muon=True and in adamw_params; a parameter gets one update rule. Take it out of one of the two.""",
        )

    def test_old_adjust_lr_name(self) -> None:
        Muon, net = _muon(), _net()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = Muon(net.parameters(), adjust_lr="spectral")
        assert opt.param_groups[0]["adjust_lr_fn"] == "original"
        assert_expected_inline(
            str(caught[0].message),
            """Muon: adjust_lr='spectral' is deprecated; write adjust_lr_fn='original' (torch.optim.Muon's name)""",
        )
        assert_expected_inline(
            raised(lambda: Muon(net.parameters(), adjust_lr=None)),
            """ValueError: Muon: adjust_lr was renamed adjust_lr_fn (torch.optim.Muon's name and meanings); adjust_lr=None has no equivalent: adjust_lr_fn=None now means torch's 'original' scaling, sqrt(max(1, rows / cols)). Use adjust_lr_fn='original' or 'match_rms_adamw'.""",
        )

    def test_groups_added_later(self) -> None:
        Muon, net = _muon(), _net()
        opt = Muon([net[0].weight])
        assert_expected_inline(
            raised(lambda: opt.add_param_group({"params": [net[2].weight]})),
            """ValueError: Muon.add_param_group: the group needs 'use_muon': True for matrices (whole-matrix updates) or False for AdamW; got a group without it.""",
        )
        opt.add_param_group({"params": [net[2].weight], "use_muon": True})
        assert len(opt.layouts()) == 2
        opt.add_param_group({"params": [net[0].bias], "use_muon": False})
        assert opt.param_groups[-1]["lr"] == 3e-4  # AdamW's default, not Muon's
        assert opt.param_groups[-1]["eps"] == 1e-8  # AdamW's, not Newton–Schulz's 1e-7


def _state_dicts() -> dict[str, Any]:
    """Full and CPU-offloaded optimizer state dicts of a sharded Muon, and a full one saved by
    torch.optim.Muon on an unsharded copy loaded into a sharded fsdp2 Muon."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.tensor import DTensor

    import fsdp2

    rank = dist.get_rank()
    ref, model, fresh = _net(), _net(), _net()
    for m in (model, fresh):
        fsdp2.fully_shard(m[0])
        fsdp2.fully_shard(m)
    opt = _muon()(model.parameters(), lr=0.02)
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        opt.step()
    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    offload = StateDictOptions(full_state_dict=True, cpu_offload=True)
    on_cpu = get_optimizer_state_dict(model, opt, options=offload)
    sharded_buf = opt.state[model[0].weight]["momentum_buffer"]
    assert isinstance(sharded_buf, DTensor)
    out: dict[str, Any] = {
        "groups": [g["ns_dtype"] for g in full["param_groups"]],
        "full_equal": torch.equal(
            full["state"]["0.weight"]["momentum_buffer"], sharded_buf.full_tensor()
        ),
        "offload_keys": sorted(on_cpu["state"]) if rank == 0 else None,
    }
    theirs = torch.optim.Muon([ref[0].weight, ref[2].weight], lr=0.03)
    _train([ref[0].weight, ref[2].weight], theirs)
    saved = get_optimizer_state_dict(ref, theirs, options=StateDictOptions(full_state_dict=True))
    ours = _muon()([fresh[0].weight, fresh[2].weight])
    set_optimizer_state_dict(fresh, ours, saved, options=StateDictOptions(full_state_dict=True))
    loaded = ours.state[fresh[0].weight]["momentum_buffer"]
    out["torch_loaded"] = isinstance(loaded, DTensor) and torch.equal(
        loaded.full_tensor(), theirs.state[ref[0].weight]["momentum_buffer"]
    )
    out["lr"] = ours.param_groups[0]["lr"]
    return out


def test_full_and_offloaded_state_dicts(fsdp2_only: None) -> None:
    results = run_on_ranks(2, _state_dicts, timeout=120)
    for out in results:
        assert out["groups"] == ["float32", "float32"]  # plain values: no torch.dtype
        assert out["full_equal"] and out["torch_loaded"] and out["lr"] == 0.03
    assert results[0]["offload_keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
