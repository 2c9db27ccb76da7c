"""The ``megamoe`` command (cli.py), its subcommands, train's model and corpus, and the measurement helpers they share
(perf.py). Nothing in the library imports this package."""
