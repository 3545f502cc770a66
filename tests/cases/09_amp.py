"""Chapter 09: the mistakes a hand-written loss scaler's check must name."""

from mutation import Mutation

MUTATIONS = [
    Mutation("loss not scaled", "        return loss * self.scale_value\n", "        return loss\n",
             "return loss * self.scale_value"),
    Mutation("gradients never unscaled", "                p.grad.div_(self.scale_value)\n", "",
             "unscale_ must divide every p.grad by the scale"),
    Mutation("isinf misses NaN", "not bool(torch.isfinite(p.grad).all())", "bool(torch.isinf(p.grad).any())",
             "a NaN is not an inf"),
    Mutation("step taken on inf", "        if not self.found_inf:\n            optimizer.step()",
             "        optimizer.step()", "must not call optimizer.step() when unscale_ found an inf"),
    Mutation("no backoff", "self.scale_value *= self.backoff_factor", "pass",
             "the scale did not back off"),
    Mutation("count not reset after a skip",
             "self.scale_value *= self.backoff_factor\n            self.clean_steps = 0\n",
             "self.scale_value *= self.backoff_factor\n",
             "the count of clean steps must restart at 0"),
    Mutation("grows one step late", "if self.clean_steps == self.growth_interval:",
             "if self.clean_steps > self.growth_interval:", "not one step later"),
    Mutation("unscaled twice", "        if not self.unscaled:\n            self.unscale_(optimizer)\n",
             "        self.unscale_(optimizer)\n", "divided by the scale twice"),
]
