"""``GroupWrapper``: NVRx's process-group wrapper, for code that drives replication itself.

Megatron-LM builds replication groups with ``GroupWrapper.from_list_of_groups`` for
``CliqueReplicationStrategy``, and some code moves ``TensorAwareStateDict`` objects with it.
Our strategies move whole serialized shards (:class:`~.group_utils.CliqueGroup`); this keeps
NVRx's object-and-tensor-at-a-time protocol for direct callers. Deliberate differences:

* tensors travel on the group's first supported device (``cpu`` for gloo) and return to
  their own device type, so the calls run on a CPU-only job (NVRx moves all to CUDA);
* with ``group=None`` group ranks *are* global ranks, both ways;
* bad arguments raise :class:`~resilient_ckpt.errors.ConfigurationError` where NVRx asserts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from ..._logging import get_logger
from ...errors import ConfigurationError
from ..base_state_dict import TensorAwareStateDict
from .torch_device_utils import TensorPlaceholder

if TYPE_CHECKING:
    from .group_utils import ExchangePlan

T = TypeVar("T")
logger = get_logger(__name__)

__all__ = ["GroupWrapper"]


class GroupWrapper:
    """A process group (``None``: the default group) with rank translation and exchanges;
    each exchange is collective over the group, or the two ranks named, as in torch."""

    def __init__(self, group: Any = None) -> None:
        self._group = group

    @staticmethod
    def wrap(group: Any) -> GroupWrapper:
        """``group`` as a wrapper (a wrapper is returned as it is)."""
        if isinstance(group, GroupWrapper):
            return group
        if isinstance(group, dist.ProcessGroup):
            return GroupWrapper(group)
        raise ConfigurationError(
            f"expected a torch.distributed ProcessGroup or a GroupWrapper, got {type(group)!r}"
        )

    @staticmethod
    def from_list_of_groups(list_of_groups: Sequence[Any]) -> GroupWrapper:
        """The one group of ``list_of_groups`` that contains this rank (every rank creates
        every group, since ``dist.new_group`` is collective, then picks its own)."""
        me = dist.get_rank()
        mine = [g for g in list_of_groups if me in dist.get_process_group_ranks(g)]
        if len(mine) != 1:
            found = [dist.get_process_group_ranks(g) for g in mine]
            raise ConfigurationError(
                f"rank {me} must be in exactly one of the replication groups, found it in "
                f"{len(mine)}: {found}; pass groups that partition the ranks"
            )
        return GroupWrapper(mine[0])

    @property
    def group(self) -> Any:
        return self._group

    @property
    def backend(self) -> str:
        return str(dist.get_backend(self.group))

    @property
    def supported_devices(self) -> list[torch.device]:
        """Device types the group's backend can communicate on."""
        capability = dist.Backend.backend_capability.get(self.backend.lower(), ["cpu"])
        return [torch.device(device) for device in capability]

    def get_device(self, wanted_device: Any = None) -> Any:
        """``wanted_device`` if the backend supports it; default: its first device."""
        if wanted_device is None:
            return self.supported_devices[0]
        if torch.device(wanted_device).type not in {d.type for d in self.supported_devices}:
            raise ConfigurationError(
                f"backend {self.backend} cannot communicate on {wanted_device}; supported: "
                f"{self.supported_devices}"
            )
        return wanted_device

    def get_group_rank(self, global_rank: int | None = None) -> int:
        """The group rank of ``global_rank`` (default: this process)."""
        if global_rank is None:
            return dist.get_rank(self.group)
        if self.group is None:
            return global_rank
        return dist.get_group_rank(self.group, global_rank)

    @property
    def my_group_rank(self) -> int:
        return self.get_group_rank(None)

    def get_global_rank(self, group_rank: int | None = None) -> int:
        """The global rank of ``group_rank`` (default: this process)."""
        if group_rank is None:
            return dist.get_rank()
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    @property
    def my_global_rank(self) -> int:
        return self.get_global_rank(None)

    @property
    def ranks(self) -> Sequence[int]:
        """Global ranks of the members, in group-rank order."""
        if self.group is None:
            return range(dist.get_world_size())
        return dist.get_process_group_ranks(self.group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def my_rank(self) -> int:
        """This process's global rank (what :class:`~.group_utils.ExchangePlan` uses)."""
        return dist.get_rank()

    def __repr__(self) -> str:
        return (
            f"<ProcessGroup of size {self.world_size}, rank: "
            f"local={self.my_group_rank}, global={self.my_global_rank}>"
        )

    # -- exchanges --------------------------------------------------------------------------

    def all_gather_object(self, my_obj: T) -> list[T]:
        """``my_obj`` of every member, in group-rank order."""
        result: list[Any] = [None] * self.world_size
        dist.all_gather_object(result, my_obj, group=self.group)
        return result

    def broadcast(self, *args: Any, **kwargs: Any) -> Any:
        """``torch.distributed.broadcast`` on this group (``src`` is a global rank)."""
        kwargs["group"] = self.group
        return dist.broadcast(*args, **kwargs)

    def all_gather_batch(
        self, my_tensors: list[torch.Tensor], target_device: Any = None
    ) -> list[list[torch.Tensor]]:
        """Every member's list of tensors (lists may differ in length, shapes and dtypes).

        Shapes travel first as placeholders; each tensor is then broadcast by its owner.
        Received tensors are on their sender's device type, or on ``target_device``.
        """
        comm = torch.device(self.get_device())
        described = self.all_gather_object([TensorPlaceholder(t) for t in my_tensors])
        result: list[list[torch.Tensor]] = []
        for group_rank, placeholders in enumerate(described):
            mine = group_rank == self.my_group_rank
            received = []
            for index, placeholder in enumerate(placeholders):
                if mine:
                    tensor = my_tensors[index]
                    wire = tensor if tensor.device.type == comm.type else tensor.to(comm)
                else:
                    wire = placeholder.empty_like(comm)
                self.broadcast(wire, src=self.get_global_rank(group_rank))
                out = tensor if mine else wire
                if not mine and comm.type != placeholder.orig_device_type:
                    out = wire.to(placeholder.device)
                if target_device is not None:
                    out = out.to(target_device)
                received.append(out)
            result.append(received)
        return result

    def send_object(self, obj: Any, dst: int) -> None:
        """Pickle ``obj`` to global rank ``dst``."""
        dist.send_object_list([obj], dst=dst, group=self.group)

    def recv_object(self, src: int) -> Any:
        """An object pickled by global rank ``src`` with :meth:`send_object`."""
        box: list[Any] = [None]
        dist.recv_object_list(box, src=src, group=self.group)
        return box[0]

    def isend_state_dict(self, state_dict: TensorAwareStateDict, dst: int) -> dict[str, float]:
        """Send ``state_dict`` to global rank ``dst``: the hollow object, then each tensor.

        ``state_dict`` is left as it was. Returns ``{"data_sent": bytes}``.
        """
        comm = torch.device(self.get_device())
        tensors = list(state_dict.pop_tensors())
        try:
            self.send_object(state_dict, dst)
            for tensor in tensors:
                wire = tensor if tensor.device.type == comm.type else tensor.to(comm)
                dist.send(wire.contiguous(), dst, group=self.group)
        finally:
            state_dict.insert_tensors(tensors)
        return {"data_sent": float(sum(t.nbytes for t in tensors))}

    def irecv_state_dict(self, src: int) -> tuple[TensorAwareStateDict, dict[str, float]]:
        """Receive what :meth:`isend_state_dict` sent from global rank ``src``."""
        comm = torch.device(self.get_device())
        state: TensorAwareStateDict = self.recv_object(src)
        state.init_tensors()
        for tensor in state.tensors:
            if tensor.device.type == comm.type:
                dist.recv(tensor, src, group=self.group)
            else:
                wire = torch.empty_like(tensor, device=comm)
                dist.recv(wire, src, group=self.group)
                tensor.copy_(wire)
        return state, {"data_recv": float(sum(t.nbytes for t in state.tensors))}

    def execute_plan(
        self, exchange_plan: ExchangePlan, my_data: Mapping[Any, TensorAwareStateDict]
    ) -> dict[Any, TensorAwareStateDict]:
        """Carry out ``exchange_plan`` entry by entry; return what this rank received.

        Every member walks the entries in the same order, so each send meets its receive.
        """
        me = self.my_global_rank
        missing = exchange_plan.required_ids(me) - set(my_data)
        if missing:
            raise ConfigurationError(f"rank {me} must send ids it was not given: {missing}")
        received: dict[Any, TensorAwareStateDict] = {}
        sent = got = 0.0
        for entry in exchange_plan.entries:
            if entry.sender == me == entry.receiver:
                received[entry.id_] = my_data[entry.id_]
            elif entry.sender == me:
                sent += self.isend_state_dict(my_data[entry.id_], entry.receiver)["data_sent"]
            elif entry.receiver == me:
                received[entry.id_], log = self.irecv_state_dict(entry.sender)
                got += log["data_recv"]
        logger.debug("exchange plan: sent %d bytes, received %d bytes", sent, got)
        return received
