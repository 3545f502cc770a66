"""Chapter 09: the mistakes a hand-written loss scaler's check must name."""

from pathlib import Path

from mutation import Mutation, Variant

UPDATE = ("self.scale_value *= self.backoff_factor\n            self.clean_steps = 0\n        else:\n"
          "            self.clean_steps += 1\n            if self.clean_steps == self.growth_interval:\n"
          "                self.scale_value *= self.growth_factor\n")
# The loss tested in scale() instead of the gradients in unscale_: one replacement spanning both methods
SOLUTION = (Path(__file__).parents[2] / "solutions" / "09_amp.py").read_text()
FIRST, LAST = "        return loss * self.scale_value\n", "        self.found_inf = found_inf\n"
LOSS_TO_UNSCALE_END = SOLUTION[SOLUTION.index(FIRST):SOLUTION.index(LAST) + len(LAST)]
LOSS_TESTED = (LOSS_TO_UNSCALE_END
               .replace(FIRST, "        self.loss_not_finite = not bool(torch.isfinite(loss * self.scale_value).all())\n"
                               + FIRST)
               .replace("                found_inf = found_inf or not bool(torch.isfinite(p.grad).all())\n", "")
               .replace(LAST, "        self.found_inf = self.loss_not_finite  # the loss, not the gradients\n"))

MUTATIONS = [
    Mutation("loss not scaled", "        return loss * self.scale_value\n", "        return loss\n",
             "the loss multiplied by the current scale"),
    Mutation("gradients never unscaled", "                p.grad.div_(self.scale_value)\n", "",
             "unscale_ must divide every p.grad by the scale"),
    Mutation("unscaled copy not written back", "                p.grad.div_(self.scale_value)\n",
             "                grad = p.grad / self.scale_value\n", "a divided copy in a local variable is lost"),
    Mutation("gradients multiplied by the scale", "                p.grad.div_(self.scale_value)\n",
             "                p.grad.mul_(self.scale_value)\n",
             "unscale_ must divide every p.grad by the scale"),
    Mutation("isinf misses NaN", "not bool(torch.isfinite(p.grad).all())", "bool(torch.isinf(p.grad).any())",
             "a NaN is not an inf"),
    Mutation("found_inf overwritten by the next parameter", "found_inf = found_inf or not bool(torch.isfinite(",
             "found_inf = not bool(torch.isfinite(", "the test of the next, finite parameter overwrote found_inf"),
    Mutation("the loss tested instead of the gradients", LOSS_TO_UNSCALE_END, LOSS_TESTED, "not the loss"),
    Mutation("step taken on inf", "        if not self.found_inf:\n            optimizer.step()",
             "        optimizer.step()", "must not call optimizer.step() when unscale_ found an inf"),
    Mutation("no backoff", "self.scale_value *= self.backoff_factor", "pass",
             "the scale did not back off"),
    Mutation("count not reset after a skip",
             "self.scale_value *= self.backoff_factor\n            self.clean_steps = 0\n",
             "self.scale_value *= self.backoff_factor\n",
             "after a skipped step the count of clean steps must restart at 0"),
    Mutation("count not reset after growth", "                self.clean_steps = 0  # growth restarts the count too\n",
             "", "after a growth the count of clean steps must restart at 0"),
    Mutation("grows one step late", "if self.clean_steps == self.growth_interval:",
             "if self.clean_steps > self.growth_interval:", "not one step later"),
    Mutation("grows one step early", "if self.clean_steps == self.growth_interval:",
             "if self.clean_steps == self.growth_interval - 1:", "not one step earlier"),
    Mutation("fixed factors 0.5 and 2", UPDATE,
             UPDATE.replace("*= self.backoff_factor", "*= 0.5").replace("*= self.growth_factor", "*= 2.0"),
             "use self.growth_factor and self.backoff_factor"),
    Mutation("unscaled twice", "        if not self.unscaled:\n            self.unscale_(optimizer)\n",
             "        self.unscale_(optimizer)\n", "divided by the scale twice"),
    Mutation("unscaled flag never reset", "        self.unscaled = False\n        # END SOLUTION\n",
             "        # END SOLUTION\n", "does update() reset self.unscaled?"),
    # Found by a learner trial, or tried after it: each was passed, or named for another cause, before
    Mutation("isnan misses inf", "not bool(torch.isfinite(p.grad).all())", "bool(torch.isnan(p.grad).any())",
             "unscale_ does not detect inf"),
    Mutation("only the first param group", "for group in optimizer.param_groups:",
             "for group in optimizer.param_groups[:1]:", "loop over every group in optimizer.param_groups"),
    Mutation("a parameter without a gradient not skipped",
             "                if p.grad is None:\n                    continue\n", "", "p.grad is None"),
    Mutation("the finding kept in a local variable", "        self.found_inf = found_inf\n", "",
             "not in a local variable"),
    Mutation("backoff by division", "self.scale_value *= self.backoff_factor",
             "self.scale_value /= self.backoff_factor", "do not divide by it"),
    Mutation("step() clears the finding before update()", "            optimizer.step()\n",
             "            optimizer.step()\n        self.found_inf = False\n", "before update() read it"),
    # A side effect the lab's own loop cannot see (it never logs the loss it scaled)
    Mutation("the caller's loss scaled in place", "        return loss * self.scale_value\n",
             "        return loss.mul_(self.scale_value)\n", "changed the caller's loss in place", 3),
]

