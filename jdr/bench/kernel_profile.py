"""Where a compiled call's device time goes: its kernels' time by HLO instruction, from a jax.profiler trace.

A benchmark figure says how fast; this says why. `profile_calls` runs an already compiled call a few times
under `jax.profiler`, reads the trace's device events (each names the HLO instruction it ran for, `hlo_op`,
and its module, `hlo_module`), keeps the module's own, and sorts their time into kinds of work with the
compiled HLO text: matmuls (dots, cuBLAS / Triton GEMMs), fused attention (cuDNN), Pallas kernels, collectives,
transposes and copies, and the remaining fusions (elementwise and reductions). The largest instructions come
with what they compute (the fused root, its shape and the jax operation it came from), which is what a
change has to aim at.

On GPUs the events are the kernels on the devices' streams (summed over the devices a call runs on); on
CPUs, where XLA runs thunks on host threads, they are those thunks (their own time, nested ones subtracted).
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re
import tempfile
from typing import Callable

import jax

# Lines of a device plane that profilers derive from the kernels (summing them too would count twice).
_DERIVED_LINES = ("XLA Modules", "XLA Ops", "XLA TraceMe", "Steps", "Framework Ops", "Framework Name Scope",
                  "Source code", "TensorFlow Ops", "TensorFlow Name Scope")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=]+) = (?P<shape>.+?) (?P<op>[a-z][a-z0-9\-]*)\(")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[^\s(]+) \(.*\{\s*$")
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                "collective-broadcast")
CATEGORIES = ("matmul", "fused attention", "pallas kernel", "collective", "transpose / copy",
              "other fusion (elementwise, reductions)", "unattributed")


@dataclasses.dataclass
class Instruction:
  name: str
  opcode: str
  shape: str
  line: str
  operands: tuple[str, ...] = ()
  in_entry: bool = True  # runs once a call (an instruction of a loop body may run many times)


def parse_hlo(text: str) -> tuple[str, dict[str, list[Instruction]]]:
  """(module name, computation name -> its instructions) of an HLO module's text."""
  module = ""
  computations: dict[str, list[Instruction]] = {}
  current, entry = None, False
  for line in text.splitlines():
    if line.startswith("HloModule "):
      module = line.split()[1].rstrip(",")
      continue
    match = _COMPUTATION.match(line)
    if match and "=" not in line.split("(")[0]:
      current, entry = match.group("name"), line.startswith("ENTRY")
      computations[current] = []
      continue
    if line.startswith("}"):
      current = None
      continue
    match = _INSTRUCTION.match(line) if current is not None else None
    if match:
      computations[current].append(Instruction(match.group("name"), match.group("op"),
                                               re.sub(r"\{[^}]*\}", "", match.group("shape")), line,
                                               _operand_names(line, match.end()), entry))
  return module, computations


