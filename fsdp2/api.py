"""The public surface: ``fully_shard``, ``FSDPModule``, ``UnshardHandle`` and friends."""

from __future__ import annotations

from collections.abc import Callable
from types import MethodType
from typing import Any, Literal, cast, overload

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp._fully_shard._fully_shard import FSDPModule as TorchFSDPModule
from torch.distributed.tensor import DTensor, Shard

from fsdp2.engine.agreement import check_fully_shard
from fsdp2.engine.claims import managed_modules, managed_params, take_ties
from fsdp2.engine.mesh import MeshInfo, default_mesh, device_of, mesh_info
from fsdp2.engine.modes import MODES, ReshardToK, mode_for
from fsdp2.engine.module import (
    FSDPModule,
    GradientReductionHandle,
    ReplicateModule,
    UnshardHandle,
    container_without_forward,
)
from fsdp2.engine.param import FSDPParam
from fsdp2.engine.param_group import FSDPParamGroup
from fsdp2.engine.policies import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
)
from fsdp2.engine.state import STATES, FSDPState, state_of
from fsdp2.engine.state_dict import register_state_dict_hooks
from fsdp2.engine.ties import TIES
from fsdp2.engine.torch_state import register_torch_state, torch_state

__all__ = [
    "FSDPModule",
    "GradientReductionHandle",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "replicate",
    "share_comm_ctx",
]


# Argument types shared by the signatures below. True/False/None, or an int: see fully_shard.
ReshardAfterForward = bool | int | None
# Returns None (dim 0), a Shard(dim), or a result with .placement and .mesh_info.mesh.
PlacementFn = Callable[[nn.Parameter], Any] | None
IgnoredParams = set[nn.Parameter] | None
MeshDims = DataParallelMeshDims | None
# What stays sharded between optimizer steps: see fully_shard and the README's "Memory modes".
MemoryMode = Literal["zero3", "zero2", "hfsdp"]
MEMORY_MODES = tuple(MODES)  # ("zero3", "zero2", "hfsdp")


@overload
def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: ReshardAfterForward = ...,
    shard_placement_fn: PlacementFn = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: IgnoredParams = ...,
    dp_mesh_dims: MeshDims = ...,
    memory_mode: MemoryMode = ...,
) -> FSDPModule: ...


