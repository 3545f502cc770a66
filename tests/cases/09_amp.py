"""Chapter 09: the mistakes a hand-written loss scaler's check must name."""

from mutation import Mutation

UPDATE = ("self.scale_value *= self.backoff_factor\n            self.clean_steps = 0\n        else:\n"
          "            self.clean_steps += 1\n            if self.clean_steps == self.growth_interval:\n"
          "                self.scale_value *= self.growth_factor\n")
LOSS_TO_UNSCALE_END = '        return loss * self.scale_value\n        # END SOLUTION\n\n    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:\n        """Divide, in place, every gradient of the optimizer\'s parameters by the scale; set\n        self.found_inf to whether any gradient holds an inf or a NaN; set self.unscaled."""\n        # HINT 1: the gradients live in p.grad for every p of every group in optimizer.param_groups (skip p.grad None); change them in place, since a divided copy in a local variable is lost\n        # HINT 2: p.grad.div_(self.scale_value); an inf or a NaN anywhere: not torch.isfinite(p.grad).all() (torch.isinf misses NaN; a finite loss can still have gradients that overflowed)\n        # BEGIN SOLUTION: divide, in place, every gradient the optimizer will use by the current scale; set self.found_inf to whether any of them holds an inf or a NaN, and self.unscaled\n        found_inf = False\n        for group in optimizer.param_groups:\n            for p in group["params"]:\n                if p.grad is None:\n                    continue\n                p.grad.div_(self.scale_value)\n                found_inf = found_inf or not bool(torch.isfinite(p.grad).all())\n        self.found_inf = found_inf\n'
LOSS_TESTED = '        self.loss_not_finite = not bool(torch.isfinite(loss * self.scale_value).all())\n        return loss * self.scale_value\n        # END SOLUTION\n\n    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:\n        """Divide, in place, every gradient of the optimizer\'s parameters by the scale; set\n        self.found_inf to whether any gradient holds an inf or a NaN; set self.unscaled."""\n        # HINT 1: the gradients live in p.grad for every p of every group in optimizer.param_groups (skip p.grad None); change them in place, since a divided copy in a local variable is lost\n        # HINT 2: p.grad.div_(self.scale_value); an inf or a NaN anywhere: not torch.isfinite(p.grad).all() (torch.isinf misses NaN; a finite loss can still have gradients that overflowed)\n        # BEGIN SOLUTION: divide, in place, every gradient the optimizer will use by the current scale; set self.found_inf to whether any of them holds an inf or a NaN, and self.unscaled\n        found_inf = False\n        for group in optimizer.param_groups:\n            for p in group["params"]:\n                if p.grad is None:\n                    continue\n                p.grad.div_(self.scale_value)\n        self.found_inf = self.loss_not_finite  # the loss, not the gradients\n'

MUTATIONS = [
    Mutation("loss not scaled", "        return loss * self.scale_value\n", "        return loss\n",
             "return loss * self.scale_value"),
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
             "found_inf = not bool(torch.isfinite(", "the test of the next, finite one overwrote found_inf"),
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
]
