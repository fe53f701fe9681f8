"""How many times a program's computation must read each of its arguments, counted on its
traced jaxpr: the compile report's floor that knows a round's steps depend on each other;
and the arithmetic it must do (`matmul_flops`), its floor beside it.

A speculative round reads the draft's layer and the head once per draft step and the
caches once per forward: steps that wait on each other's output cannot share a pass over
a weight, so no compiler can read it fewer times. The count follows each argument through
the operations that only view it (dtype casts, reshapes, transposes, a layer taken from a
stack: the part's share of it), through calls, `shard_map`, `cond` (the branch that reads
most) and `scan` (every iteration), and adds the share each other operation takes in: a
matmul, an attention kernel, an elementwise use. An in-place write (`dynamic_update_slice`,
`scatter`) reads nothing of the array it updates, and its result is the same array. A
`while` loop's body counts once: its trip count is not in the program.
"""

from __future__ import annotations

import math
from typing import Sequence

from jax.extend import core

# Results that are the operand itself, seen differently: no pass over memory of their own.
_VIEWS = frozenset({
    "convert_element_type", "reshape", "squeeze", "expand_dims", "transpose", "copy",
    "copy_p", "sharding_constraint", "broadcast_in_dim", "reduce_precision",
    "mesh_cast", "reshard", "pvary", "optimization_barrier"})
# Results that are a part of the operand (its first): the part's share of it.
_PARTS = frozenset({"slice", "dynamic_slice", "gather"})
# Results that are the first operand written in place.
_WRITES = frozenset({"dynamic_update_slice", "scatter", "scatter-add", "scatter_add"})

View = tuple[int, float]  # (argument index, share of that argument this value is)


def _size(var) -> int:
  return math.prod(getattr(var.aval, "shape", ()))


def _jaxpr(x):
  return x.jaxpr if hasattr(x, "jaxpr") and hasattr(x, "consts") else x


def _add(totals: dict[int, float], more: dict[int, float], times: float = 1.0) -> None:
  for k, v in more.items():
    totals[k] = totals.get(k, 0.0) + v * times


def _walk(jaxpr, views: Sequence[View | None], totals: dict[int, float]
          ) -> list[View | None]:
  """Adds to `totals` the shares of arguments the operations of `jaxpr` read, its inputs
  being `views`; returns its outputs' views."""
  env = {var: view for var, view in zip(jaxpr.invars, views) if view is not None}

  def view_of(var):
    return env.get(var) if isinstance(var, core.Var) else None

  for eqn in jaxpr.eqns:
    ins = [view_of(v) for v in eqn.invars]
    if not any(ins):
      continue
    name = eqn.primitive.name
    params = eqn.params
    outs: list[View | None] = [None] * len(eqn.outvars)
    if name in _VIEWS:
      outs = [ins[0]] + [None] * (len(outs) - 1)
      for view in ins[1:]:
        if view:
          _add(totals, {view[0]: view[1]})
    elif name in _PARTS or name in _WRITES:
      first = ins[0]
      if first:
        share = first[1] * (_size(eqn.outvars[0]) / max(1, _size(eqn.invars[0]))
                            if name in _PARTS else 1.0)
        outs[0] = (first[0], share)
      for view in ins[1:]:  # indices, the block written
        if view:
          _add(totals, {view[0]: view[1]})
    elif name == "cond":
      branch_totals = []
      branch_outs = []
      for branch in params["branches"]:
        mine: dict[int, float] = {}
        branch_outs.append(_walk(_jaxpr(branch), ins[1:], mine))
        branch_totals.append(mine)
      for root in {k for t in branch_totals for k in t}:
        totals[root] = totals.get(root, 0.0) + max(t.get(root, 0.0) for t in branch_totals)
      outs = [o[0] if all(b[i] == o[0] for b in branch_outs) else None
              for i, o in enumerate(zip(*branch_outs))]
    elif name == "while":
      nc, nb = params["cond_nconsts"], params["body_nconsts"]
      _walk(_jaxpr(params["cond_jaxpr"]), ins[:nc] + ins[nc + nb:], totals)
      body_outs = _walk(_jaxpr(params["body_jaxpr"]), ins[nc:], totals)
      carried = ins[nc + nb:]
      outs = [o if o == c else None for o, c in zip(body_outs, carried)]
    elif name == "scan":
      length, nc, ncarry = params["length"], params["num_consts"], params["num_carry"]
      inner = list(ins[:nc + ncarry]) + [
          None if v is None else (v[0], v[1] / length) for v in ins[nc + ncarry:]]
      mine = {}
      body_outs = _walk(_jaxpr(params["jaxpr"]), inner, mine)
      _add(totals, mine, length)
      outs = [o if o == c else None for o, c in zip(body_outs[:ncarry], ins[nc:nc + ncarry])]
      outs += [None] * (len(eqn.outvars) - ncarry)
    elif name == "pallas_call":
      stacked = _stacked_kernel(params)
      for var, view in zip(eqn.invars, ins):
        if view:  # the stacked attention kernel reads one layer of its K and V stacks
          per_layer = stacked and len(var.aval.shape) == 5
          _add(totals, {view[0]: view[1] / (var.aval.shape[0] if per_layer else 1)})
    else:
      inner = [params[k] for k in ("jaxpr", "call_jaxpr", "fun_jaxpr") if k in params]
      if len(inner) == 1 and hasattr(_jaxpr(inner[0]), "eqns"):
        outs = _walk(_jaxpr(inner[0]), ins, totals)[:len(eqn.outvars)]
        outs += [None] * (len(eqn.outvars) - len(outs))
      else:  # the operation takes its operands in: a pass over each
        for view in ins:
          if view:
            _add(totals, {view[0]: view[1]})
    for var, view in zip(eqn.outvars, outs):
      if view is not None:
        env[var] = view
  return [view_of(v) for v in jaxpr.outvars]