@overload
def fully_shard(
    module: list[nn.Module],
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: ReshardAfterForward = ...,
    shard_placement_fn: PlacementFn = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: IgnoredParams = ...,
    dp_mesh_dims: MeshDims = ...,
    memory_mode: MemoryMode = ...,
) -> list[FSDPModule]: ...


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: ReshardAfterForward = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 (frozen)
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
    memory_mode: MemoryMode = "zero3",
) -> FSDPModule | list[FSDPModule]:
    """Shard ``module``'s parameters over ``mesh``, in place; return it as an ``FSDPModule``.

    Call it on submodules first (e.g. each transformer block), then on the root. The parameters
    of this call that no earlier call claimed form one group: gathered in one all-gather before
    the module's forward (and again before its backward if resharded), their gradients
    averaged over the data-parallel ranks in one reduce-scatter after its backward. Parameters
    become sharded ``DTensor``s, so build the optimizer after sharding. The module's class
    becomes ``FSDP<Class>``, a subclass that adds :class:`FSDPModule`'s methods.

    Args:
        module: the module to shard, or a list of modules that then share one group (one
            all-gather, one reduce-scatter), e.g. tied ``[embedding, lm_head]``. Not an
            ``nn.ModuleList``/``nn.ModuleDict`` (no forward to hook; a subclass that defines
            ``forward`` is fine), nor a module already sharded.
        mesh: a 1-D ``DeviceMesh`` to shard over (FSDP), or a 2-D one (HSDP: replicate over
            dim 0, shard over dim 1; gradients reduce-scattered within a replica, then
            all-reduced across replicas). Default: a 1-D mesh over the default process group
            on the current accelerator, else CPU.
        reshard_after_forward: ``True`` frees the gathered parameters after forward and
            gathers again in backward; ``False`` keeps them until backward ends; ``None``
            (default) means ``False`` for the root and ``True`` for every other module; an int
            k (a divisor of the shard size) keeps them sharded over k ranks after forward, so
            backward gathers within that smaller group (1 means ``False``, the shard size
            ``True``).
        shard_placement_fn: called with each parameter; returns ``None`` (shard dim 0) or a
            ``Shard(dim)`` to shard that dim instead (any dim, uneven sizes included). A result
            with ``.placement`` and ``.mesh_info.mesh`` (torch's ``ShardPlacementResult``) on
            another mesh puts that parameter in a group of its own over that mesh. Default:
            dim 0 for every parameter.
        mp_policy: mixed precision: the dtypes parameters are gathered in and gradients
            reduced in, and the casts of forward inputs and outputs (see
            :class:`MixedPrecisionPolicy`). Default: every tensor keeps its dtype.
        offload_policy: ``CPUOffloadPolicy()`` keeps the sharded parameters and their
            gradients on the CPU (the optimizer steps there), gathering to the device for
            compute; the default ``OffloadPolicy()`` offloads nothing.
        ignored_params: parameters this call leaves alone: not sharded, not gathered, their
            gradients not reduced (manage them yourself).
        dp_mesh_dims: on a mesh that also carries other parallelisms (a full SPMD mesh whose
            parameters are already DTensors), the names of its data-parallel dims
            (:class:`DataParallelMeshDims`); ``mesh`` is then that whole mesh.
        memory_mode: what stays sharded between optimizer steps (not in torch: an fsdp2
            addition). ``"zero3"`` (default, torch's behaviour): parameters, gradients and
            optimizer state. ``"zero2"``: gradients and optimizer state only; the gathered
            parameters stay allocated from one step to the next and are gathered again only
            when the shards changed (an optimizer step, a state dict loaded), so K
            micro-batches of accumulation cost one all-gather per step. Implies
            ``reshard_after_forward=False``. ZeRO-1 is ``"zero2"`` with
            ``set_requires_gradient_sync(False)`` on all but the last micro-batch.
            ``"hfsdp"`` (``mesh`` a 2-D (replicate, shard) mesh with named dims): parameters,
            gradients and optimizer state sharded over every rank of it, gathered over the
            replicate dim once per step and over the shard dim at every use.

    Returns:
        ``module`` itself, now an :class:`FSDPModule` (a list of them for a list).

    Raises:
        ValueError / TypeError: for a bad argument, on every rank, before anything changed.
        RuntimeError: without an initialized process group and no ``mesh``.
    """
    modules = tuple(module) if isinstance(module, list) else (module,)
    _check_modules(modules)
    _check_policies(mp_policy, offload_policy)
    mesh = mesh if mesh is not None else default_mesh()
    who = type(modules[0]).__name__
    _check_memory_mode(memory_mode, reshard_after_forward, dp_mesh_dims, who)
    info = MODES[memory_mode].mesh_info(mesh, dp_mesh_dims, who)
    _apply(
        modules,
        info,
        reshard_after_forward,
        mp_policy,
        offload_policy,
        ignored_params,
        shard_placement_fn=shard_placement_fn,
        memory_mode=memory_mode,
    )
    sharded = cast("tuple[FSDPModule, ...]", modules)  # _apply swapped their classes
    return list(sharded) if isinstance(module, list) else sharded[0]


# What torch's ``@contract`` gives its APIs: the state torch.distributed.pipelining reads.
fully_shard.state = torch_state  # type: ignore[attr-defined]


