"""`python -m wrapper.cli`: the command line, as the console script runs it."""

from wrapper.cli.main import main

main()
