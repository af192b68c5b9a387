"""scripts/bootstrap names each package pip installs: "Collecting" lines (downloads) and "Processing"
lines (wheels from a local cache or index folder, which it left out)."""

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bootstrap"


def test_collecting_and_processing_lines_are_both_listed():
    pip_output = (
        "Looking in links: /wheels\n"
        "Collecting numpy>=1.24 (from phalanx==0.1)\n"
        "Processing /wheels/torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl (from phalanx)\n"
        "Processing ./vendored/tiny_pkg\n"
        "Installing collected packages: numpy, torch\n"
    )
    function = "\n".join(SCRIPT.read_text().split("name_packages() {", 1)[1].split("\n}\n", 1)[0].splitlines())
    shell = f"name_packages() {{{function}\n}}\nname_packages"
    result = subprocess.run(["bash", "-c", shell], input=pip_output, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        "  numpy>=1.24",
        "  torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl",
        "  tiny_pkg",
    ]
