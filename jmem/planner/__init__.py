"""`jmem.plan` (`jmem.planner.plan`): per-site memory policies that fit a model's train
step into a budget at the least extra cost: FLOPs, or for a GPU target with a fitted
step-time model (``target="h100"``, ``jmem plan --target h100``) the step time estimated
from each compiled module (`jmem.measure.estimate_step_time`; item 6). Where the steps
below say FLOPs, read the cost the objective names (`Plan.objective`).

::

  plan = jmem.plan(model, (x, y), budget="16GiB")     # x, y: arrays or ShapeDtypeStructs
  print(plan)                                          # per-site table, peak, FLOPs, batch
  model = jmem.convert(model, *plan.techniques)
  # Your own loss (a regression head, float targets): one loss per example, as optax's.
  plan = jmem.plan(regressor, (x, t), "60%", loss_fn=lambda out, t: optax.l2_loss(out, t).sum(-1))

The model is a linen or an NNX module, as `jmem.convert` takes (an NNX model is planned on
``nnx.clone`` copies: yours is converted only when you call `jmem.convert` with the plan).
The sites are `jmem.convert`'s default block sites (the direct children of the top module
but its ``Dense`` / ``nnx.Linear`` layers, as `jmem.Remat`'s); a site that holds over half
of the saved activations (a per-frame CNN called as one submodule) is replaced by the
module calls directly inside it where they hold at least 90% of its bytes, down to three
levels (one site leaves the walk compressing all of it or recomputing all of it, and
recomputing the largest block keeps its whole forward live in its backward: no smaller
peak). Each site gets a `jmem.Policy`. How:

1. **Estimates, traced only.** The exact step's residuals are attributed to the sites by
   the module path of the equation that made them (`jmem.measure.Residual.scope`; NNX,
   which names no scopes, is traced through a copy whose sites run in a
   ``jax.named_scope`` of their path); each
   site's input size and forward FLOPs (convolutions and matmuls) come from the same
   trace. Per site and policy: the bytes it would keep per example (save: its residuals;
   compress at ``b`` bits: ``b`` of each value's bits plus group metadata; recompute: its
   input; recompute from a ``b``-bit input: that input at ``b`` bits plus 1-bit masks) and
   the FLOPs it adds (a recomputation: the site's forward; a quantizer: a few per value).
2. **A path of upgrades.** From "save everywhere", one site moves one rung up its ladder
   at a time (save -> compress at 8, 4, 2, 1 bits -> recompute from a 2-bit input; exact
   only: save -> recompute; ``policies=`` and ``bits=`` choose the rungs): every site
   climbs a rung before any climbs the next (all at 8 bits before one goes to 4: fewer
   bits only where the budget needs them), the site with the most bytes saved per FLOP
   added first (a rung that keeps no less is skipped), until the predicted step fits. Down the
   compression rungs (8 -> 4 -> 2 -> 1 bits, which add no FLOPs) the order is GACT's
   instead when the gradient sensitivities are known (``calibration_batch=``: measured
   at 2 bits on a few real examples at the initial weights, `jmem.surgery.sensitivities`;
   or your own ``sensitivities=``): most bytes saved per gradient variance added, the
   variance a site adds at ``b`` bits being about ``C / (2^b - 1)^2``, so the sites whose
   gradients tolerate it get fewer bits first. The prediction is
   ``fixed + batch * (working + sum of the sites' bytes)``, with ``fixed`` and
   ``working`` (what no site holds: the head, inline code, the backward's working set)
   from the compiled exact step at two batch sizes. A tighter budget walks further along
   the same path, so a plan that fits should need no fewer FLOPs (with InPlace-ABN, item
   4, the cheaper of the walk's plan and a fixed-cost alternative keeps that). Not a
   proof, and it has failed: the compiled steps that steer the walk and the undo step
   depend on the budget, and compiled FLOPs need not grow along the path as estimated
   (the 2 x 4-device CNN of the plan_ladder_sweep study of docs/decisions.md with the walk of
   commit 08fb59f, before the cheaper-top try of item 3: 1.125x exact's FLOPs at 92%,
   1.084x at 90%, where a site at 1 bit compiled to more FLOPs than recomputed from 2
   bits).
3. **Confirmed by compiling.** The chosen plan's step is compiled at the batch: the
   reported peak is XLA's. Where it does not fit, the walk goes on to the first point that
   the line through the last two compiled misses (compiled against predicted bytes, its
   slope clamped to [0.1, 1]) puts within the budget (none: the walk's end); once a point
   fits, to the first between the last miss and it that the line through those two puts
   within (regula falsi; none: the point halfway), so a plan found past a short estimate
   comes back towards the fewest bit reductions and FLOPs, keeping a compile for the tries
   below where one of them will run; at most ``max_compiles`` compiles. A step from
   compression into recomputation first compiles the last point before it (the
   recomputation's estimate is the least sure). Where the walk's end misses and a compile
   is left, one more tries every site that saves anything on the top rung (a site the
   estimate keeps at 1 bit may compile smaller recomputed from 2 bits); so does one where
   the walk's plan fits but the estimate puts the top rung at fewer FLOPs (a small CNN,
   whose quantizer outweighs its convolutions), taken if it fits at fewer compiled FLOPs.
   If nothing fits, the plan is the smallest step compiled. With sensitivities, once a plan
   fits, the compiles left try it with the bit reductions the prediction (the estimate
   through the plan's compiled bytes, at the compiled slope from the last miss, at least
   0.1 and not capped at 1) says the budget does not need undone (the one adding the most
   variance first): the walk lowers many small tolerant sites before a large sensitive one,
   and may not have needed all of them. A try is kept only if it fits; the next is scaled
   by the slope between the plan and the step compiled before it (`_undo_tries`). Where
   the plan's compiled step names each site's packed codes (linen models), its heap layout
   (`jmem.measure.heap_layout`, read from the same compile) predicts the tries instead: the
   codes resized by the bits and the buffers placed again, which sees what the estimate
   cannot (codes dead at the peak may cost nothing, or grow the heap's layout; a
   prediction adds the placement's own error on the plan's step); such a try leaves
   reductions of under 1% of the plan's added variance and tries them alone once nothing
   else is predicted to fit, and where nothing is or a try it predicted misses, the
   estimate's line takes over. A step compiled before is judged by its compiled bytes.
   The largest batch at the budget is predicted by the line through the plan compiled at
   two batch sizes (one compile more).

4. **InPlace-ABN alone.** Where the exact step does not fit and the model has BatchNorms
   InPlace-ABN can take (followed by leaky_relu or elu in a Sequential,
   `jmem.surgery.inplace_abn_sites`), InPlace-ABN on all of them (exact: it keeps each
   BatchNorm's output only) is compiled once, and it is the plan where it fits at fewer
   compiled FLOPs than the walk's plan, or fits where that does not (or, nothing fitting,
   comes closer to the budget). The comparison is on
   compiled FLOPs: the estimates count only convolutions and matmuls, so they cannot rank
   InPlace-ABN's elementwise work against a recomputation's. InPlace-ABN under per-site
   policies is not searched: a walk from it, tried first, took compiles the plain walk
   needed, and never gave the plan in a sweep of the third-party NNX CNN, where no policy
   stacked on InPlace-ABN compiles more than 0.1% below InPlace-ABN alone's bytes (inside
   a compressed site its output stays full precision:
   the plan_inplace_abn_stack study of docs/decisions.md).

5. **Devices.** With ``mesh=``, every step (the exact one too) is compiled with the batch
   split over ``data_axis`` (data parallelism) and/or its H and W over ``spatial_axes``
   (then stacked on ``jmem.Spatial(mesh)``), the train state replicated; the budget and
   the figures are per device, and the sites' estimates are the one-device trace's
   divided by the devices of those axes. With the data axis alone, on a GPU these
   compiles use XLA for the quantizer, as `jmem.parallel.data_parallel` trains (XLA
   cannot split a Pallas call over the batch). With ``devices=N`` instead of a mesh, the
   planner lays the devices out: the batch over the most of them that divide it and N
   (per device, splitting the batch or the image keeps the same share of the
   activations, and the batch needs no halo exchange: in the plan_layouts study of
   docs/decisions.md, at batch 8 the 8-way batch split has both the fewest bytes and the
   fewest collectives; at batch 2 the fewest bytes are with the batch split 2 ways, 702
   MiB, and no layout leaving it unsplit needs under 735 MiB), the image's H x W over
   the rest, split every way the sides allow (at most 4), the exact step compiled on each:
   of the splits within 2% of the fewest device bytes, the one with the fewest collectives
   (the halo sizes did not rank them).

6. **The objective.** Where the target has a fitted step-time model (the H100:
   `jmem.measure.constants_for`), every step compiled is also timed by
   `jmem.measure.estimate_step_time` (bytes its kernels move, matrix FLOPs, kernels), and
   the walk steers by that estimate instead of FLOPs: its path is ordered by the sites'
   estimated seconds, the top-rung try, InPlace-ABN alone and the plan are compared on
   compiled estimates, and `Plan.seconds` reports it (an estimate, not a measured time).
   FLOPs miss what compression costs on a GPU (ActNN L3 on ResNet-50: 1.03x exact's
   FLOPs, 1.13-1.39x its time on an H100), and the bit widths' order inverts there: a
   value at 8 bits keeps more than at 2 *and* costs more (its codes are written and read:
   ResNet-50 at batch 128, 8 bits everywhere 1.089x exact's estimated time, 4 bits 1.062x,
   2 bits 1.051x). So the upgrade path is another (`_search.time_path`): compression at
   the fewest bits of 2 or more allowed (ActNN L3's 2) on the sites where it removes the
   most bytes per second added, each site's estimated cost (`Objective.added`: codes moved
   and kernels launched; a recomputation's forward FLOPs at the matrix rate and its
   activations moved again) ranking them; once every site is compressed, 1 bit (less
   kept at about the same time: 1.052x everywhere) and then recomputation. The walk
   still takes the first point of that path that fits, so a budget that needs only some
   sites compressed leaves the rest saved, in less time than 2 bits everywhere, and 1 bit
   comes only where 2 bits do not fit: accuracy first among points the estimate puts
   within a few thousandths of each other. With sensitivities the 1-bit reductions go by
   bytes saved per variance added (which sites reach 2 bits does not depend on them); bit
   reductions are not undone (more bits cost more time).

The code: `_inputs` (the budget, the ladder, each site's estimates, the objective, the
compiled step), `_layouts` (devices), `_search` (the upgrade paths and `Search`, the
walk's state, which runs on any cost model: tests give it a stub), `_report` (`Plan`, its
table and figure), `_plan` (`plan`: checks the inputs, makes the estimates, compiles for
`Search` and weighs InPlace-ABN alone against it).

Not searched: ``offload``. On CPU, one memory for host and device, it saves nothing, so
only a GPU compile could measure it; on a GPU neither of the walk's costs (FLOPs, the
estimated step time) counts its host transfers, and where it was measured it lost on both
figures: on an H100, ResNet-50 224² at batch 64
(benchmarks/results/gpu/gpu_nvidia_h100_80gb_hbm3_run4.md), full-precision
``Policy("offload")`` at every site compiled to 0.97x exact's temp bytes and stepped in
11.5x exact's time (310.6 against 27.1 ms), where ``recompute-2bit`` compiled to 0.29x at
1.21x; in an earlier run (gpu_h100_first_figures.md, run 3: unmasked kernels, a non-finite
loss) ActNN L4's offload of the 2-bit codes had compiled larger than L3, which keeps them
(3.51 against 2.28 GiB), and stepped 1.76x as long. The plan's notes say which applies.
Why offload left the H100's peak where it was is not yet known: `benchmarks/gpu_offload.py`,
for the next GPU, reads the figures that could show it from the compiled schedule's host
copies.
"""

from jmem.planner._inputs import POLICY_KINDS as POLICY_KINDS
from jmem.planner._inputs import Measured as Measured
from jmem.planner._inputs import Objective as Objective
from jmem.planner._inputs import budget_share as budget_share
from jmem.planner._inputs import compile_step as compile_step
from jmem.planner._inputs import objective_for as objective_for
from jmem.planner._inputs import parse_bytes as parse_bytes
from jmem.planner._inputs import site_ladder as site_ladder
from jmem.planner._inputs import step_cost as step_cost
from jmem.planner._inputs import _train_step as _train_step  # benchmarks compile with it
from jmem.planner._plan import plan as plan
from jmem.planner._report import ASSUMES as ASSUMES
from jmem.planner._report import BudgetNotMetWarning as BudgetNotMetWarning
from jmem.planner._report import Plan as Plan
from jmem.planner._report import SiteChoice as SiteChoice
from jmem.planner._report import write as write
from jmem.planner._search import Search as Search

__all__ = ["plan", "Plan", "SiteChoice", "parse_bytes", "budget_share", "step_cost",
           "compile_step", "POLICY_KINDS", "site_ladder", "BudgetNotMetWarning", "write",
           "ASSUMES", "Search", "Objective", "Measured", "objective_for"]
