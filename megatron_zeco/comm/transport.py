"""The All-Scan's transports: how a state travels from one rank's piece to the next.

One :class:`Transport` per way, each knowing what the scans, the run-time choice of shape and the cost
model need of it (:class:`Traits`):

* ``send_recv``: the process group's point-to-point messages (NCCL on GPUs, gloo on CPUs), host-issued,
  one per block; works everywhere, and runs the chain and the hierarchical shape (``hierarchical.py``).
* ``peer_memory``: one-sided stores into the next rank's memory and flags on the device, one Triton
  kernel per piece (``peer.py``, ``kernels/scan_hop.py``); on CUDA through torch symmetric memory (one
  node, NVLink), on the CPU through files in shared memory under ``TRITON_INTERPRET=1`` (tests).
* ``nvshmem``: the same kernels with NVSHMEM puts, across nodes.

Both device transports run the chain and the hierarchical shape (``peer_hierarchical.py``).

A user asks for one by name, or for ``auto`` (an operator's ``transport=``, a layer's ``cp_transport``,
``$MEGATRON_ZECO_TRANSPORT``): :func:`resolve` turns the request into a :class:`Transport` once per plan
(``cp.plan``), by the operator's rule for ``auto`` and the group's hosts, and every scan carries the
object from then on (``Route.transport``).

A process scans over one device transport: torch symmetric memory takes one backend per process (CUDA's
for peer memory, NVSHMEM's), fixed by its first allocation (:func:`claim_transport`).
"""

import os
import weakref
from dataclasses import dataclass
from enum import Enum
from typing import Optional

# Standard library only at import (the cost model and the run-time choice of shape load without torch).
AUTO = "auto"
TRANSPORT_ENV = "MEGATRON_ZECO_TRANSPORT"


@dataclass(frozen=True)
class Traits:
    """What the scans and the cost model need of a transport, as built.

    Attributes:
        device: the hops are device kernels (no host call per block; the step check watches their waits).
        one_node: every rank of the group must sit on one node.
        block_messages: the chain's blocks are separate host-issued messages (else tiles of one kernel).
        two_legs: a zigzag walk of diagonal maps runs as two legs of P - 1 hops at once.
        shapes: the scan shapes it runs (``chain``, ``hierarchical``).
        hop_cost: seconds per hop beyond the wire (receive -> combine -> send), for the run-time choice of
            shape and the cost model: the GPU time of a hop fitted on the measured scan rows (send/recv
            20.7 us, peer memory 5.8 us; docs/scaling.md), rounded; NVSHMEM, not measured, as peer memory.
    """

    device: bool
    one_node: bool = False
    block_messages: bool = True
    two_legs: bool = False
    shapes: tuple = ("chain",)
    hop_cost: float = 0.0


