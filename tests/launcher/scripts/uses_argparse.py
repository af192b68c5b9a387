"""A script with argparse options of its own (--lr): a launcher flag after it is rejected there."""

import argparse

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=0.1)
print("lr", parser.parse_args().lr)
