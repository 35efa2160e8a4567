"""Prefix caching for a hybrid model's recurrent layers (vLLM's "align" mode): a cached prefix
is usable only with the recurrent state after its last token, so the engine keeps snapshots
of that state in extra slots of the state pools, each bound to the KV block it ends with.

Which boundaries: one per prompt, the last full block before its last token (the scheduler cuts
the prefill chunk there, `Scheduler._snapshot_boundary`), so a repeated prompt, and the next turn
of a conversation, whose prompt starts with the last one, restore it and skip that prefill.

Slots are bound only once the step that wrote them is done (`Scheduler.update_from_output`);
a restore is read at the start of the step that admits its request, before any snapshot is
written at the step's end, so taking the least recently bound slot for a new snapshot is safe.
"""

from __future__ import annotations

from collections import OrderedDict


class StateSnapshots:
    def __init__(self, first_slot: int, count: int):
        """Slots [first_slot, first_slot + count) of the state pools."""
        self.free = list(range(first_slot + count - 1, first_slot - 1, -1))
        self.block_of: OrderedDict[int, int] = OrderedDict()  # slot -> block, oldest first
        self.slot_of: dict[int, int] = {}  # block -> slot

    def take(self) -> int:
        """A slot for a new snapshot: a free one, else the least recently bound one's."""
        if self.free:
            return self.free.pop()
        slot, block = self.block_of.popitem(last=False)
        del self.slot_of[block]
        return slot

    def bind(self, block: int, slot: int) -> None:
        """The state after `block`'s last token is in `slot` (its step is done)."""
        if block in self.slot_of:  # another request wrote the same state meanwhile
            self.release(slot)
            return
        self.slot_of[block] = slot
        self.block_of[slot] = block

    def of(self, block: int) -> int | None:
        slot = self.slot_of.get(block)
        if slot is not None:
            self.block_of.move_to_end(slot)  # used: the last to be taken over
        return slot

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def drop_block(self, block: int) -> None:
        """The block's KV is evicted: its snapshot is of no use any more."""
        slot = self.slot_of.pop(block, None)
        if slot is not None:
            del self.block_of[slot]
            self.free.append(slot)

    def clear(self) -> None:
        for block in list(self.slot_of):
            self.drop_block(block)