UNSCALE = ("        found_inf = False\n        for group in optimizer.param_groups:\n            for p in group[\"params\"]:\n"
           "                if p.grad is None:\n                    continue\n                p.grad.div_(self.scale_value)\n"
           "                found_inf = found_inf or not bool(torch.isfinite(p.grad).all())\n"
           "        self.found_inf = found_inf\n")

CORRECT = [
    Variant("GradScaler's own kernel: _amp_foreach_non_finite_check_and_unscale_", UNSCALE,
            '        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]\n'
            "        found = torch.zeros(1)\n"
            "        if grads:\n"
            "            inv_scale = torch.full((1,), self.scale_value, dtype=torch.float64).reciprocal().float()\n"
            "            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale)\n"
            "        self.found_inf = bool(found.item())\n", 2),
    Variant("inf and NaN tested apart, over a list of the gradients", UNSCALE,
            '        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]\n'
            "        for g in grads:\n            g.div_(self.scale_value)\n"
            "        self.found_inf = any(bool((torch.isinf(g) | torch.isnan(g)).any()) for g in grads)\n", 2),
    Variant("growth counted modulo growth_interval",
            "            if self.clean_steps == self.growth_interval:\n                self.scale_value *= self.growth_factor\n"
            "                self.clean_steps = 0  # growth restarts the count too\n",
            "            if self.clean_steps % self.growth_interval == 0:\n                self.scale_value *= self.growth_factor\n", 2),
]

MUTATIONS += [
    # REVIEW B: an argument left at its default (the check's growth_interval is not GradScaler's 2000)
    Mutation("growth_interval read as GradScaler's default", "if self.clean_steps == self.growth_interval:",
             "if self.clean_steps == 2000:", "growth", 2),
    # REVIEW B: an input never tried: finite gradients whose sum overflows
    Mutation("inf tested on the sum of each gradient", "not bool(torch.isfinite(p.grad).all())",
             "not bool(torch.isfinite(p.grad.sum()))", "not a sum or a norm of the gradient", 2),
    # REVIEW 5, A: `>=` and no reset after a growth was named "after a skipped step ... restart at 0"
    Mutation("grows at every clean step after the first growth (>=, no reset)",
             "            if self.clean_steps == self.growth_interval:\n                self.scale_value *= self.growth_factor\n"
             "                self.clean_steps = 0  # growth restarts the count too\n",
             "            if self.clean_steps >= self.growth_interval:\n                self.scale_value *= self.growth_factor\n",
             "after a growth the count of clean steps must restart at 0", 2),
]
