"""Data-path benchmark; same as `flashdraft bench data` (see docs/benchmarks.md).

    PYTHONPATH=. python benchmarks/bench_data.py --samples 902087 --mean-length 256
"""

import argparse
import sys

from flashdraft.data import bench

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    bench.add_arguments(parser)
    sys.exit(bench.run(parser.parse_args()))
