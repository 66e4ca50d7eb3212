"""``mesh.FreedMemory``: when the heap's free pages go back to the OS after a training step.

Process-free: glibc and the resident memory are stand-ins. The rule under test (the class says why):
trim after the first two steps, which set the ceiling; after later steps only when the resident memory
ends more than glibc's trim threshold (16 MiB) above it; a trim that leaves more than the ceiling alive
raises the ceiling to that step's level.
"""

import shardlm.distributed.mesh as mesh_module
from shardlm.distributed.mesh import MMAP_THRESHOLD_BYTES, FreedMemory

MIB = 2**20


class FakeHeap:
    """``malloc_trim`` and ``resident_bytes`` of a process whose heap keeps ``free`` bytes above ``alive``."""

    def __init__(self) -> None:
        self.alive, self.free, self.trims = 400 * MIB, 0, 0

    def malloc_trim(self, pad: int) -> int:
        self.trims += 1
        self.free = 0
        return 1

    def resident(self) -> int:
        return self.alive + self.free


def test_trims_the_first_two_steps_then_only_above_the_ceiling(monkeypatch):
    heap = FakeHeap()
    monkeypatch.setattr(mesh_module, "_glibc", lambda: heap)
    monkeypatch.setattr(mesh_module, "resident_bytes", heap.resident)
    freed = FreedMemory()
    trimmed = []
    # the first step ends lower (no optimizer state yet), the second at the steady level, the next ones
    # reuse what the heap kept (a little above), then one creeps past the threshold, then the memory
    # alive itself grows (the step after it is the new level)
    for alive, free in [(400, 40), (430, 50), (430, 55), (430, 60), (430, 80), (430, 55), (520, 50), (520, 50)]:
        heap.alive, heap.free = alive * MIB, free * MIB
        trimmed.append(freed.after_step())
    assert trimmed == [True, True, False, False, True, False, True, False]
    assert heap.trims == trimmed.count(True)
    assert freed.ceiling == 570 * MIB
    assert 2 * MMAP_THRESHOLD_BYTES == 16 * MIB  # the slack the docstring names


def test_does_nothing_without_glibc(monkeypatch):
    monkeypatch.setattr(mesh_module, "_glibc", lambda: None)
    freed = FreedMemory()
    assert [freed.after_step() for _ in range(3)] == [False] * 3
