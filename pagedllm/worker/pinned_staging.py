"""Page-locked host buffers for a step's small host -> device copies.

A copy from pageable memory is staged by the driver, which may synchronise with the stream
first: the host then waits for the GPU's earlier work (with async scheduling, the step in
flight). From pinned memory `copy_(non_blocking=True)` only enqueues the DMA. The buffers are
made once at start-up, sized for the largest step.

Two sets, used by alternate steps: the host fills one while the copies of the previous step may
still be queued on the stream. A set is refilled two steps later, after the event recorded
behind its copies; with at most two steps in flight that event is already complete, so the
wait costs nothing but keeps the reuse safe however the steps are driven. Without CUDA (the
CPU path and its tests) the buffers are ordinary memory and the copies synchronous.
"""

from __future__ import annotations

import torch


class PinnedStaging:
    def __init__(self, specs: dict[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device) -> None:
        """specs: buffer name -> (largest shape, dtype)."""
        self.device = device
        pin = device.type == "cuda"
        self.sets = [
            {name: torch.zeros(shape, dtype=dtype, pin_memory=pin) for name, (shape, dtype) in specs.items()}
            for _ in range(2)
        ]
        self.events = [torch.cuda.Event() if pin else None, torch.cuda.Event() if pin else None]
        self.recorded = [False, False]
        self.cur = 0

    def begin(self) -> None:
        """Take the other set; wait until the copies that last read it are done."""
        self.cur ^= 1
        if self.recorded[self.cur]:
            self.events[self.cur].synchronize()
            self.recorded[self.cur] = False

    def end(self) -> None:
        """After this step's copies are enqueued: mark the point the set is free again."""
        event = self.events[self.cur]
        if event is not None:
            event.record()
            self.recorded[self.cur] = True

    def _stage(self, name: str, src) -> torch.Tensor:
        buf = self.sets[self.cur][name]
        view = buf[tuple(slice(0, n) for n in src.shape)]
        view.copy_(src if isinstance(src, torch.Tensor) else torch.from_numpy(src))
        return view

    def copy_to(self, name: str, src, dst: torch.Tensor) -> None:
        """dst (device) <- src (host tensor or numpy array of dst's shape) through buffer `name`."""
        dst.copy_(self._stage(name, src), non_blocking=True)

    def to_device(self, name: str, src, device: torch.device) -> torch.Tensor:
        """A device copy of src (host tensor or numpy array) through buffer `name`."""
        return self._stage(name, src).to(device, non_blocking=True)

    def upload(self, **srcs) -> tuple[torch.Tensor, ...]:
        """One step's copies of host tensors / numpy arrays (buffer name=source) to this staging's
        device, in order: on a GPU through the next set; on the CPU the sources themselves as
        tensors (nothing to copy)."""
        if self.device.type != "cuda":
            return tuple(s if isinstance(s, torch.Tensor) else torch.from_numpy(s) for s in srcs.values())
        self.begin()
        out = tuple(self.to_device(name, src, self.device) for name, src in srcs.items())
        self.end()
        return out
