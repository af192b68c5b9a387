"""Issue 42 item 8: a dimension is added through the layout object in at most 5 places outside its
own package. Expert parallel (`ep`, strategies/expert_parallel/) is the worked example: outside that
package it may be named in its plan field (strategies/plan/parallel_plan.py), its setting row
(config/schema.py), the presets that read and refuse it (strategies/plan/presets.py), its groups
(strategies/layout.py's PARTS/JOINED) and the one registry of per-model dimensions
(strategies/dimensions.py); everything else asks hooks (docs/architecture.md, "Adding a mesh dimension").

What "names ep" means, precisely: in a source file's *code* (Python tokens; comments and docstrings
do not count),
- a name token `ep`, `ep_<anything>` or `expert_parallel` (the degree `plan.ep`, `ep=`, `ep_plan`,
  `ep_replicate`, an import of the package), or
- a string literal whose whole value is `ep`, `ep_<anything>` or `--ep` (the setting's or a group's
  name, the flag).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "phalanx"
HOME = SRC / "strategies" / "expert_parallel"
MOST = 5
NAME = re.compile(r"(ep|ep_\w+|expert_parallel)")
STRING = re.compile(r"(ep|ep_\w+|--ep)")


def names_ep(source: str) -> list[str]:
    """Each token of `source`'s code that names ep (above), as `line:token`."""
    found = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.NAME and NAME.fullmatch(token.string):
            found.append(f"{token.start[0]}:{token.string}")
        elif token.type == tokenize.STRING and not token.string.lstrip("rbuRBU").startswith(("f", "F")):
            value = ast.literal_eval(token.string)
            if isinstance(value, str) and STRING.fullmatch(value):
                found.append(f"{token.start[0]}:{token.string}")
    return found


def places(root: Path, home: Path) -> dict[str, list[str]]:
    """file (relative to `root`) -> its tokens naming ep, for every source file outside `home`."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        if home in path.parents:
            continue
        tokens = names_ep(path.read_text())
        if tokens:
            found[str(path.relative_to(root))] = tokens
    return found


def test_ep_is_named_in_at_most_5_places_outside_its_package():
    found = places(SRC, HOME)
    assert len(found) <= MOST, (
        f"ep is named in {len(found)} source files outside strategies/expert_parallel/ (at most {MOST}): "
        f"{found}. HINT: ask a hook of strategies/dimensions.py (or the layout by name) instead"
    )


def test_the_count_sees_code_and_not_comments_or_docstrings(tmp_path):
    home = tmp_path / "expert_parallel"
    home.mkdir()
    (home / "inside.py").write_text("ep = 2\n")
    (tmp_path / "generic.py").write_text('"""Under ep, the experts."""\n# ep: a comment\nsteps = 2  # ep\n')
    (tmp_path / "planted.py").write_text("def degree(plan):\n    return plan.ep\n")
    (tmp_path / "group.py").write_text('def group(layout):\n    return layout.group("ep_replicate")\n')
    (tmp_path / "epoch.py").write_text("for epoch in range(2):\n    step = 'epoch'\n")
    assert places(tmp_path, home) == {"group.py": ['2:"ep_replicate"'], "planted.py": ["2:ep"]}
