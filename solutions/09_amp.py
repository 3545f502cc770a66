"""Lab 09 - mixed precision: a dynamic loss scaler by hand, held against torch.amp.GradScaler.

Write `LossScaler`, a scaler with GradScaler's interface: scale the loss, unscale the gradients,
skip the step when a gradient is inf or NaN (and halve the scale), double the scale after
`growth_interval` clean steps. The check first runs single iterations on known gradients, then
replays one gradient sequence, with planted inf, NaN and overflow steps, through yours and through
`torch.amp.GradScaler`, then trains a small DDP model under autocast with each, one rank
receiving a poisoned batch; scale trajectories, skipped steps and weights must agree.

Run it with 4 processes:
    make lab CH=09 NPROC=4
    (or: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 labs/09_amp.py)
"""
# SOLUTION FILE

import torch


class LossScaler:
    """A dynamic loss scaler with GradScaler's interface: scale, unscale_, step, update, get_scale.

    fp16 gradients smaller than about 6e-8 become zero. Multiplying the loss by `scale` multiplies
    every gradient by it too (the chain rule), lifting them into fp16's range; the gradients are
    divided by it again before the optimizer sees them. A scale too large makes some gradient inf:
    that step is skipped and the scale multiplied by backoff_factor. After growth_interval clean
    (finite) steps in a row, the scale is multiplied by growth_factor, to probe upwards again.

    The contract: with the same four settings, it behaves as torch.amp.GradScaler does in the loop
    scale(loss).backward(), [unscale_(optimizer), clipping], step(optimizer), update(): the same
    scale after every update(), the same steps skipped, the same weights."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        self.scale_value = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        # What the methods tell each other (a suggestion: rename or add as you need)
        self.clean_steps = 0      # finite steps in a row
        self.found_inf = False    # this iteration's gradients held an inf or a NaN
        self.unscaled = False     # this iteration's gradients are unscaled already

    def get_scale(self) -> float:
        return self.scale_value

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward() on, in place of the loss itself."""
        # HINT 1: the chain rule: a loss multiplied by a number gives gradients multiplied by that number
        # HINT 2: return loss * self.scale_value
        # BEGIN SOLUTION: return the loss to backpropagate, such that every gradient comes out multiplied by the current scale
        return loss * self.scale_value
        # END SOLUTION

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Turn the gradients of the optimizer's parameters back into true gradients, and find out
        whether they can be trusted. The loop calls it before clipping gradients; or step() does."""
        # HINT 1: the gradients live in p.grad for every p of every group in optimizer.param_groups; a parameter that took no part in the loss (or a frozen one) has p.grad None: skip it
        # HINT 2: change each p.grad in place (p.grad.div_(self.scale_value)): a divided copy in a local variable is lost
        # HINT 3: one test covers both inf and NaN: not torch.isfinite(p.grad).all() (torch.isinf misses NaN, torch.isnan misses inf). An inf in any one parameter counts: combine the tests with `or`, keep the result in self.found_inf, and set self.unscaled for step()
        # BEGIN SOLUTION: divide, in place, every gradient the optimizer will use by the current scale, and record for step() and update() whether any of them holds an inf or a NaN
        found_inf = False
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.grad.div_(self.scale_value)
                found_inf = found_inf or not bool(torch.isfinite(p.grad).all())
        self.found_inf = found_inf
        self.unscaled = True
        # END SOLUTION

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """optimizer.step() on true gradients, or no step at all when they were not finite. The
        loop may or may not have called unscale_ in this iteration."""
        # HINT 1: step() comes either right after unscale_ (when the loop clips gradients) or without it: unscale exactly once per iteration
        # HINT 2: if not self.unscaled: self.unscale_(optimizer); then optimizer.step() only when not self.found_inf
        # BEGIN SOLUTION: update the weights as GradScaler's step does: with gradients unscaled exactly once in this iteration, and not at all when one of them held an inf or a NaN
        if not self.unscaled:
            self.unscale_(optimizer)
        if not self.found_inf:
            optimizer.step()
        # END SOLUTION

    def update(self) -> None:
        """Set the scale for the next iteration, and make the scaler ready for it."""
        # HINT 1: count the clean steps in a row (self.clean_steps): a backoff and a growth both start the count again at 0. Use the factors given to __init__: the check sets others than GradScaler's defaults
        # HINT 2: found_inf: scale *= backoff_factor, clean_steps = 0; else clean_steps += 1, and when it equals growth_interval: scale *= growth_factor, clean_steps = 0
        # HINT 3: the next iteration starts with nothing found and nothing unscaled: found_inf = unscaled = False
        # BEGIN SOLUTION: set the next iteration's scale exactly as GradScaler does with these settings (back off after an inf or a NaN, grow after growth_interval clean steps in a row), then start the next iteration afresh
        if self.found_inf:
            self.scale_value *= self.backoff_factor
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps == self.growth_interval:
                self.scale_value *= self.growth_factor
                self.clean_steps = 0  # growth restarts the count too
        self.found_inf = False
        self.unscaled = False
        # END SOLUTION


if __name__ == "__main__":  # the check is in checks/lab09.py: you need not read it
    from checks import lab09
    lab09.run(LossScaler=LossScaler)
