"""`python -m recmod OUTDIR`: the record_env worker, run as a module (records this module's argv[0])."""

import os
import runpy
import sys

runpy.run_path(
    os.path.join(os.path.dirname(os.path.dirname(__file__)), "record_env.py"),
    init_globals={"MODULE_ARGV0": sys.argv[0], "MODULE_NAME": __name__},
    run_name="__main__",
)
