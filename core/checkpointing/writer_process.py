"""The writer process of ``--async-save``: Megatron's persistent checkpoint worker, in JAX.

Why a process: a background *thread* shares the training process's GIL. Orbax's save is mostly
Python (asyncio, per-array handlers), and each time the training loop needs the GIL back to
dispatch a step it may wait up to Python's switch interval (5 ms) for the writer to drop it.
A dispatch-bound loop (a small model on a GPU) then loses tens of ms per save. A separate
process shares no GIL, no XLA client and no thread pools with the loop; on the CPU backend it
also runs at the lowest priority as a whole.

How: each training process starts one writer (:class:`WriterProcess`) at its first
asynchronous save. The writers form their own ``jax.distributed`` job on the CPU: training
process ``i``'s writer is process ``i`` there, with as many CPU devices as process ``i``
drives. So every global array of the training state has a twin in the writers' job: the same
global shape and sharding, each device's shard held by the writer of the process that holds
it. A save copies the process's shards (one per distinct index; on GPUs staged in pinned host
memory, as orbax stages its transfers there) into a shared-memory buffer (``memfd``, mapped by
both processes; the copies run outside the GIL) and sends the pytree,
its arrays replaced by their descriptions, through a socket. The writer wraps the buffer's
shards as CPU arrays of its twin devices and runs :func:`core.checkpointing.step_writer._write_step`, the
same sequence (shards, barriers, commit marker, integrity record, retention) a synchronous
save runs, so the files are identical. The training process's background thread then only
waits for the answer (outside the GIL).

The writer dies with its training process (``PR_SET_PDEATHSIG`` and end-of-file on the
socket), so a killed rank leaves no orphan; an error in the writer is sent back and raised by
the next save; a writer that died is reported as ``OSError`` naming its exit status.
"""

from __future__ import annotations

import logging
import mmap
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from core.runtime import cluster

_WRITER_MAIN = "import sys; from core.checkpointing.writer_process import main; main(sys.argv[1:])"
"""The writer process's program (``python -c``)."""

WRITER_NICE = 19
"""The writer process's nice value on the CPU backend (Linux): it takes the cycles the steps leave."""

ALIGNMENT = 64
"""Byte alignment of each shard in the shared buffer (so the writer's CPU arrays may alias it)."""

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("!Q")  # the byte length of the pickled message that follows


def available() -> bool:
    """Whether this platform supports the writer process (Linux: ``memfd`` and fd passing)."""
    return hasattr(os, "memfd_create") and hasattr(socket, "send_fds") and sys.platform.startswith("linux")


# ---------------------------------------------------------------------------------------
# Messages: a pickled object after its length, optionally with file descriptors
# ---------------------------------------------------------------------------------------


def _send(sock: socket.socket, message: Any, fds: tuple[int, ...] = ()) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    header = _HEADER.pack(len(data))
    if fds:
        socket.send_fds(sock, [header], list(fds))
    else:
        sock.sendall(header)
    sock.sendall(data)


def _recv_exactly(sock: socket.socket, n: int, start: bytes = b"") -> bytes:
    chunks, have = [start], len(start)
    while have < n:
        chunk = sock.recv(n - have)
        if not chunk:
            raise EOFError("the other end closed the socket")
        chunks.append(chunk)
        have += len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket) -> tuple[Any, list[int]]:
    header, fds, _, _ = socket.recv_fds(sock, _HEADER.size, 4)
    if not header:
        raise EOFError("the other end closed the socket")
    (length,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size, header))
    return pickle.loads(_recv_exactly(sock, length)), fds


# ---------------------------------------------------------------------------------------
# Describing the state: devices as (process, ordinal), arrays as shards in the buffer
# ---------------------------------------------------------------------------------------


def _device_ordinals(devices: list) -> dict[Any, tuple[int, int]]:
    """Each device as ``(process index, position among that process's devices by id)``: the
    name its twin has in the writers' job."""
    ordinals = {}
    for process in sorted({d.process_index for d in devices}):
        for i, d in enumerate(sorted((d for d in devices if d.process_index == process), key=lambda d: d.id)):
            ordinals[d] = (process, i)
    return ordinals


