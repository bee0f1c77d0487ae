"""Model-parallel state: Megatron-core's rank math over one global JAX device mesh.

Megatron builds one NCCL process group per parallel dimension from pure integer rank math
(``RankGenerator``). Here the same math decides where each device sits in a single
``jax.sharding.Mesh`` whose axes are the parallel dimensions; a "process group" becomes a
mesh axis name (or a tuple of them) that collectives inside ``jax.shard_map`` take.

Layout. Megatron's order string (default ``"tp-cp-ep-dp-pp"``) lists dimensions from the
fastest-varying (stride 1) to the slowest. The mesh axes are that order reversed, so the
row-major device array puts global rank ``r`` at the same coordinates Megatron would, with
global rank ``r`` = the ``r``-th device of ``jax.devices()`` sorted by (process, id), i.e.
process ``r``'s device when each process has one device.

Expert parallelism lives *inside* data parallelism, as in Megatron: the mesh axis ``"ep"``
splits the dense data-parallel group into expert-parallel ranks, and the mesh axis ``"dp"``
is what remains; with ``"cp"`` it forms Megatron's expert-data-parallel group. Dense data
parallelism is therefore the axis tuple ``("dp", "ep")``; :func:`get_data_parallel_axis_name`
returns it. With cp > 1 an expert-parallel group stays inside one cp index, where Megatron's
may span cp ranks (same results with dropless routing; :func:`_check_against_rank_generators`).

Distributed-optimizer instances. With ``num_distributed_optimizer_instances`` = N > 1 (Megatron's
argument of the same name) the ``"dp"`` axis is split in two: an outer axis ``"dpo"`` of size N,
major, and ``"dp"`` of size dp / (ep x N). Megatron's intra-instance groups (contiguous blocks of
the dp x cp group's ranks) are the slices along ``"dpo"``; every data-parallel axis tuple names
``"dpo"`` wherever ``"dp"`` is meant, so the data-parallel groups are the same as with N = 1.

Host vs traced ranks. The ``get_*_rank()`` functions are evaluated on the host and return
this process's coordinate (of its first local device when a process holds several devices).
Inside ``jax.shard_map`` every device runs the same program, so the rank there is a traced
value: use ``jax.lax.axis_index(get_tensor_model_parallel_axis_name())`` and friends.

Everything below is a thin facade over an immutable :class:`ParallelState`, so code and
tests can build and pass a state explicitly (see :func:`build_parallel_state`).

The module is long (about 700 lines) because it keeps Megatron's single ``parallel_state``
module: the rank generator, the state, and Megatron's thirty-odd getters users call by
name, each a one-line facade; splitting them would scatter one API over several imports.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Hashable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

# initialize_distributed and mpi_world_size_from_env are part of this module's API (re-exported).
from core.runtime.cluster import initialize_distributed, mpi_world_size_from_env, process_host_index  # noqa: F401

TP_AXIS = "tp"
CP_AXIS = "cp"
EP_AXIS = "ep"
DP_AXIS = "dp"
DPO_AXIS = "dpo"
"""Outer data-parallel axis of ``num_distributed_optimizer_instances`` > 1 (HSDP): it numbers the
instances, each a contiguous block of the dp x cp group, and sits right before (major to) ``"dp"``."""
PP_AXIS = "pp"
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
_TOKENS = (TP_AXIS, CP_AXIS, EP_AXIS, DP_AXIS, PP_AXIS)



# ---------------------------------------------------------------------------------------
# Rank math (pure, no devices)
# ---------------------------------------------------------------------------------------


def generate_masked_orthogonal_rank_groups(
    world_size: int, parallel_size: Sequence[int], mask: Sequence[bool]
) -> list[list[int]]:
    """Groups of ranks that vary along the masked dimensions, Megatron's rank math.

    ``parallel_size[i]`` is the size of dimension ``i``; dimension 0 has stride 1. Each group
    holds the ranks that share their coordinates on the unmasked dimensions; groups are
    enumerated and filled with the first dimension varying fastest, as in Megatron-core.
    """
    sizes = list(parallel_size)
    if int(np.prod(sizes)) != world_size:
        raise ValueError(f"product of parallel sizes {sizes} != world size {world_size}")
    # grid[i0, i1, ...] = rank, dimension 0 fastest.
    grid = np.arange(world_size).reshape(sizes[::-1]).transpose(range(len(sizes))[::-1])
    masked = [i for i, m in enumerate(mask) if m]
    unmasked = [i for i, m in enumerate(mask) if not m]
    # C-order flattening makes the last axis fastest, so list each set reversed.
    arranged = grid.transpose(unmasked[::-1] + masked[::-1])
    group_size = int(np.prod([sizes[i] for i in masked]))
    return arranged.reshape(world_size // group_size, group_size).tolist()


class RankGenerator:
    """Megatron-core's ``RankGenerator``: process groups from sizes and an order string.

    ``order`` lists the dimensions from stride 1 upwards, e.g. ``"tp-cp-ep-dp-pp"``; a
    dimension of size 1 may be left out of it. ``get_ranks("tp-dp")`` returns every group of
    ranks that differ only in their tp and dp coordinates.
    """

    def __init__(self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str, rank_offset: int = 0):
        self.tp, self.ep, self.dp, self.pp, self.cp = tp, ep, dp, pp, cp
        self.rank_offset = rank_offset
        self.world_size = tp * ep * dp * pp * cp
        self.name_to_size = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp}
        tokens = order.lower().split("-")
        unknown = [t for t in tokens if t not in self.name_to_size]
        if unknown or len(set(tokens)) != len(tokens):
            raise ValueError(f"order {order!r} must name each of {list(self.name_to_size)} at most once")
        for name, size in self.name_to_size.items():
            if name not in tokens:
                if size != 1:
                    raise ValueError(
                        f"the size of {name} is {size}, but the order {order!r} does not name it"
                    )
                tokens.append(name)
        self.order = "-".join(tokens)
        self.ordered_size = [self.name_to_size[t] for t in tokens]

    def get_mask(self, order: str, token: str) -> list[bool]:
        """For each dimension of ``order``, whether it is named in ``token`` (e.g. ``"tp-dp"``)."""
        wanted = token.split("-")
        return [t in wanted for t in order.split("-")]

    def get_ranks(self, token: str) -> list[list[int]]:
        """All groups of ranks that vary only along the dimensions named in ``token``."""
        mask = self.get_mask(self.order, token)
        groups = generate_masked_orthogonal_rank_groups(self.world_size, self.ordered_size, mask)
        return [[r + self.rank_offset for r in g] for g in groups]


# ---------------------------------------------------------------------------------------
# The explicit state
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ParallelState:
    """Immutable description of the parallel layout: sizes, order and the global mesh.

    Build one with :func:`build_parallel_state` (explicit) or
    :func:`initialize_model_parallel` (which also stores it as the process-wide default).
    """

    mesh: Mesh
    """The global device mesh; axis names are ``"pp", "dp", "ep", "cp", "tp"`` in the order's reverse
    (with ``"dpo"`` right before ``"dp"`` when ``num_distributed_optimizer_instances`` > 1)."""
    tensor_model_parallel_size: int
    """Number of tensor-parallel ranks (mesh axis ``"tp"``)."""
    pipeline_model_parallel_size: int
    """Number of pipeline stages (mesh axis ``"pp"``)."""
    virtual_pipeline_model_parallel_size: int | None
    """Model chunks per pipeline stage for the interleaved schedule, or None."""
    context_parallel_size: int
    """Number of context-parallel ranks (mesh axis ``"cp"``)."""
    expert_model_parallel_size: int
    """Number of expert-parallel ranks (mesh axis ``"ep"``, a split of data parallelism)."""
    data_parallel_size: int
    """Dense data-parallel size: world / (tp * pp * cp); spans mesh axes ``("dp", "ep")``."""
    order: str
    """Megatron order string, fastest-varying dimension first."""
    device_ranks: np.ndarray = dataclasses.field(repr=False, compare=False)
    """Global rank of each mesh position, same shape as ``mesh.devices``."""
    num_distributed_optimizer_instances: int = 1
    """Number of distributed-optimizer instances (Megatron's argument): > 1 splits the data-parallel
    axis into the outer axis ``"dpo"`` (one index per instance) and the inner ``"dp"``; Megatron-FSDP
    ``optim_grads_params`` shards parameters inside an instance and replicates them across (HSDP)."""

    # -- sizes and names ------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Total number of devices in the mesh."""
        return int(self.device_ranks.size)

    @property
    def expert_data_parallel_size(self) -> int:
        """Expert-data-parallel size without cp: data_parallel_size / expert_model_parallel_size
        (the mesh axes ``"dpo"``, ``"dp"``; Megatron's group, times cp, is :meth:`replica_size` ``(expert=True)``)."""
        return self.data_parallel_size // self.expert_model_parallel_size

    def axis_names(self, *tokens: str) -> tuple[str, ...]:
        """Mesh axis names for ``tokens``, ordered as Megatron orders ranks within a group.

        Megatron's first (fastest) dimension is the minor one of a mesh-axis tuple, so the
        returned tuple follows mesh order (slowest first).
        """
        return tuple(name for name in self.mesh.axis_names if name in tokens)

    @property
    def data_parallel_axis_name(self) -> tuple[str, ...]:
        """Axis names of the dense data-parallel group (``("dp", "ep")`` in mesh order, ``("dpo", "dp",
        "ep")`` with several distributed-optimizer instances)."""
        return self.axis_names(DPO_AXIS, DP_AXIS, EP_AXIS)

    @property
    def data_parallel_with_context_axis_name(self) -> tuple[str, ...]:
        """Axis names of the data-parallel x context-parallel group."""
        return self.axis_names(DPO_AXIS, DP_AXIS, EP_AXIS, CP_AXIS)

    @property
    def expert_data_parallel_with_context_axis_name(self) -> tuple[str, ...]:
        """Axis names of the expert-data-parallel group: dp / ep x cp (Megatron's includes cp)."""
        return self.axis_names(DPO_AXIS, DP_AXIS, CP_AXIS)

    @property
    def data_parallel_outer_axis_name(self) -> tuple[str, ...]:
        """The outer data-parallel axis, one index per distributed-optimizer instance: ``("dpo",)``
        when ``num_distributed_optimizer_instances`` > 1, else ``()``."""
        return self.axis_names(DPO_AXIS)

    def replica_axes(self, expert: bool) -> tuple[str, ...]:
        """Axes along which a parameter has copies: its grads are reduced (and its distributed-
        optimizer state sharded) over them and its values broadcast over them. Every data-parallel
        and context-parallel rank holds a dense parameter; an expert parameter is split over ep."""
        return self.expert_data_parallel_with_context_axis_name if expert else self.data_parallel_with_context_axis_name

    def replica_size(self, expert: bool) -> int:
        """Number of ranks along :meth:`replica_axes` (dp x cp, or dp / ep x cp for experts)."""
        return int(np.prod([self.mesh.shape[a] for a in self.replica_axes(expert)], dtype=int))

    # -- groups and coordinates -----------------------------------------------------------
    def groups(self, axes: Sequence[str]) -> list[list[int]]:
        """Global ranks of every group along mesh ``axes`` (major first), like Megatron's groups."""
        names = list(self.mesh.axis_names)
        moved = [names.index(a) for a in axes]
        rest = [i for i in range(len(names)) if i not in moved]
        size = int(np.prod([self.mesh.shape[a] for a in axes])) if axes else 1
        return self.device_ranks.transpose(rest + moved).reshape(-1, size).tolist()

    def coordinates(self, rank: int) -> dict[str, int]:
        """Mesh coordinate of global ``rank`` along every axis."""
        where = np.argwhere(self.device_ranks == rank)
        if len(where) != 1:
            raise ValueError(f"rank {rank} is not in this mesh of {self.world_size} devices")
        return dict(zip(self.mesh.axis_names, (int(c) for c in where[0])))

    def group_rank(self, rank: int, axes: Sequence[str]) -> int:
        """Index of global ``rank`` inside its group along ``axes`` (== ``lax.axis_index(axes)``)."""
        coords = self.coordinates(rank)
        index = 0
        for a in axes:
            index = index * self.mesh.shape[a] + coords[a]
        return index

    def group_of(self, rank: int, axes: Sequence[str]) -> list[int]:
        """The group along ``axes`` that contains global ``rank``."""
        for group in self.groups(axes):
            if rank in group:
                return group
        raise ValueError(f"rank {rank} is not in this mesh")

    def rank_at(self, rank: int, **coords: int) -> int:
        """Global rank of the device that shares ``rank``'s coordinates except ``coords``."""
        c = self.coordinates(rank)
        c.update(coords)
        return int(self.device_ranks[tuple(c[a] for a in self.mesh.axis_names)])


def device_host(device: jax.Device) -> int:
    """The host a device sits on, as an index (``core.runtime.cluster.process_host_index``)."""
    return process_host_index(device.process_index)


def _global_devices(devices: Sequence[jax.Device] | None, host_of: Callable[[jax.Device], Hashable]) -> list:
    """Devices in global-rank order: host by host, then by process and device id, so that the
    consecutive ranks of the fastest mesh axes (tp first) share a host whatever order the
    launcher gave the processes (e.g. ``mpirun --map-by node`` places them round-robin)."""
    devs = list(jax.devices() if devices is None else devices)
    hosts = {d: host_of(d) for d in devs}
    order = {h: i for i, h in enumerate(dict.fromkeys(hosts[d] for d in sorted(devs, key=_process_order)))}
    return sorted(devs, key=lambda d: (order[hosts[d]], _process_order(d)))


def _process_order(d: jax.Device) -> tuple[int, int]:
    return d.process_index, d.id


def _warn_if_tp_spans_hosts(state: ParallelState, devs: list, host_of: Callable[[jax.Device], Hashable]) -> None:
    """Tensor parallelism all-reduces activations in every layer: warn (on process 0, with the
    numbers) when its groups must cross hosts."""
    tp = state.tensor_model_parallel_size
    spans = [len({host_of(devs[r]) for r in group}) for group in state.groups((TP_AXIS,))]
    if max(spans) <= 1 or jax.process_index() != 0:
        return
    per_host: dict[Hashable, int] = {}
    for d in devs:
        per_host[host_of(d)] = per_host.get(host_of(d), 0) + 1
    warnings.warn(
        f"tensor-parallel groups of {tp} devices span up to {max(spans)} hosts (the smallest host has "
        f"{min(per_host.values())} devices): their activation all-reduces cross the network in every layer; "
        "use a tensor-model-parallel size that fits in a host", stacklevel=3)


def _validate_sizes(world: int, tp: int, pp: int, vpp: int | None, cp: int, ep: int) -> int:
    for name, size in (("tensor", tp), ("pipeline", pp), ("context", cp), ("expert", ep)):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{name}_model_parallel_size must be a positive int, got {size!r}")
    model = tp * pp * cp
    if world % model:
        raise RuntimeError(
            f"world_size ({world}) is not divisible by tensor_model_parallel_size ({tp}) x "
            f"pipeline_model_parallel_size ({pp}) x context_parallel_size ({cp}) = {model}"
        )
    dp = world // model
    if vpp is not None:
        if not isinstance(vpp, int) or vpp < 1:
            raise ValueError(f"virtual_pipeline_model_parallel_size must be a positive int, got {vpp!r}")
        if pp < 2:
            raise ValueError(
                f"virtual_pipeline_model_parallel_size ({vpp}) needs pipeline_model_parallel_size > 1 "
                f"(got {pp})"
            )
    if dp % ep:
        raise RuntimeError(
            f"data_parallel_size ({dp}) is not divisible by expert_model_parallel_size ({ep}); "
            "experts are parallelised inside the data-parallel group"
        )
    return dp


def _check_against_rank_generators(state: ParallelState) -> None:
    """The mesh must reproduce Megatron's dense and expert groups; fail loudly otherwise.

    With cp > 1 and ep > 1 Megatron's expert-parallel groups take ep from the ranks next to tp,
    across cp, which no mesh axis is; here an expert-parallel group is instead the ranks that share
    their cp (and dp / ep) coordinate. Dropless routing sends each token to its chosen experts
    wherever they live, so the results are the same; only which ranks hold which experts differs.
    """
    s = state
    dense = RankGenerator(s.tensor_model_parallel_size, 1, s.data_parallel_size,
                          s.pipeline_model_parallel_size, s.context_parallel_size, s.order)
    checks = {
        ("dense", "tp"): (dense, (TP_AXIS,)),
        ("dense", "pp"): (dense, (PP_AXIS,)),
        ("dense", "cp"): (dense, (CP_AXIS,)),
        ("dense", "dp"): (dense, s.data_parallel_axis_name),
        ("dense", "dp-cp"): (dense, s.data_parallel_with_context_axis_name),
    }
    expert = _expert_checks(s)
    checks.update(expert)
    for (kind, token), (gen, axes) in checks.items():
        want = sorted(gen.get_ranks(token))
        got = sorted(s.groups(s.axis_names(*axes)))
        if want != got:
            raise ValueError(
                f"order {s.order!r} with tp={s.tensor_model_parallel_size}, cp={s.context_parallel_size}, "
                f"ep={s.expert_model_parallel_size}, dp={s.data_parallel_size}, "
                f"pp={s.pipeline_model_parallel_size} cannot be expressed as one mesh: Megatron's "
                f"{kind} {token} groups differ. Put 'ep' directly before 'dp' in the order."
            )
    n = s.num_distributed_optimizer_instances
    if n == 1:
        return
    # Megatron's intra-instance groups: contiguous blocks ranks[i*g:(i+1)*g] of each dp-cp group.
    data_groups = {("dense", "dp-cp"): checks[("dense", "dp-cp")]}
    data_groups.update({key: check for key, check in expert.items() if key[1] in ("dp", "dp-cp")})
    for (kind, token), (gen, axes) in data_groups.items():
        g = len(gen.get_ranks(token)[0]) // n
        want = sorted(group[i * g:(i + 1) * g] for group in gen.get_ranks(token) for i in range(n))
        got = sorted(s.groups(tuple(a for a in s.axis_names(*axes) if a != DPO_AXIS)))
        if want != got:
            raise ValueError(
                f"order {s.order!r} with dp={s.data_parallel_size}, cp={s.context_parallel_size}, "
                f"ep={s.expert_model_parallel_size}: Megatron's {kind} intra-instance groups of "
                f"num_distributed_optimizer_instances={n} (contiguous blocks of the {token} group) are not slices "
                "of the mesh's outer data-parallel axis; put 'dp' after 'cp' in the order.")


def _expert_checks(s: ParallelState) -> dict[tuple[str, str], tuple[RankGenerator, tuple[str, ...]]]:
    """The expert groups to check: Megatron's expert generator when cp is 1 (or ep is 1); with
    both > 1 the ep sub-axis of the dense generator (ep groups inside one cp index, see
    :func:`_check_against_rank_generators`) and the expert-data-parallel group dp/ep x cp."""
    tp, pp, cp, ep = (s.tensor_model_parallel_size, s.pipeline_model_parallel_size, s.context_parallel_size,
                      s.expert_model_parallel_size)
    if cp > 1 and ep > 1:
        split = RankGenerator(tp, ep, s.expert_data_parallel_size, pp, cp, s.order)
        return {("expert", "ep"): (split, (EP_AXIS,)), ("expert", "pp"): (split, (PP_AXIS,)),
                ("expert", "dp-cp"): (split, (DPO_AXIS, DP_AXIS, CP_AXIS))}
    expert = RankGenerator(tp, ep, s.expert_data_parallel_size * cp, pp, 1, s.order)
    checks = {("expert", "ep"): (expert, (EP_AXIS,)), ("expert", "pp"): (expert, (PP_AXIS,))}
    if cp == 1:
        checks[("expert", "dp")] = (expert, (DPO_AXIS, DP_AXIS))
    return checks


def build_parallel_state(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    order: str = DEFAULT_ORDER,
    devices: Sequence[jax.Device] | None = None,
    host_of: Callable[[jax.Device], Hashable] | None = None,
    num_distributed_optimizer_instances: int = 1,
) -> ParallelState:
    """Build a :class:`ParallelState` over ``devices`` (default: all global devices).

    Global ranks follow the devices host by host (``host_of``, default :func:`device_host`),
    then by process and device id, so tensor-parallel groups stay inside a host whenever tp
    divides a host's device count; a warning names the numbers when they cannot. With one host,
    or hosts whose processes are numbered consecutively (the launchers' default), rank ``r`` is
    the ``r``-th device by (process, id).

    ``num_distributed_optimizer_instances`` = N > 1 adds the outer data-parallel axis ``"dpo"`` of
    size N right before ``"dp"`` (which keeps dp / (ep x N)); N must divide dp / ep.

    Pure with respect to module state: nothing is stored. Raises ``RuntimeError`` or
    ``ValueError`` naming the offending numbers; the checks depend only on the arguments
    and the world size, so every rank raises the same error before any communication.
    """
    host_of = host_of or device_host
    devs = _global_devices(devices, host_of)
    tp, pp, vpp = tensor_model_parallel_size, pipeline_model_parallel_size, virtual_pipeline_model_parallel_size
    cp, ep = context_parallel_size, expert_model_parallel_size
    dp = _validate_sizes(len(devs), tp, pp, vpp, cp, ep)
    n = num_distributed_optimizer_instances
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"num_distributed_optimizer_instances must be a positive int, got {n!r}")
    if (dp // ep) % n:
        raise ValueError(f"num_distributed_optimizer_instances={n} does not divide the data-parallel axis: "
                         f"data_parallel_size {dp} / expert_model_parallel_size {ep} = {dp // ep}")
    gen = RankGenerator(tp, ep, dp // ep, pp, cp, order)  # raises for an order missing an axis
    tokens = gen.order.split("-")
    axis_size = {TP_AXIS: tp, CP_AXIS: cp, EP_AXIS: ep, DP_AXIS: dp // ep // n, PP_AXIS: pp, DPO_AXIS: n}
    mesh_axes = tuple(tokens[::-1])
    if n > 1:  # the instances' axis, major to what stays of dp
        at = mesh_axes.index(DP_AXIS)
        mesh_axes = mesh_axes[:at] + (DPO_AXIS,) + mesh_axes[at:]
    shape = tuple(axis_size[a] for a in mesh_axes)
    ranks = np.arange(len(devs)).reshape(shape)
    mesh = Mesh(np.array(devs, dtype=object)[ranks], mesh_axes)
    state = ParallelState(mesh, tp, pp, vpp, cp, ep, dp, gen.order, ranks, num_distributed_optimizer_instances=n)
    _check_against_rank_generators(state)
    _warn_if_tp_spans_hosts(state, devs, host_of)
    return state


# ---------------------------------------------------------------------------------------
# Process-wide facade (Megatron's module functions)
# ---------------------------------------------------------------------------------------

_STATE: ParallelState | None = None


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    order: str = DEFAULT_ORDER,
    num_distributed_optimizer_instances: int = 1,
) -> ParallelState:
    """Megatron's ``initialize_model_parallel``: build the global mesh and make it the default.

    Initialises ``jax.distributed`` first when launched by mpirun and not done yet. Returns the
    :class:`ParallelState`, which may also be passed around explicitly.
    """
    global _STATE
    if _STATE is not None:
        raise RuntimeError(
            "model parallel state is already initialized "
            f"(tp={_STATE.tensor_model_parallel_size}, pp={_STATE.pipeline_model_parallel_size}, "
            f"dp={_STATE.data_parallel_size}); call destroy_model_parallel() first"
        )
    initialize_distributed()
    _STATE = build_parallel_state(
        tensor_model_parallel_size, pipeline_model_parallel_size, virtual_pipeline_model_parallel_size,
        context_parallel_size, expert_model_parallel_size, order,
        num_distributed_optimizer_instances=num_distributed_optimizer_instances,
    )
    return _STATE


def destroy_model_parallel() -> None:
    """Forget the default parallel state (``jax.distributed`` stays initialised)."""
    global _STATE
    _STATE = None


def model_parallel_is_initialized() -> bool:
    """Whether :func:`initialize_model_parallel` has run (and not been destroyed)."""
    return _STATE is not None


def get_parallel_state() -> ParallelState:
    """The default :class:`ParallelState`; raises if none is initialised."""
    if _STATE is None:
        raise RuntimeError("model parallel state is not initialized; call initialize_model_parallel()")
    return _STATE


def set_parallel_state(state: ParallelState | None) -> None:
    """Install ``state`` as the default (tests and libraries that build states explicitly)."""
    global _STATE
    _STATE = state


def get_mesh() -> Mesh:
    """The global device mesh."""
    return get_parallel_state().mesh


def _my_rank(state: ParallelState) -> int:
    """Global rank of this process's first local device."""
    local = jax.local_devices()[0]
    for rank, dev in zip(state.device_ranks.flat, state.mesh.devices.flat):
        if dev == local:
            return int(rank)
    raise RuntimeError("this process owns no device of the mesh")


def get_global_rank() -> int:
    """Global rank of this process (of its first local device)."""
    return _my_rank(get_parallel_state())


def _size_rank(axes: Sequence[str]) -> tuple[int, int]:
    s = get_parallel_state()
    axes = s.axis_names(*axes)
    size = int(np.prod([s.mesh.shape[a] for a in axes]))
    return size, s.group_rank(_my_rank(s), axes)


# Axis names (what collectives inside shard_map take).
def get_tensor_model_parallel_axis_name() -> str:
    """Mesh axis of the tensor-parallel group."""
    return TP_AXIS


def get_pipeline_model_parallel_axis_name() -> str:
    """Mesh axis of the pipeline-parallel group."""
    return PP_AXIS


def get_context_parallel_axis_name() -> str:
    """Mesh axis of the context-parallel group."""
    return CP_AXIS


def get_expert_model_parallel_axis_name() -> str:
    """Mesh axis of the expert-parallel group."""
    return EP_AXIS


def get_expert_data_parallel_axis_name() -> tuple[str, ...]:
    """Mesh axes of the expert-data-parallel group: the data parallelism left after experts, times
    cp as in Megatron (``("dp",)`` at cp 1, ``("dp", "cp")`` in mesh order otherwise)."""
    return get_parallel_state().expert_data_parallel_with_context_axis_name


def get_data_parallel_axis_name(with_context_parallel: bool = False) -> tuple[str, ...]:
    """Mesh axes of the dense data-parallel group (optionally times context parallelism)."""
    s = get_parallel_state()
    return s.data_parallel_with_context_axis_name if with_context_parallel else s.data_parallel_axis_name


# World sizes and host-side ranks.
def get_tensor_model_parallel_world_size() -> int:
    """Number of tensor-parallel ranks."""
    return get_parallel_state().tensor_model_parallel_size


def get_tensor_model_parallel_rank() -> int:
    """This process's tensor-parallel rank (host value; use lax.axis_index inside shard_map)."""
    return _size_rank((TP_AXIS,))[1]


def get_pipeline_model_parallel_world_size() -> int:
    """Number of pipeline stages."""
    return get_parallel_state().pipeline_model_parallel_size


def get_pipeline_model_parallel_rank() -> int:
    """This process's pipeline stage (host value)."""
    return _size_rank((PP_AXIS,))[1]


def get_context_parallel_world_size() -> int:
    """Number of context-parallel ranks."""
    return get_parallel_state().context_parallel_size


def get_context_parallel_rank() -> int:
    """This process's context-parallel rank (host value)."""
    return _size_rank((CP_AXIS,))[1]


def get_expert_model_parallel_world_size() -> int:
    """Number of expert-parallel ranks."""
    return get_parallel_state().expert_model_parallel_size


def get_expert_model_parallel_rank() -> int:
    """This process's expert-parallel rank (host value)."""
    return _size_rank((EP_AXIS,))[1]


def get_expert_data_parallel_world_size() -> int:
    """Size of the expert-data-parallel group (dp / ep x cp, Megatron's)."""
    return get_parallel_state().replica_size(expert=True)


def get_expert_data_parallel_rank() -> int:
    """This process's expert-data-parallel rank (host value)."""
    return _size_rank((DPO_AXIS, DP_AXIS, CP_AXIS))[1]


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    """Dense data-parallel size (times cp when ``with_context_parallel``)."""
    s = get_parallel_state()
    return s.data_parallel_size * (s.context_parallel_size if with_context_parallel else 1)


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    """This process's dense data-parallel rank (host value)."""
    return _size_rank(get_data_parallel_axis_name(with_context_parallel))[1]


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    """Model chunks per pipeline stage (None without the interleaved schedule)."""
    return get_parallel_state().virtual_pipeline_model_parallel_size


# Pipeline topology.
def _pp_ranks() -> list[int]:
    s = get_parallel_state()
    return s.group_of(_my_rank(s), (PP_AXIS,))


def get_pipeline_model_parallel_first_rank() -> int:
    """Global rank of the first stage in this process's pipeline."""
    return _pp_ranks()[0]


def get_pipeline_model_parallel_last_rank() -> int:
    """Global rank of the last stage in this process's pipeline."""
    return _pp_ranks()[-1]


def get_pipeline_model_parallel_next_rank() -> int:
    """Global rank of the next stage (wraps around, as in Megatron)."""
    ranks, me = _pp_ranks(), get_pipeline_model_parallel_rank()
    return ranks[(me + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    """Global rank of the previous stage (wraps around, as in Megatron)."""
    ranks, me = _pp_ranks(), get_pipeline_model_parallel_rank()
    return ranks[(me - 1) % len(ranks)]


def is_pipeline_first_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """Whether this process is on the first stage (and, with virtual stages, chunk 0)."""
    vpp = get_virtual_pipeline_model_parallel_world_size()
    if not ignore_virtual and vpp is not None and vp_stage is not None and vp_stage != 0:
        return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """Whether this process is on the last stage (and, with virtual stages, the last chunk)."""
    vpp = get_virtual_pipeline_model_parallel_world_size()
    if not ignore_virtual and vpp is not None and vp_stage is not None and vp_stage != vpp - 1:
        return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def get_embedding_ranks() -> list[int]:
    """Ranks holding the (tied) word embeddings: first and last stage of this pipeline."""
    ranks = _pp_ranks()
    return [ranks[0]] if len(ranks) == 1 else [ranks[0], ranks[-1]]


def get_position_embedding_ranks() -> list[int]:
    """Ranks holding the position embeddings: the first stage of this pipeline."""
    return [_pp_ranks()[0]]


def is_rank_in_embedding_group(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """Whether this process holds word embeddings (first or last stage)."""
    if get_global_rank() not in get_embedding_ranks():
        return False
    if ignore_virtual:
        return True
    return is_pipeline_first_stage(False, vp_stage) or is_pipeline_last_stage(False, vp_stage)
