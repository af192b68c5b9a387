"""Run code cells in a real Jupyter kernel (this interpreter, through nbclient) and return what they
printed: for features that must work inside a notebook (phalanx.spawn, preemption's signals)."""

from __future__ import annotations

from pathlib import Path

import pytest


def run_cells(
    cells: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], timeout: int = 180
) -> str:
    """Execute `cells` in a fresh kernel with `env` set and `tmp_path` as the working directory;
    the cells' stdout, joined. Skips where nbclient, nbformat or ipykernel are missing."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    from ipykernel.kernelspec import write_kernel_spec
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    # A kernel spec of our own, running this interpreter: a user's "python3" spec may point elsewhere.
    write_kernel_spec(tmp_path / "kernels" / "phalanx-test")
    kernel = KernelManager(
        kernel_name="phalanx-test", kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")])
    )
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = nbclient.NotebookClient(
        notebook, km=kernel, timeout=timeout, resources={"metadata": {"path": str(tmp_path)}}
    )
    try:
        client.execute()
    finally:  # nbclient leaves a kernel it was given running, and its client's sockets open (pyzmq
        # warns when they are collected): the kernel would outlive the test session
        if client.kc is not None:
            client.kc.stop_channels()
        if kernel.has_kernel:
            kernel.shutdown_kernel(now=True)
    assert not kernel.is_alive()
    return "".join(o.get("text", "") for cell in notebook.cells for o in cell.outputs if o.get("name") == "stdout")