@dataclass(frozen=True)
class _ShardedArray:
    """A ``jax.Array`` leaf as sent to the writer: where its local shards lie in the buffer."""

    shape: tuple[int, ...]
    dtype: str
    sharding: tuple
    """``("named", device grid shape, (process, ordinal) per grid cell, axis names, spec)`` or
    ``("single", (process, ordinal))``."""
    shards: tuple[tuple[tuple[int, int], tuple[int, ...], int], ...]
    """Per local device: its (process, ordinal), the shard's shape, its byte offset in the buffer."""


def _describe_sharding(sharding: Any, ordinals: dict) -> tuple:
    from jax.sharding import NamedSharding, SingleDeviceSharding

    if isinstance(sharding, NamedSharding):
        mesh = sharding.mesh
        return ("named", mesh.devices.shape, tuple(ordinals[d] for d in mesh.devices.flat), mesh.axis_names,
                sharding.spec)
    if isinstance(sharding, SingleDeviceSharding):
        return ("single", ordinals[next(iter(sharding.device_set))])
    raise TypeError(f"the checkpoint writer process handles NamedSharding and SingleDeviceSharding arrays, "
                    f"not {type(sharding).__name__}")


def _plan(leaves: list, treedef: Any, ordinals: dict) -> tuple[Any, list[tuple[int, int, int]], int]:
    """``(tree, copies, size)``: the state (``leaves`` of ``treedef``) with each ``jax.Array``
    replaced by a :class:`_ShardedArray`; for each distinct local shard, (leaf number, its position
    among the leaf's addressable shards, byte offset); the buffer size they need. It depends only
    on the leaves' shapes, dtypes and shardings (see :func:`_plan_key`)."""
    import jax

    copies, size = [], 0

    def describe(number: int, leaf: Any) -> Any:
        nonlocal size
        if not isinstance(leaf, jax.Array):
            return leaf
        offsets: dict[tuple, int] = {}
        shards = []
        for position, shard in enumerate(leaf.addressable_shards):
            key = tuple((s.start, s.stop, s.step) for s in shard.index)
            if key not in offsets:  # replicas on this process's devices share one copy
                offsets[key] = size
                copies.append((number, position, size))
                size += -(-shard.data.nbytes // ALIGNMENT) * ALIGNMENT
            shards.append((ordinals[shard.device], tuple(shard.data.shape), offsets[key]))
        return _ShardedArray(tuple(leaf.shape), str(leaf.dtype), _describe_sharding(leaf.sharding, ordinals),
                             tuple(shards))

    return jax.tree.unflatten(treedef, [describe(i, x) for i, x in enumerate(leaves)]), copies, size


def _plan_key(leaves: list, treedef: Any) -> tuple | None:
    """What :func:`_plan` depends on, when every leaf is a ``jax.Array`` (else None: not cached)."""
    import jax

    if not all(isinstance(x, jax.Array) for x in leaves):
        return None
    return treedef, tuple((x.shape, x.dtype, x.sharding) for x in leaves)


# ---------------------------------------------------------------------------------------
# The training process's side
# ---------------------------------------------------------------------------------------


def _to_host(sources: list, pinned_host: bool) -> list:
    """Start the device-to-host copies of ``sources`` (single-device arrays), all in flight
    before the caller's first wait; the arrays to read them from with ``np.asarray``.

    ``pinned_host`` (where the device has a ``pinned_host`` memory): one batched ``device_put``
    into pinned (page-locked) host memory, as orbax stages its own transfers on GPUs
    (``enable_pinned_host_transfer``, on by default there): a DMA at the link's speed, outside
    the steps' programs. (A jitted identity with outputs in pinned memory dispatches faster, but
    its copies would run inside a program on the training steps' stream, so in series with the
    steps: the whole state at PCIe speed, a stall of the order of a second for a GPT of ~1B
    parameters with its Adam state.)
    Otherwise each array's ``copy_to_host_async``: on a GPU a copy into pageable memory, which
    the driver stages through its own pinned buffers; on the CPU backend the values are host
    memory already."""
    import jax

    out = list(sources)
    staged = []
    for i, x in enumerate(sources):
        device = next(iter(x.devices()))
        if pinned_host and any(m.kind == "pinned_host" for m in device.addressable_memories()):
            staged.append(i)
        else:
            x.copy_to_host_async()
    if staged:
        puts = jax.device_put([sources[i] for i in staged],
                              [sources[i].sharding.with_memory_kind("pinned_host") for i in staged])
        for i, put in zip(staged, puts):
            out[i] = put
    return out


def coordinator_address() -> str:
    """``host:port`` for the writers' job (process 0 proposes it): this host (or
    ``JAX_COORDINATOR_IP``) and a free port, as :func:`core.runtime.cluster.coordinator_address` picks
    them, never the training job's own address or port."""
    environ = {k: v for k, v in os.environ.items() if k not in ("JAX_COORDINATOR_ADDRESS", "JAX_COORDINATOR_PORT")}
    return cluster.coordinator_address(0, environ)


class WriterProcess:
    """A training process's checkpoint writer process (see the module docstring).

    Collective: every process creates it at the same point (its writers' job needs one
    coordinator address, chosen by process 0). Create it on the main thread: the writer is
    killed when the thread that started it ends (``PR_SET_PDEATHSIG``).
    """

    def __init__(self, coordinator_address: str | None, lowest_priority: bool, pinned_host_transfer: bool = False):
        import jax

        import core

        self._devices = _device_ordinals(jax.devices())
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the parent's tuning is not the writer's
        env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(jax.local_device_count()),
                   PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(core.__file__)),
                                                            os.environ.get("PYTHONPATH")])))
        # Started through -c, not -m: running the module as __main__ would import it twice (the
        # package imports it first), and unpickled messages must name this module's classes.
        command = [sys.executable, "-c", _WRITER_MAIN, str(child.fileno()),
                   coordinator_address or "", str(jax.process_count()), str(jax.process_index()),
                   "1" if lowest_priority else "0"]
        self._process = subprocess.Popen(command, pass_fds=[child.fileno()], env=env)
        child.close()
        self._sock = parent
        self._ready = False
        self._buffer: mmap.mmap | None = None
        self.startup_s: float | None = None
        """Seconds the writer took to start (import JAX, join its job), once it has."""
        self._last_plan: tuple[tuple | None, tuple | None] = (None, None)  # (_plan_key, _plan) of the last save
        self.pinned_host_transfer = pinned_host_transfer
        """Stage the device-to-host copies in pinned host memory (orbax's
        ``enable_pinned_host_transfer``; see :func:`_to_host`)."""
        self.phases: dict[str, float] = {}
        """The last :meth:`write`'s seconds on this (training) process's side: ``plan`` (describe
        the state), ``snapshot`` (wait for its values), ``to_host`` (start the device-to-host
        copies and wait for them), ``shared_buffer`` (copy them into the shared buffer),
        ``writer`` (the writer's write and commit), and ``thread_cpu`` (the CPU time of the
        thread that ran it: what may contend with the training loop)."""

    @property
    def pid(self) -> int:
        """The writer's process id."""
        return self._process.pid

    @property
    def alive(self) -> bool:
        """Whether the writer process is still running."""
        return self._process.poll() is None

    def _ended(self, cause: BaseException) -> OSError:
        """The error for a writer that is gone (its exit status once it is reaped)."""
        try:
            code = self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            return OSError(f"the checkpoint writer process {self.pid} stopped answering ({cause})")
        how = f"signal {-code}" if code < 0 else f"exit status {code}"
        return OSError(f"the checkpoint writer process {self.pid} ended ({how})")

    def _send(self, message: Any, fds: tuple[int, ...] = ()) -> None:
        try:
            _send(self._sock, message, fds)
        except OSError as e:  # a broken pipe: the writer is gone
            raise self._ended(e) from e

    def _receive(self) -> Any:
        try:
            return _recv(self._sock)[0]
        except (EOFError, OSError) as e:
            raise self._ended(e) from e

    def _ensure_buffer(self, size: int) -> None:
        if self._buffer is not None and len(self._buffer) >= size:
            return
        size = max(-(-size // (1 << 21)) * (1 << 21), 1 << 21)  # whole 2 MiB pages
        fd = os.memfd_create("megatron-core-jax-checkpoint", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            buffer = mmap.mmap(fd, size)
            self._send(("buffer", size), (fd,))
        finally:
            os.close(fd)
        if self._buffer is not None:
            self._buffer.close()
        self._buffer = buffer

    def write(self, directory: str, step: int, state: Any, metadata: dict, max_to_keep: int | None,
              save_id: int) -> None:
        """Copy ``state``'s local shards to the writer and have it write and commit ``step``
        (collective; the caller's background thread). Raises the writer's error."""
        import jax

        if not self._ready:
            self.startup_s = self._receive()[1]
            self._ready = True
        cpu, clock = time.thread_time(), [time.perf_counter()]
        phases = self.phases = {}

        def phase(name: str) -> None:
            clock.append(time.perf_counter())
            phases[name] = clock[-1] - clock[-2]

        leaves, treedef = jax.tree.flatten(state)
        key = _plan_key(leaves, treedef)
        if key is None or key != self._last_plan[0]:
            # Describing the shards is Python per leaf (time on this thread, which a
            # dispatch-bound training loop waits for): once per state layout, and a training
            # run saves the same state every time.
            self._last_plan = (key, _plan(leaves, treedef, self._devices))
        tree, entries, size = self._last_plan[1]
        # addressable_data, not addressable_shards: no Shard object per shard (much cheaper).
        copies = [(leaves[number].addressable_data(position), offset) for number, position, offset in entries]
        self._ensure_buffer(size)
        phase("plan")
        # Wait for the snapshot first (outside the GIL): a host transfer started on a buffer not
        # yet computed would hold one of XLA's CPU threads, which a step's collective may need.
        jax.block_until_ready([source for source, _ in copies])
        phase("snapshot")
        try:
            fill = self._copy_to_buffer(copies, self.pinned_host_transfer)
        except Exception as e:  # pinned host memory unsupported or exhausted: pageable copies still work
            if not self.pinned_host_transfer:
                raise
            logger.warning("checkpoint: staging in pinned host memory failed (%s: %s); device-to-host copies "
                           "go to pageable memory from now on", type(e).__name__, e)
            self.pinned_host_transfer = False
            fill = self._copy_to_buffer(copies, False)
        phase("to_host")
        phases["to_host"] -= fill
        phases["shared_buffer"] = fill
        self._send(("save", directory, step, tree, metadata, max_to_keep, save_id))
        answer = self._receive()
        phase("writer")
        phases["thread_cpu"] = time.thread_time() - cpu
        if answer[0] == "error":
            _, kind, message = answer
            raise (ValueError if kind == "ValueError" else OSError)(
                message if kind in ("OSError", "ValueError") else f"{kind}: {message}")

    def _copy_to_buffer(self, copies: list[tuple[Any, int]], pinned_host: bool) -> float:
        """Copy each ``(shard, offset)`` of ``copies`` to the host (:func:`_to_host`) and into the
        shared buffer at its offset; returns the seconds spent in the latter copies."""
        transfers = _to_host([source for source, _ in copies], pinned_host)
        buffer, fill = np.frombuffer(self._buffer, dtype=np.uint8), 0.0
        try:
            for i, (_, offset) in enumerate(copies):
                host = np.asarray(transfers[i])  # waits for this transfer (outside the GIL)
                transfers[i] = None  # a staging buffer is freed once copied
                start = time.perf_counter()
                buffer[offset:offset + host.nbytes] = host.reshape(-1).view(np.uint8)
                fill += time.perf_counter() - start
        finally:
            del buffer  # no export of the mapping left: a later, larger buffer may replace it
        return fill

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop the writer (collective: the writers leave their job together); kill it if it
        does not answer within ``timeout_s``."""
        try:
            if self.alive:
                self._sock.settimeout(timeout_s)
                self._send(("exit",))
                self._receive()
            self._process.wait(timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            self._process.kill()
            self._process.wait()
        finally:
            self._sock.close()
            if self._buffer is not None:
                self._buffer.close()
                self._buffer = None


# ---------------------------------------------------------------------------------------
# The writer's side
# ---------------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """Have the kernel SIGKILL this process when the process that started it ends."""
    import ctypes

    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the parent ended before the prctl took effect
        os._exit(1)


class _Writer:
    """The writer's state: its twin devices, the shared buffer, the meshes built so far."""

    def __init__(self):
        import jax

        self.devices = {ordinal: d for d, ordinal in _device_ordinals(jax.devices()).items()}
        self.buffer: mmap.mmap | None = None
        self._meshes: dict[tuple, Any] = {}

    def _sharding(self, description: tuple) -> Any:
        from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

        if description[0] == "single":
            return SingleDeviceSharding(self.devices[description[1]])
        _, shape, grid, axis_names, spec = description
        key = (shape, grid, axis_names)
        if key not in self._meshes:
            devices = np.empty(len(grid), dtype=object)
            devices[:] = [self.devices[g] for g in grid]
            self._meshes[key] = Mesh(devices.reshape(shape), axis_names)
        return NamedSharding(self._meshes[key], spec)

    def array(self, leaf: _ShardedArray) -> Any:
        """The twin of a training process's array: its shards read from the buffer."""
        import jax
        import jax.numpy as jnp

        dtype = jnp.dtype(leaf.dtype)
        shards = [jax.device_put(np.ndarray(shape, dtype, buffer=self.buffer, offset=offset), self.devices[device])
                  for device, shape, offset in leaf.shards]
        return jax.make_array_from_single_device_arrays(leaf.shape, self._sharding(leaf.sharding), shards)

    def save(self, directory: str, step: int, tree: Any, metadata: dict, max_to_keep: int | None,
             save_id: int) -> None:
        import jax

        from core.checkpointing.step_writer import _write_step

        state = jax.tree.map(lambda x: self.array(x) if isinstance(x, _ShardedArray) else x, tree)
        _write_step(directory, step, state, metadata, max_to_keep, save_id)

    def set_buffer(self, fd: int, size: int) -> None:
        if self.buffer is not None:
            try:
                self.buffer.close()
            except BufferError:  # an array still aliases it: let the garbage collector close it
                pass
        self.buffer = mmap.mmap(fd, size)
        os.close(fd)


def _serve(sock: socket.socket, processes: int) -> None:
    import jax

    writer = _Writer()
    while True:
        try:
            message, fds = _recv(sock)
        except (EOFError, ConnectionError):  # the training process ended: nothing left to write
            os._exit(0)
        if message[0] == "buffer":
            writer.set_buffer(fds[0], message[1])
        elif message[0] == "save":
            try:
                writer.save(*message[1:])
                answer: tuple = ("done",)
            except BaseException as e:  # sent back, raised by the training process
                answer = ("error", type(e).__name__, str(e))
            _send(sock, answer)
        elif message[0] == "exit":
            if processes > 1:
                jax.distributed.shutdown()  # together, so no writer loses the coordinator early
            _send(sock, ("bye",))
            os._exit(0)


def main(argv: list[str]) -> None:
    """The writer process (:data:`_WRITER_MAIN`'s arguments: ``FD ADDRESS PROCESSES INDEX NICE``)."""
    start = time.perf_counter()
    _die_with_parent()
    # A scheduler's warning signal (or Ctrl-C) reaches the whole job, this process too: it must
    # outlive it to write the checkpoint that --exit-signal-handler saves. It still ends with its
    # training process (the parent-death signal, end of file on the socket).
    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(number, signal.SIG_IGN)
    fd, address, processes, index, lowest = int(argv[0]), argv[1], int(argv[2]), int(argv[3]), argv[4] == "1"
    if lowest:
        os.nice(WRITER_NICE)
    import jax

    if processes > 1:
        jax.distributed.initialize(address, processes, index, cluster_detection_method="deactivate",
                                   initialization_timeout=300)
    jax.devices()
    sock = socket.socket(fileno=fd)
    _send(sock, ("ready", time.perf_counter() - start))
    _serve(sock, processes)