def _operand_names(line: str, start: int) -> tuple[str, ...]:
  """The operand names of an instruction whose operand list opens just before `start` (each operand may be
  printed with its shape first: `bf16[8,768]{1,0} %x`)."""
  parts, depth, begin = [], 0, start
  for i in range(start, len(line)):
    c = line[i]
    if c in "([{":
      depth += 1
    elif c in ")]}":
      if depth == 0:
        parts.append(line[begin:i])
        break
      depth -= 1
    elif c == "," and depth == 0:
      parts.append(line[begin:i])
      begin = i + 1
  return tuple(p.split()[-1].lstrip("%") for p in parts if p.strip())


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape (a tuple's elements summed): `bf16[1024,768]` is 1,572,864."""
  total = 0
  for dtype, dims in re.findall(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]", shape):
    digits = re.match(r"[a-z]+(\d+)", dtype)  # f32, bf16, s8, f8e4m3fn: the first number is the width
    bits = 8 if dtype == "pred" else int(digits.group(1)) if digits else 0
    elements = 1
    for d in filter(None, dims.split(",")):
      elements *= int(d)
    total += elements * bits // 8
  return total


# Ops that read only part of their first operand: a fusion that takes a matrix only through them reads the
# rows they pick, not the matrix (an in-step retrieval's candidate rows out of the whole corpus).
_PARTIAL_READS = ("gather", "dynamic-slice", "slice")


def traffic_bytes(instruction: Instruction, instructions: dict[str, Instruction],
                  computations: dict[str, list[Instruction]] | None = None) -> int:
  """What an instruction must move at the least: each operand read once and its result written once. Its
  time against this (GB/s) says how far a kernel runs from memory speed. Given the module's `computations`, a
  fusion's operand that its fused computation only gathers or slices counts as what those pick."""
  partial = _partially_read(instruction, computations) if computations else {}
  return shape_bytes(instruction.shape) + sum(
      partial.get(i, shape_bytes(instructions[o].shape))
      for i, o in enumerate(instruction.operands) if o in instructions)


def _partially_read(instruction: Instruction, computations) -> dict[int, int]:
  """{operand index: bytes read} for a fusion's operands used only by gathers / slices inside it."""
  if instruction.opcode != "fusion":
    return {}
  body = computations.get(_attribute(instruction.line, "calls"), [])
  users: dict[str, list[Instruction]] = {}
  for inner in body:
    for name in inner.operands[:1]:  # the operand that is read in part is the first
      users.setdefault(name, []).append(inner)
    for name in inner.operands[1:]:
      users.setdefault(name, []).append(None)  # used whole (or as indices)
  out = {}
  for inner in body:
    index = re.search(r"\bparameter\((\d+)\)", inner.line) if inner.opcode == "parameter" else None
    readers = users.get(inner.name, [])
    if index and readers and all(r is not None and r.opcode in _PARTIAL_READS for r in readers):
      out[int(index.group(1))] = min(shape_bytes(inner.shape), sum(shape_bytes(r.shape) for r in readers))
  return out


def _attribute(line: str, key: str) -> str:
  match = re.search(key + r'=("(?:[^"\\]|\\.)*"|%?[\w.\-]+)', line)
  return match.group(1).strip('"').lstrip("%") if match else ""


def _called(instruction: Instruction, computations) -> list[Instruction]:
  """The instructions of the computation a fusion (or call) runs, nested fusions included."""
  name = _attribute(instruction.line, "calls")
  out = []
  for inner in computations.get(name, []):
    out.append(inner)
    if inner.opcode in ("fusion", "call"):
      out.extend(_called(inner, computations))
  return out


def categorize(instruction: Instruction, computations) -> str:
  """Which kind of work an instruction is (one of CATEGORIES)."""
  op, line = instruction.opcode, instruction.line
  if op in ("dot", "convolution"):
    return "matmul"
  if op == "custom-call":
    target = _attribute(line, "custom_call_target").lower()
    if "fmha" in target or "attention" in target or "sdpa" in target:
      return "fused attention"
    if "triton" in target or "pallas" in target:
      return "pallas kernel"
    if any(word in target for word in ("gemm", "cublas", "matmul", "dot")):
      return "matmul"
    return "other fusion (elementwise, reductions)"
  if any(op.startswith(c) for c in _COLLECTIVES):
    return "collective"
  if op in ("transpose", "copy", "copy-start", "copy-done"):
    return "transpose / copy"
  if op in ("fusion", "call"):
    inner = _called(instruction, computations)
    if "gemm" in line or any(i.opcode in ("dot", "convolution") for i in inner):
      return "matmul"
    inner_kinds = {categorize(i, computations) for i in inner if i.opcode == "custom-call"}
    for kind in ("fused attention", "pallas kernel"):
      if kind in inner_kinds:
        return kind
    root = next((i for i in inner if i.line.lstrip().startswith("ROOT")), None)
    if root is not None and root.opcode in ("transpose", "copy"):
      return "transpose / copy"
  return "other fusion (elementwise, reductions)"


def describe(instruction: Instruction, computations) -> str:
  """What an instruction computes, briefly: its opcode (a fusion's root), its shape, its jax operation."""
  root = instruction
  if instruction.opcode == "fusion":
    inner = _called(instruction, computations)
    root = next((i for i in reversed(inner) if i.line.lstrip().startswith("ROOT")), instruction)
  op_name = _attribute(root.line, "op_name") or _attribute(instruction.line, "op_name")
  op_name = re.sub(r"^jit\([^)]*\)/", "", op_name)
  if len(op_name) > 90:
    op_name = "..." + op_name[-87:]
  return f"{root.opcode} {instruction.shape} {op_name}".strip()


@dataclasses.dataclass
class KernelEvent:
  module: str
  op: str
  start_ns: float
  duration_ns: float
  line: str
  program: str = ""  # the executable's program id, where the trace says (modules may share a name)


def device_events(data) -> list[KernelEvent]:
  """The events of a jax.profiler.ProfileData that ran for an HLO instruction: a device's stream kernels
  where the trace has device planes, else the host threads' thunks (XLA's CPU backend)."""
  def events_of(planes):
    out = []
    for plane in planes:
      for line in plane.lines:
        if line.name in _DERIVED_LINES:
          continue
        for event in line.events:
          stats = dict(event.stats)
          if "hlo_op" in stats:
            out.append(KernelEvent(str(stats.get("hlo_module", "")), str(stats["hlo_op"]),
                                   float(event.start_ns), float(event.duration_ns), f"{plane.name}/{line.name}",
                                   str(stats.get("program_id", ""))))
    return out
  planes = list(data.planes)
  on_devices = events_of([p for p in planes if p.name.startswith("/device:")])
  return on_devices or events_of([p for p in planes if p.name.startswith("/host:")])


def self_times(events: list[KernelEvent]) -> list[tuple[KernelEvent, float]]:
  """Each event with its own time: its duration less that of events nested in it on the same line (a CPU
  thunk that runs others, such as a while loop, would otherwise count them twice)."""
  out = []
  by_line = collections.defaultdict(list)
  for event in events:
    by_line[event.line].append(event)
  for line_events in by_line.values():
    line_events.sort(key=lambda e: (e.start_ns, -e.duration_ns))
    stack: list[list] = []  # [event, own time so far]
    for event in line_events:
      while stack and event.start_ns >= stack[-1][0].start_ns + stack[-1][0].duration_ns:
        out.append(tuple(stack.pop()))
      if stack:
        stack[-1][1] -= event.duration_ns
      stack.append([event, event.duration_ns])
    out.extend(tuple(s) for s in stack)
  return out


def own_events(events: list[KernelEvent], module: str, instructions) -> list[KernelEvent]:
  """The events of the module the HLO text is. Two jitted lambdas are both `jit__lambda`, so where the trace
  gives program ids the module is the program all of whose ops it has (the busiest, if several); a kernel
  whose annotation lacks its module belongs to it when the module has its op."""
  named = [e for e in events if e.module == module or (not e.module and e.op in instructions)]
  programs = collections.defaultdict(list)
  for e in named:
    programs[e.program].append(e)
  fitting = [p for p, evs in programs.items() if all(e.op in instructions for e in evs)]
  if not fitting:
    return named
  return max((programs[p] for p in fitting), key=lambda evs: sum(e.duration_ns for e in evs))


def summarize(events: list[KernelEvent], hlo_text: str, calls: int, top: int = 12) -> dict:
  """Per call: the kernels' total ms, by category, and the `top` instructions by time."""
  module, computations = parse_hlo(hlo_text)
  instructions = {i.name: i for body in computations.values() for i in body}
  mine = own_events(events, module, instructions)
  if not mine:
    seen = sorted({e.module for e in events})[:10]
    return {"error": f"no device events of module {module!r} in the trace (modules seen: {seen})"}
  per_op = collections.defaultdict(lambda: [0.0, 0])
  for event, own_ns in self_times(mine):
    per_op[event.op][0] += own_ns
    per_op[event.op][1] += 1
  total_ns = sum(ns for ns, _ in per_op.values())
  by_category = collections.Counter()
  rows = []
  for op, (ns, count) in per_op.items():
    instruction = instructions.get(op)
    category = categorize(instruction, computations) if instruction else "unattributed"
    by_category[category] += ns
    moved = traffic_bytes(instruction, instructions, computations) if instruction else 0
    if instruction and not instruction.in_entry:
      moved *= count // calls  # each event one run of a loop body's instruction (on GPUs one kernel each)
    rows.append((ns, op, count, category, describe(instruction, computations) if instruction else "", moved))
  rows.sort(reverse=True)
  ms = lambda ns: round(ns / 1e6 / calls, 3)  # pylint: disable=unnecessary-lambda-assignment
  share = lambda ns: round(ns / total_ns, 3) if total_ns else 0.0  # pylint: disable=unnecessary-lambda-assignment
  return {"calls": calls, "module": module, "kernel_ms": ms(total_ns),
          "by_category": {c: {"ms": ms(ns), "share": share(ns)} for c, ns in by_category.most_common()},
          "top": [{"op": op, "category": category, "ms": ms(ns), "share": share(ns), "events": count // calls,
                   "bytes_a_call": moved, "gbps": round(moved / (ns / calls), 1) if ns else 0.0, "what": what}
                  for ns, op, count, category, what, moved in rows[:top]]}


def table(profile: dict, title: str) -> str:
  """The summary as a few readable lines (the JSON holds the same figures)."""
  if "error" in profile:
    return f"{title}: {profile['error']}"
  lines = [f"{title}: {profile['kernel_ms']} ms of kernels a call ({profile['module']})"]
  lines += [f"  {c:<40} {v['ms']:>9.3f} ms {100 * v['share']:5.1f}%" for c, v in profile["by_category"].items()]
  lines += [f"  {100 * r['share']:5.1f}% {r['ms']:9.3f} ms x{r['events']:<3} {r['gbps']:8.1f} GB/s "
            f"{r['op']}: {r['what']}"
            for r in profile["top"]]
  return "\n".join(lines)


def profile_calls(run: Callable[[], None], hlo_text: str, calls: int = 3) -> dict:
  """Runs `run()` (one call of a compiled function, returning once the device is done) `calls` times under
  jax.profiler and summarizes the device time of the module `hlo_text` is the compiled text of
  (`jitted.lower(*args).compile().as_text()`, which reuses the executable the jitted call already built)."""
  run()  # nothing of the first call (allocation, a lazy compile) belongs in the picture
  with tempfile.TemporaryDirectory(prefix="jdr-profile-") as directory:
    jax.profiler.start_trace(directory)
    try:
      for _ in range(calls):
        run()
    finally:
      jax.profiler.stop_trace()
    paths = sorted(glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True))
    if not paths:
      return {"error": f"jax.profiler wrote no trace under {directory}"}
    data = jax.profiler.ProfileData.from_file(paths[-1])
    return summarize(device_events(data), hlo_text, calls)