class Transport(str, Enum):
    """A transport of the All-Scan (see the module docstring); compares equal to its name."""

    SEND_RECV = "send_recv"
    PEER_MEMORY = "peer_memory"
    NVSHMEM = "nvshmem"

    @property
    def traits(self) -> Traits:
        return TRAITS[self]

    @property
    def device(self) -> bool:
        return self.traits.device

    @property
    def one_node(self) -> bool:
        return self.traits.one_node

    @property
    def block_messages(self) -> bool:
        return self.traits.block_messages

    @property
    def two_legs(self) -> bool:
        return self.traits.two_legs

    @property
    def shapes(self) -> tuple:
        return self.traits.shapes

    @property
    def hop_cost(self) -> float:
        return self.traits.hop_cost

    def __str__(self) -> str:
        return self.value

    def __hash__(self) -> int:  # as its name's: a transport and its name are one key
        return hash(self.value)

    @classmethod
    def parse(cls, value, what: str = "transport") -> "Transport":
        """The transport named ``value`` (or ``value`` itself); ValueError naming ``what`` and the choices."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{what} {value!r} is not one of {', '.join(t.value for t in cls)}") from None


TRAITS = {
    Transport.SEND_RECV: Traits(device=False, shapes=("chain", "hierarchical"), hop_cost=21e-6),
    # the device kernels run the chain (two legs under zigzag) and the hierarchical shape (peer_hierarchical.py)
    Transport.PEER_MEMORY: Traits(device=True, one_node=True, block_messages=False, two_legs=True,
                                  shapes=("chain", "hierarchical"), hop_cost=6e-6),
    Transport.NVSHMEM: Traits(device=True, block_messages=False, two_legs=True, shapes=("chain", "hierarchical"),
                              hop_cost=6e-6),
}
TRANSPORTS = {t.value: t for t in Transport}
CHOICES = (AUTO, *TRANSPORTS)  # what a user may ask for


def check_request(value) -> Optional[str]:
    """A problem with a requested transport (``auto`` or a transport's name), or None."""
    if value == AUTO or value in TRANSPORTS:
        return None
    return f"cp_transport {value!r} is not one of {', '.join(CHOICES)}"


# Layers built in this process that scan over a device transport: layer -> (transport, its name).
_CLAIMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def claim_transport(owner, requested, name: str) -> None:
    """Record that ``owner`` (a layer, named ``name``) scans over the transport ``requested``: at model
    build, so that a model whose layers ask for both device transports fails there, naming them, instead
    of at its first step. ValueError if a layer of this process that is still alive asks for the other
    one, or this process's symmetric memory already runs the other backend. ``auto`` claims nothing."""
    if requested not in TRANSPORTS or not Transport(requested).device:
        return
    transport = Transport(requested)
    for other, (theirs, who) in list(_CLAIMS.items()):
        if theirs is not transport and other is not owner:
            raise ValueError(f"{name}: cp_transport {transport.value!r}, but {who} in this process scans over "
                             f"{theirs.value!r}: a process runs one device transport (torch symmetric memory takes "
                             f"one backend per process). Give every layer the same cp_transport (or 'auto', which "
                             f"follows the other layers), or set ${TRANSPORT_ENV}")
    from .symmetric import backend

    used = backend()
    if used is not None and (used == "NVSHMEM") != (transport is Transport.NVSHMEM):
        raise ValueError(f"{name}: cp_transport {transport.value!r}, but this process already allocates symmetric "
                         f"memory with the {used!r} backend; use one transport per process (${TRANSPORT_ENV})")
    _CLAIMS[owner] = (transport, name)


def _process_transport() -> Optional[Transport]:
    """The device transport this process's layers, or its symmetric memory, have chosen (None: none yet)."""
    claimed = {transport for transport, _ in _CLAIMS.values()}
    if len(claimed) == 1:
        return claimed.pop()
    from .symmetric import backend

    used = backend()
    return None if used is None else (Transport.NVSHMEM if used == "NVSHMEM" else Transport.PEER_MEMORY)


def one_host(group) -> bool:
    """Whether every rank of ``group`` runs on this host (asked once per group; collective)."""
    from .nodes import host_nodes

    return len(set(host_nodes(group))) == 1


def resolve(requested, group, like, auto: Optional[str] = None) -> Transport:
    """The transport of the scans over ``group`` of states like ``like`` (a tensor), for the request
    ``requested`` (``auto`` or a transport's name). ``auto``: the operator's rule ``auto`` if it has one
    (``cp.config.RULES``: the delta rules' scans take ``send_recv``), else ``$MEGATRON_ZECO_TRANSPORT`` if
    set, else on one node the process's device transport (NVSHMEM where its layers asked for it, else peer
    memory) for CUDA states, else ``send_recv``. A device transport installs the step check
    (``watch.install_step_check``).
    ValueError where the transport cannot run here."""
    if requested == AUTO:
        requested = auto or os.environ.get(TRANSPORT_ENV) or (
            Transport.PEER_MEMORY if like.is_cuda and one_host(group) else Transport.SEND_RECV)
        if requested == Transport.PEER_MEMORY and _process_transport() is Transport.NVSHMEM:
            requested = Transport.NVSHMEM
    if requested not in TRANSPORTS:
        raise ValueError(f"unknown All-Scan transport {requested!r}; expected one of {', '.join(CHOICES)}"
                         f" (argument transport, layer cp_transport, or ${TRANSPORT_ENV})")
    transport = Transport(requested)
    if transport is Transport.PEER_MEMORY:
        if like.is_cuda and not one_host(group):
            raise ValueError("All-Scan transport 'peer_memory' needs every rank of the CP group on one node; "
                             "use transport='nvshmem' or 'send_recv'")
        if not like.is_cuda and not os.environ.get("TRITON_INTERPRET"):
            raise ValueError("All-Scan transport 'peer_memory' on the CPU runs its Triton kernel under "
                             "TRITON_INTERPRET=1 (for tests); use transport='send_recv'")
    if transport is Transport.NVSHMEM:
        if not like.is_cuda:
            raise ValueError("All-Scan transport 'nvshmem' needs CUDA tensors; use transport='send_recv' "
                             "(or 'peer_memory' under TRITON_INTERPRET=1 for tests)")
        import torch.distributed._symmetric_memory as symm_mem

        if not symm_mem.is_nvshmem_available():
            raise ValueError("All-Scan transport 'nvshmem': this torch build or machine has no NVSHMEM "
                             "(pip install nvidia-nvshmem-cu12 or -cu13 to match CUDA); use transport='send_recv'")
    if transport.device:
        from .watch import install_step_check

        install_step_check()
    return transport
