"""Benchmarks of flashdraft's hot paths (each module: add_arguments(parser), run(args))."""
