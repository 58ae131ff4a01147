"""Executes a notebook headless with its parameters changed, and writes the executed copy (outputs and
all), as papermill does: the new values go in a cell of their own, tagged `injected-parameters`, right
after the cell tagged `parameters`, so the copy shows what it ran with and the source stays as it is.

    python scripts/run_notebook.py notebooks/ablations.ipynb notebooks/ablations.nvidia-h100-x1.ipynb \\
        --set 'MODEL="1b"' --set 'OFFLOAD="disk"' --set 'HOST_BUDGET="8"' --timeout 3000

Each --set is one Python assignment. The notebook runs in its own directory.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

import nbclient
import nbformat


def inject(nb: nbformat.NotebookNode, assignments: list[str]) -> None:
    """Puts `assignments` in a cell after the notebook's `parameters` cell."""
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    if len(tagged) != 1:
        raise SystemExit(f"the notebook has {len(tagged)} cells tagged 'parameters'; it needs exactly one")
    for line in assignments:  # refuse anything but plain assignments before running a thing
        tree = ast.parse(line)
        if not all(isinstance(node, ast.Assign) for node in tree.body):
            raise SystemExit(f"--set {line!r} is not an assignment such as MODEL=\"1b\"")
    cell = nbformat.v4.new_code_cell("# injected by scripts/run_notebook.py\n" + "\n".join(assignments))
    cell.metadata["tags"] = ["injected-parameters"]
    nb.cells.insert(tagged[0] + 1, cell)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebook", type=Path)
    ap.add_argument("executed", type=Path, help="where the executed copy goes")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a parameter (repeat)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per cell")
    args = ap.parse_args()
    nb = nbformat.read(args.notebook, as_version=4)
    inject(nb, args.set)
    client = nbclient.NotebookClient(nb, timeout=args.timeout, kernel_name="python3",
                                     resources={"metadata": {"path": str(args.notebook.resolve().parent)}})  # fmt: skip
    try:
        client.execute()
    finally:  # the copy is written even when a cell fails: its outputs say where
        args.executed.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, args.executed)
    print(f"wrote {args.executed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
