"""`python -m recmod OUTDIR`: the record_env worker, run as a module."""
import runpy
import os

runpy.run_path(os.path.join(os.path.dirname(os.path.dirname(__file__)), "record_env.py"), run_name="__main__")
