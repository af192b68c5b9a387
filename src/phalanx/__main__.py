"""`python -m phalanx` is the same as the `phalanx` console script."""

from phalanx.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
