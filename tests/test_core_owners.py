"""One writer for each piece of lane state, and nothing outside the lane core reaching into it.

Rules: the sources are read as Python syntax trees (no code runs); a job's field counts as written where an
assignment (or an augmented one, or a mutating call on it) names it on anything but `self`; the owners are
those job.py's docstring lists.
"""

import ast
import dataclasses
from pathlib import Path

from lanes.core.job import Job

SRC = Path(__file__).parent.parent / "src"
CORE = SRC / "lanes" / "core"
FIELDS = {f.name for f in dataclasses.fields(Job)} | {"key", "max_new"}
OWNERS = {"lanes.py": {"phase", "lane", "table", "cancelled", "outcome", "paused", "done", "generated", "pending",
                       "prompt_logprobs", "read"},
          "admission.py": {"cached", "kept"},
          "job.py": {"key", "max_new"}}  # set once, in the job's __post_init__
MUTATORS = {"append", "extend", "pop", "clear", "remove", "insert"}
LISTS = {"generated", "prompt_logprobs"}  # a job's fields that are lists, grown in place


def writes(tree: ast.AST):
    """(field, line) for each write of a job field in `tree`."""
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            targets = [node.func.value] if getattr(node.func.value, "attr", None) in LISTS else []
        for part in (stored for target in targets for stored in written(target)):
            if part.attr in FIELDS and not (isinstance(part.value, ast.Name) and part.value.id == "self"):
                yield part.attr, node.lineno


def written(target: ast.AST) -> list[ast.Attribute]:
    """The attributes an assignment target stores into (`job.x = `, `job.x[i] = `, `a.x, b.y = `)."""
    if isinstance(target, ast.Attribute):
        return [target]
    if isinstance(target, ast.Subscript):
        return written(target.value)
    if isinstance(target, (ast.Tuple, ast.List)):
        return [part for element in target.elts for part in written(element)]
    return []


def test_each_job_field_is_written_in_one_place_by_its_owner():
    sites: dict[str, list[str]] = {}
    for path in sorted(CORE.glob("*.py")):
        for name, line in writes(ast.parse(path.read_text())):
            sites.setdefault(name, []).append(f"{path.name}:{line}")
    job_py = ast.parse((CORE / "job.py").read_text())
    own = [node for node in ast.walk(job_py) if isinstance(node, ast.Assign) for target in node.targets
           if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"]
    sites.setdefault("key", []).extend(f"job.py:{node.lineno}" for node in own if node.targets[0].attr == "key")
    sites.setdefault("max_new", []).extend(f"job.py:{node.lineno}" for node in own if node.targets[0].attr == "max_new")
    for name, places in sorted(sites.items()):
        assert len(places) == 1, f"{name} is written in {places}"
        owner = next(module for module, fields in OWNERS.items() if name in fields)
        assert places[0].startswith(owner + ":"), f"{name} is written in {places[0]}, not by {owner}"
    assert {"phase", "cancelled", "outcome", "done", "pending", "cached", "kept"} <= set(sites)  # the check sees them


def core_reads(tree: ast.AST, forbidden_public: set[str]):
    """(attribute, line) for each read of a lane core's private (or `forbidden_public`) attribute."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        holder = node.value
        name = holder.attr if isinstance(holder, ast.Attribute) else holder.id if isinstance(holder, ast.Name) else ""
        if name.endswith("core") and (node.attr.startswith("_") or node.attr in forbidden_public):
            yield node.attr, node.lineno


def test_nothing_outside_the_core_reads_its_privates_and_no_server_module_its_pool_cache_or_lanes():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if CORE in path.parents:
            continue
        found += [f"{path.relative_to(SRC)}:{line} .{attr}"
                  for attr, line in core_reads(ast.parse(path.read_text()), {"pool", "cache", "lanes", "decider"})]
    for folder in ("fuzz", "bench"):
        for path in sorted((SRC.parent / folder).glob("*.py")):
            found += [f"{folder}/{path.name}:{line} .{attr}" for attr, line in core_reads(ast.parse(path.read_text()), set())]
    assert found == []


def test_the_lane_core_imports_neither_torch_nor_model_code():
    import subprocess
    import sys

    probe = ("import sys, lanes.core.lane_core, lanes.core.fake, lanes.core.planner; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith(('lanes.families', "
             "'lanes.gpu', 'lanes.backend'))))")
    shown = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert shown.stdout.strip() == "[]", shown.stdout + shown.stderr