def _stacked_kernel(params) -> bool:
  from jakiro_jax.models import tree_attention
  name = params.get("name", params.get("name_and_src_info"))
  return getattr(name, "name", name) == tree_attention.STACKED_KERNEL_NAME


def argument_reads(closed_jaxpr) -> list[float]:
  """For each input of `closed_jaxpr` (a traced program's), how many whole passes over it
  its operations make (0 for one passed through untouched, a fraction for one of which
  only rows are taken, e.g. an embedding lookup)."""
  jaxpr = _jaxpr(closed_jaxpr)
  totals: dict[int, float] = {}
  _walk(jaxpr, [(i, 1.0) for i in range(len(jaxpr.invars))], totals)
  return [totals.get(i, 0.0) for i in range(len(jaxpr.invars))]


def _dot_flops(eqn) -> float:
  """2 x the output's elements x the contracted size."""
  (contract, _), _ = eqn.params["dimension_numbers"]
  lhs = eqn.invars[0].aval.shape
  return 2.0 * _size(eqn.outvars[0]) * math.prod(lhs[d] for d in contract)


def _flops(jaxpr) -> float:
  total = 0.0
  for eqn in jaxpr.eqns:
    name, params = eqn.primitive.name, eqn.params
    if name == "dot_general":
      total += _dot_flops(eqn)
    elif name == "pallas_call":  # the kernels say what they do
      estimate = params.get("cost_estimate")
      total += float(estimate.flops) if estimate is not None else 0.0
    elif name == "cond":  # a platform's alternatives compute the same: the cheapest
      total += min(_flops(_jaxpr(b)) for b in params["branches"])
    elif name == "while":  # its trip count is not in the program: the body once
      total += _flops(_jaxpr(params["body_jaxpr"]))
    elif name == "scan":
      total += params["length"] * _flops(_jaxpr(params["jaxpr"]))
    elif name == "shard_map":  # the body is one device's share: every device runs it
      mesh, axes = params["mesh"], params.get("newly_manual_axes") or params["mesh"].axis_names
      total += math.prod(mesh.shape[a] for a in axes) * _flops(_jaxpr(params["jaxpr"]))
    else:
      inner = [params[k] for k in ("jaxpr", "call_jaxpr", "fun_jaxpr") if k in params]
      if len(inner) == 1 and hasattr(_jaxpr(inner[0]), "eqns"):
        total += _flops(_jaxpr(inner[0]))
  return total


def matmul_flops(closed_jaxpr) -> float:
  """The hand count of a traced program's arithmetic, all devices together: its matmuls
  (2 x M x N x K) and its Pallas kernels' own estimates (`pl.CostEstimate`: the tree
  attention's two products), through calls, `cond` (the cheapest branch: a platform's
  alternatives, e.g. the attention kernels and XLA's expression, do the same), `scan` (every
  iteration) and `shard_map` (each device's share times the devices); element-wise work
  is left out, and a `while` body counts once. Split over the devices it is the least
  arithmetic any device of them can do."""
  return _flops(_jaxpr(closed_jaxpr))