def replicate(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 (frozen)
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> ReplicateModule | list[ReplicateModule]:
    """Data parallelism without sharding (DDP semantics) on fsdp2's runtime.

    Every rank keeps whole parameters (``Replicate()`` DTensors) and gradients are all-reduced,
    one collective per call, after its backward. Same bottom-up usage as :func:`fully_shard`;
    the module's class becomes ``Replicate<Class>``, with :class:`FSDPModule`'s methods.

    Args:
        module: the module, or a list of modules sharing one all-reduce.
        mesh: a 1-D ``DeviceMesh`` to replicate over (default: the default process group's).
        mp_policy: mixed precision, as for :func:`fully_shard`.
        offload_policy: CPU offload, as for :func:`fully_shard`.
        ignored_params: parameters left alone, as for :func:`fully_shard`.
        dp_mesh_dims: the replicate dim's name on a larger SPMD mesh
            (``DataParallelMeshDims(replicate=...)``), as for :func:`fully_shard`.

    Returns:
        ``module`` itself (a list of them for a list).
    """
    modules = tuple(module) if isinstance(module, list) else (module,)
    _check_modules(modules)
    _check_policies(mp_policy, offload_policy)
    mesh = mesh if mesh is not None else default_mesh()
    info = mesh_info(mesh, dp_mesh_dims, replicate_only=True, who=type(modules[0]).__name__)
    _apply(modules, info, False, mp_policy, offload_policy, ignored_params, ReplicateModule)
    replicated = cast("tuple[ReplicateModule, ...]", modules)  # _apply swapped their classes
    return list(replicated) if isinstance(module, list) else replicated[0]


replicate.state = torch_state  # type: ignore[attr-defined]


def _apply(
    modules: tuple[nn.Module, ...],
    info: MeshInfo,
    reshard_after_forward: bool | int | None,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    ignored_params: set[nn.Parameter] | None,
    kind: type[FSDPModule] = FSDPModule,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    memory_mode: str = "zero3",
) -> None:
    """Shard ``modules``' unclaimed parameters into groups (one per mesh; normally just
    ``info``'s) and install the runtime."""
    device = device_of(info.mesh)
    label = ", ".join(type(m).__name__ for m in modules)
    slots = managed_params(modules, ignored_params or set())
    # Before anything that could raise from this rank's own tensors: see agreement.py.
    kept = {param: mp_policy.kept_dtype(param) for param in slots}
    kept_names = [f"{slots[p][0]}: {dtype}" for p, dtype in kept.items() if dtype is not None]
    # Every rank compares these (agreement.py): the policy's repr leaves the override function
    # out (its address differs between ranks), so its answers are compared instead.
    arguments = (
        f"{info.mesh}, reshard_after_forward={reshard_after_forward!r}, {mp_policy}, "
        f"{offload_policy}"
        + (f", memory_mode={memory_mode!r}" if memory_mode != "zero3" else "")
        + (f", kept in their dtype: {', '.join(kept_names)}" if kept_names else "")
    )
    fqns = {param: fqn for param, (fqn, _) in slots.items()}
    meta_on_some_rank = check_fully_shard(label, fqns, info, device, arguments)
    ReshardToK.check_value(reshard_after_forward, info, label)  # before a tie moves (below)
    moved = take_ties(modules, slots, kept, mp_policy)
    # mesh (None: fully_shard's own) -> its parameters and their full tensors
    by_mesh: dict[DeviceMesh | None, tuple[list[FSDPParam], list[torch.Tensor]]] = {None: ([], [])}
    created: dict[nn.Parameter, FSDPParam] = {}
    for param, (fqn, places) in slots.items():
        dim, mesh = 0, None
        if shard_placement_fn is not None:
            dim, mesh = _shard_choice(shard_placement_fn(param), param, fqn, info)
        fsdp_param = FSDPParam(param, places, fqn, label, kept[param], dim)
        created[param] = fsdp_param
        full = param._local_tensor if isinstance(param, DTensor) else param  # TP: local piece
        full = moved.get(param, full)  # a tie's current values, from the group it leaves
        full = full.detach() if full.device.type == "meta" else full.detach().to(device)
        params, fulls = by_mesh.setdefault(mesh, ([], []))
        params.append(fsdp_param)
        fulls.append(full)
    offload = offload_policy if isinstance(offload_policy, CPUOffloadPolicy) else None
    groups = []
    for mesh, (params, fulls) in by_mesh.items():
        if params:
            group_info = info if mesh is None else mesh_info(mesh, who=label)
            mode = mode_for(memory_mode, group_info)
            groups.append(
                FSDPParamGroup(
                    params,
                    fulls,
                    group_info,
                    device,
                    label,
                    mp_policy,
                    offload,
                    mode,
                    meta_on_some_rank,
                )
            )
    by_mesh.clear()
    for each in groups:
        if refused := MODES[memory_mode].refused(each.layout):
            raise NotImplementedError(
                f"fully_shard({label}): memory_mode={memory_mode!r} with all-gather "
                f"extension (torchao float8/NF4) or, for 'hfsdp', tensor-parallel parameters "
                f"({', '.join(refused)}) is not supported yet; shard this module with "
                "memory_mode='zero3'"
            )
    group = groups[0] if groups and groups[0].info is info else None
    params = [p for g in groups for p in g.fsdp_params]
    # Resolved (and validated) before the first change to the modules: a rejected value leaves
    # them as they were, ready for a corrected call.
    reshard_after_forward, k_mode = ReshardToK.resolve(
        reshard_after_forward, info, group.fsdp_params if group is not None else [], label
    )
    if group is not None and k_mode is not None:
        group.set_mode(k_mode)
    reshard_after_forward = MODES[memory_mode].reshard_after_forward(reshard_after_forward)
    for fsdp_param in params:
        fsdp_param.register(fsdp_param.sharded_param)
    group_of = {id(p): g for g in groups for p in g.fsdp_params}
    for param in slots:
        # A tied copy of this parameter outside these modules keeps the original object: mark
        # it, so that the fully_shard call that meets it there knows ([Note: weights tied
        # across calls]).
        param._fsdp2_owner = label  # type: ignore[attr-defined]
        TIES.sharded(param, group_of[id(created[param])], created[param])
    for managed in managed_modules(modules):
        for name, buf in managed._buffers.items():
            # A meta buffer has no data to move: to_empty() materialises it with the parameters.
            if buf is not None and buf.device != device and buf.device.type != "meta":
                managed._buffers[name] = buf.to(device)
    state = FSDPState(modules, groups, reshard_after_forward, mp_policy)
    prefix = "FSDP" if kind is FSDPModule else kind.__name__.removesuffix("Module")
    for mod in modules:
        STATES.attach(mod, state)
        register_torch_state(mod, state)
        for each in groups:
            register_state_dict_hooks(mod, state, each)
        mod.__class__ = _wrapped_class(type(mod), kind, prefix)


def _check_memory_mode(
    mode: object, reshard_after_forward: object, dp_mesh_dims: object, who: str
) -> None:
    if mode not in MODES:
        raise ValueError(
            f"fully_shard({who}): memory_mode={mode!r} must be one of {MEMORY_MODES}: 'zero3' "
            "shards parameters between steps, 'zero2' keeps them gathered (ZeRO-1 is 'zero2' "
            "with set_requires_gradient_sync(False) on all but the last micro-batch), 'hfsdp' "
            "shards everything over both dims of a (replicate, shard) mesh"
        )
    MODES[mode].check_args(reshard_after_forward, dp_mesh_dims, who)


def _check_modules(modules: tuple[nn.Module, ...]) -> None:
    if not modules:
        raise ValueError("fully_shard got an empty list of modules; pass at least one nn.Module")
    for mod in modules:
        if not isinstance(mod, nn.Module):
            raise TypeError(f"fully_shard expects an nn.Module or a list of them, got {mod!r}")
        if state_of(mod) is not None:
            raise ValueError(
                f"fully_shard was already applied to this {type(mod).__name__}; apply it once "
                "per module (bottom-up: submodules first, then their parent)"
            )
        if container_without_forward(mod):
            raise ValueError(
                f"fully_shard does not take a {type(mod).__name__}: it has no forward to hook. "
                "Apply it to each module inside, or pass them as a list: fully_shard(list(...))"
            )


def _check_policies(mp_policy: MixedPrecisionPolicy, offload_policy: OffloadPolicy) -> None:
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {mp_policy!r}")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"offload_policy must be an OffloadPolicy, got {offload_policy!r}")


def _shard_choice(
    choice: object, param: nn.Parameter, fqn: str, info: MeshInfo
) -> tuple[int, DeviceMesh | None]:
    """The dim ``shard_placement_fn`` chose for ``param`` (``None``: dim 0), and the mesh if it
    chose one other than fully_shard's (e.g. expert weights over an expert-data-parallel mesh:
    those parameters form a group of their own, gathered and reduced over that mesh)."""
    if choice is None:
        return 0, None
    mesh = getattr(getattr(choice, "mesh_info", None), "mesh", None)
    # A DTensor parameter (expert parallel) too: its group's mesh is then joined with its own.
    other: DeviceMesh | None = mesh if mesh is not None and mesh != info.mesh else None
    if param.dim() == 0:
        return 0, other
    placement = getattr(choice, "placement", choice)
    if not isinstance(placement, Shard):
        raise ValueError(
            f"shard_placement_fn must return None or a Shard placement for {fqn}, got {choice!r}"
        )
    dim = placement.dim + param.dim() if placement.dim < 0 else placement.dim
    if not 0 <= dim < param.dim():
        raise ValueError(
            f"shard_placement_fn chose Shard({placement.dim}) for {fqn} of shape "
            f"{tuple(param.shape)}, which has no such dim"
        )
    return dim, other


_wrapped_classes: dict[tuple[type, type], type] = {}


def _wrapped_class(cls: type, kind: type, prefix: str) -> type:
    """``FSDP<Name>``: ``FSDPModule`` first in the MRO, so its methods and ``__call__`` win.

    torch's ``FSDPModule`` comes last, after ``nn.Module``: code that tests
    ``isinstance(m, torch.distributed.fsdp.FSDPModule)`` without ``patch_torch_fsdp()`` (torch's
    pipeline stage and schedules) recognises the module and calls fsdp2's methods, while no
    method of torch's implementation is ever reached ahead of fsdp2's or ``nn.Module``'s."""
    if (cls, kind) not in _wrapped_classes:
        bases = (kind, cls) if issubclass(cls, TorchFSDPModule) else (kind, cls, TorchFSDPModule)
        _wrapped_classes[cls, kind] = type(f"{prefix}{cls.__name__}", bases, {})
    return _wrapped_classes[cls, kind]


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run fsdp2's forward hooks around ``module.<method_name>`` too (e.g. ``generate``), so
    that calling it gathers the parameters first, as ``module(...)`` does.

    Args:
        module: a module ``fully_shard`` was applied to; any other module is left as it is
            (as in torch, so that the same code runs with and without sharding).
        method_name: the name of the method to hook; it must exist on ``module``.
    """
    state = state_of(module)
    if state is None:
        return  # as in torch: the same code runs with and without fsdp2
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module).__name__} has no method {method_name!r}")
    method = getattr(type(module), method_name)

    def with_fsdp_hooks(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = state.pre_forward(args, kwargs)
        return state.post_forward(method(self, *args, **kwargs), self)

    module.__dict__[method_name] = MethodType(with_fsdp_hooks, module)


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Accepted for compatibility with torch. fsdp2 issues every collective from the calling
    thread in program order, so there are no per-root streams or buffers to share; this only
    checks its input.

    Args:
        modules: the root ``FSDPModule``s that would share communication state in torch.
    """
    for mod in modules:
        if not isinstance(mod, FSDPModule):
            raise ValueError(f"share_comm_ctx expects FSDPModules, got {type(mod).__name__}")