# Entry-computation instructions that launch no kernel of their own.
_NO_KERNEL = ("parameter", "constant", "get-tuple-element", "tuple", "bitcast", "opt-barrier", "after-all",
              "partition-id", "replica-id")


def _group(what: str) -> str:
  """An instruction's description with its numbers replaced, so the same work in every layer is one group."""
  return re.sub(r"\d+", "#", what)


def compiled_summary(hlo_text: str, bandwidth: float | None = None, top: int = 12) -> dict:
  """What a compiled module asks of the device, read from its optimized HLO without running it: its kernels
  (the entry computation's instructions that launch one) by category, with the least bytes each must move
  (operands read once, result written once) and, given `bandwidth` (bytes/s), the time that traffic takes at
  it; and the `top` groups of alike instructions (the same work in every layer) by that traffic.

  The time is a lower bound for memory-bound work (elementwise, reductions, transposes, attention); a
  matmul's time is set by its FLOPs instead. Kernels of loop bodies (`while`) run many times and are not
  counted: `loops` says how many loops the entry has."""
  _, computations = parse_hlo(hlo_text)
  instructions = {i.name: i for body in computations.values() for i in body}
  entry = next((body for body in computations.values() if body and body[0].in_entry), [])
  by_category = collections.defaultdict(lambda: [0, 0])
  groups = collections.defaultdict(lambda: [0, 0])
  for instruction in entry:
    if instruction.opcode in _NO_KERNEL or instruction.opcode == "while":
      continue
    category = categorize(instruction, computations)
    moved = traffic_bytes(instruction, instructions, computations)
    by_category[category][0] += 1
    by_category[category][1] += moved
    key = (category, _group(describe(instruction, computations)))
    groups[key][0] += 1
    groups[key][1] += moved
  at = lambda b: round(1e3 * b / bandwidth, 3) if bandwidth else None  # pylint: disable=unnecessary-lambda-assignment
  total = sum(b for _, b in by_category.values())
  return {"kernels": sum(n for n, _ in by_category.values()),
          "loops": sum(i.opcode == "while" for i in entry),
          "gigabytes": round(total / 1e9, 3), "ms_at_bandwidth": at(total),
          "by_category": {c: {"kernels": n, "gigabytes": round(b / 1e9, 3), "ms_at_bandwidth": at(b)}
                          for c, (n, b) in sorted(by_category.items(), key=lambda kv: -kv[1][1])},
          "top": [{"category": c, "what": what, "kernels": n, "gigabytes": round(b / 1e9, 3),
                   "ms_at_bandwidth": at(b)}
                  for (c, what), (n, b) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]]}


def compiled_table(summary: dict, title: str) -> str:
  """compiled_summary as a few readable lines."""
  ms = lambda v: f"{v:9.3f} ms" if v is not None else ""  # pylint: disable=unnecessary-lambda-assignment
  lines = [f"{title}: {summary['kernels']} kernels, {summary['gigabytes']:.2f} GB of least traffic "
           f"{ms(summary['ms_at_bandwidth'])}" + (f" ({summary['loops']} loops not counted)" if summary["loops"]
                                                   else "")]
  lines += [f"  {c:<40} {v['kernels']:5d} kernels {v['gigabytes']:8.2f} GB {ms(v['ms_at_bandwidth'])}"
            for c, v in summary["by_category"].items()]
  lines += [f"  {r['gigabytes']:8.2f} GB {ms(r['ms_at_bandwidth'])} x{r['kernels']:<4} {r['category'].split(' (')[0]:<16} "
            f"{r['what']}" for r in summary["top"]]
  return "\n".join(lines)
