"""Dynamic loss scaling for float16 (the engine's)."""

from __future__ import annotations


class LossScale:
    """Dynamic loss scaling for float16: multiply the loss before backward so small gradients survive fp16,
    halve the scale when gradients overflow (the step is skipped), double it after `growth_interval` clean steps.

    Hand-written rather than torch.amp.GradScaler: that one unscales and checks for infinities per optimizer
    and device, while here gradients live in FSDP2 shards, on other pipeline stages and on the host (offloaded
    optimizer units). The engine already reduces one global gradient norm over all of them; its being finite
    is the overflow check, and the scale folds into the clipping factor.
    """

    def __init__(self, scale: float = 2.0**16, growth_interval: int = 2000):
        self.scale, self.growth_interval, self.clean_steps = scale, growth_interval, 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale, self.clean_steps = self.scale / 2, 0
        else:
            self.clean_steps += 1
            if self.clean_steps == self.growth_interval:
                self.scale, self.clean_steps = self.scale * 2, 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])
